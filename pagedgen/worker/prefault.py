"""Fault in the pages of a CPU KV cache in bulk, ahead of the blocks a step writes.

The CPU cache tensors are ``torch.empty``: the operating system backs a page with memory only when
it is first written, so the cache holds resident only the blocks used so far. Left to the kernels,
that first write happens inside ``reshape_and_cache`` (or a block copy) in the middle of a step,
one page fault at a time, taken by one thread of a parallel region while the others wait at its
end. On the 2-core KVM guest of benchmarks/results/history.md, faulting the blocks in beforehand made
random-135m's 256-request TinyStories job 5-8% faster in each of three side-by-side pairs
(stories260K's: ~3%, the median of eight).

So before each step the model runner calls ``Prefaulter.before_step`` with the blocks the step may
write (new block-table entries, copy-on-write and swap-in destinations); when one lies past the
blocks touched so far, the next run of blocks is zeroed in every layer at once, at least
``CHUNK_BYTES`` of them, so that a growing job pays one bulk fill per chunk. Blocks past the
touched ones have never been written (every write is to a block some step named, and each step's
blocks are touched before it runs), so zeroing them loses nothing. The block manager hands out
never-used blocks lowest id first, so resident memory stays close to the blocks in use rather
than the whole pool.
"""
from __future__ import annotations

from typing import Iterable

import torch

#: bytes of KV cache (all layers, keys and values) touched at least at a time
CHUNK_BYTES = 64 << 20


class Prefaulter:
    """Touches the KV cache's blocks ``[0, touched)`` before any step writes into them.

    Args:
        kv_caches: one (key_cache, value_cache) pair per layer, each [num_blocks, block_size,
            num_kv_heads, head_dim], on the CPU (a 1-byte cache: and its two scale tensors).
        block_bytes: bytes of one block over all layers, keys and values.
        chunk_bytes: touch at least this many bytes of blocks at a time (``CHUNK_BYTES``).
    """

    def __init__(self, kv_caches: list[tuple[torch.Tensor, ...]], block_bytes: int, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.kv_caches = kv_caches
        self.num_blocks = kv_caches[0][0].shape[0] if kv_caches else 0
        self.chunk_blocks = max(1, chunk_bytes // max(1, block_bytes))
        self.touched = 0  # blocks [0, touched) have been zeroed here (and may hold tokens since)

    def before_step(self, block_table_updates: dict, block_pairs: Iterable[list[tuple[int, int]]]) -> None:
        """Touch every block the step may write: the entries of ``block_table_updates`` (seq_id ->
        (start, new entries)) and the destinations of ``block_pairs`` ((src, dst) lists: copies,
        swap-ins)."""
        top = -1
        for _, entries in block_table_updates.values():
            if entries:
                top = max(top, max(entries))
        for pairs in block_pairs:
            for _, dst in pairs:
                top = max(top, dst)
        if top < self.touched:
            return
        end = min(self.num_blocks, max(top + 1, self.touched + self.chunk_blocks))
        for layer in self.kv_caches:  # keys and values (and a 1-byte cache's scales)
            for t in layer:
                t[self.touched : end].zero_()
        self.touched = end
