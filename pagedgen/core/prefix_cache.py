"""The prefix cache: full KV blocks found again by the tokens they hold (PagedAttention paper, section
4.4; vLLM's automatic prefix caching). No tensors.

A full block is named by a hash of its parent block's name and its own token ids (``hash_block``), so
a name stands for every token from the start of the sequence to the block's end, and equal prefixes
give equal chains of names. The cache maps names to physical blocks and each block to its name; which
blocks are free, held or shared, when a block is full and when it is handed out again is the block
manager's (``block_manager``, whose docstring has the block table and the invariants):

- a block is named when the block manager fills it with committed tokens (never lookahead slots for
  draft tokens: those are allocated without token ids), and only if its name finds no other block;
- a block stays findable after its last owner frees it, until the block manager hands it out empty
  (``forget``): the free queue gives out the least recently freed block first (LRU);
- after an aborted step the whole cache is emptied (``clear``; see ``block_pool_check``).
"""
from __future__ import annotations

from typing import ItemsView, Optional, Sequence

from pagedgen.core.blocks import hash_block


class PrefixCache:
    """Block names -> physical blocks, and back.

    Args:
        num_blocks: blocks in the pool.
        block_size: token slots per block.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self._blocks: dict[bytes, int] = {}  # name -> physical block
        self._names: list[Optional[bytes]] = [None] * num_blocks  # physical block -> its name (None: unnamed)

    def __len__(self) -> int:
        """Blocks findable by their name."""
        return len(self._blocks)

    def items(self) -> ItemsView[bytes, int]:
        """(name, physical block) of every findable block."""
        return self._blocks.items()

    def name_of(self, block: int) -> Optional[bytes]:
        """The block's name (None: it has none)."""
        return self._names[block]

    def is_cached(self, block: int) -> bool:
        """True when the block is findable by its name."""
        h = self._names[block]
        return h is not None and self._blocks.get(h) == block

    def match(self, token_ids: Sequence[int], salt: Optional[bytes] = None) -> list[int]:
        """Findable full blocks holding a prefix of ``token_ids[:-1]`` under ``salt`` (the adapter's
        key, ``hash_block``), in order (changes nothing)."""
        blocks: list[int] = []
        parent = None
        bs = self.block_size
        for i in range((len(token_ids) - 1) // bs):
            parent = hash_block(parent, token_ids[i * bs : (i + 1) * bs], salt)
            block = self._blocks.get(parent)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def name_full_blocks(self, table: list[int], hashes: list[bytes], released: int, num_tokens: int,
                         token_ids: Sequence[int], salt: Optional[bytes] = None) -> None:
        """Name a sequence's blocks that are now full and offer them to the cache.

        Args:
            table: the sequence's block table.
            hashes: the names of its full blocks so far, in order; extended here to ``num_tokens //
                block_size`` names.
            released: its leading block-table entries released before its sliding window (named, not
                offered: they hold no block).
            num_tokens: its tokens held in its blocks.
            token_ids: its tokens (at least ``num_tokens``).
            salt: its adapter's key (``hash_block``; None: the base model).
        """
        bs = self.block_size
        while len(hashes) < num_tokens // bs:
            i = len(hashes)
            name = hash_block(hashes[-1] if hashes else None, token_ids[i * bs : (i + 1) * bs], salt)
            hashes.append(name)
            block = table[i]
            if i >= released and self._names[block] is None and name not in self._blocks:
                self._names[block] = name
                self._blocks[name] = block

    def forget(self, block: int) -> None:
        """The block is handed out empty: its name no longer finds it, and it has none."""
        name = self._names[block]
        if name is not None:
            if self._blocks.get(name) == block:
                del self._blocks[name]
            self._names[block] = None

    def clear(self) -> None:
        """Nothing findable, no block named."""
        self._blocks = {}
        self._names = [None] * len(self._names)
