"""Small facts about KV blocks shared by the block manager and its checker: the placeholder of a
released block-table entry, ceiling division, and the name of a full block for prefix caching."""
from __future__ import annotations

import hashlib
from array import array
from typing import Optional, Sequence

RELEASED = 0  # block-table entry of a block released before the sliding window (never read)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hash_block(parent: Optional[bytes], token_ids: Sequence[int], salt: Optional[bytes] = None) -> bytes:
    """Name of a full block: sha256 over the parent block's name and this block's token ids. A
    first block (no parent) starts from ``salt`` (a LoRA adapter's key: ``Sequence.cache_salt``)
    or, for the base model, from b"root", so equal tokens under two adapters get two names."""
    h = hashlib.sha256(parent or salt or b"root")
    h.update(array("q", token_ids).tobytes())
    return h.digest()
