"""KV cache block accounting: which physical blocks each sequence's tokens live in. No tensors.

The KV cache of every layer is cut into ``num_blocks`` blocks of ``block_size`` token slots, one pool
shared by all sequences (PagedAttention paper, section 4.2). A sequence's *block table* maps its
logical blocks, in token order, to physical blocks anywhere in the pool:

    tokens      t0 .. t15 | t16 .. t31 | t32 t33 t34 _ _ ... _      (block_size = 16)
    logical     block 0   | block 1    | block 2 (3 of 16 slots filled)
    block table [   7     ,    2       ,    11   ]                 -> physical blocks in the pool

    slot of token j = block_table[j // block_size] * block_size + j % block_size

A new physical block is taken only when the last one is full, so at most ``block_size - 1`` slots
per sequence are ever reserved but empty; a finished or preempted sequence returns all its blocks.
Reference counts say how many block tables hold each block (here always 0 or 1; sharing builds
on them).
"""
from __future__ import annotations

from collections import deque


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class NoFreeBlocksError(RuntimeError):
    """Raised by ``allocate`` when the pool cannot cover the request (callers check ``can_allocate``)."""


class BlockManager:
    """Allocates physical KV blocks to sequences.

    Args:
        num_blocks: blocks in the pool (>= 1).
        block_size: token slots per block (>= 1).

    Invariants (checked by the property tests): every block is either free (ref count 0, in the
    free pool exactly once) or held by >= 1 block table; a block is never handed to two owners
    unless shared on purpose; freeing every sequence leaves the pool full.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._tables: dict[int, list[int]] = {}
        self._num_tokens: dict[int, int] = {}  # slots of each sequence that hold (or will hold) tokens

    # ----- queries -------------------------------------------------------------------------------
    def block_table(self, seq_id: int) -> list[int]:
        """The sequence's block table (logical -> physical); empty if it holds no blocks."""
        return self._tables.get(seq_id, [])

    def num_tokens(self, seq_id: int) -> int:
        """Token slots of the sequence that hold tokens."""
        return self._num_tokens.get(seq_id, 0)

    def blocks_needed(self, seq_id: int, num_tokens: int) -> int:
        """How many new blocks the sequence needs to hold ``num_tokens`` tokens in all."""
        return max(0, cdiv(num_tokens, self.block_size) - len(self.block_table(seq_id)))

    def can_allocate(self, seq_id: int, num_tokens: int) -> bool:
        return self.blocks_needed(seq_id, num_tokens) <= len(self._free)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_used_slots(self) -> int:
        """Token slots holding real tokens, over all sequences."""
        return sum(self._num_tokens.values())

    @property
    def num_allocated_slots(self) -> int:
        """Token slots in blocks that are in use."""
        return self.num_used_blocks * self.block_size

    def utilization(self) -> float:
        """Slots holding real tokens / slots allocated (the paper's KV utilisation; 1.0 when idle)."""
        allocated = self.num_allocated_slots
        return self.num_used_slots / allocated if allocated else 1.0

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def free_block_ids(self) -> list[int]:
        return list(self._free)

    # ----- changes -------------------------------------------------------------------------------
    def allocate(self, seq_id: int, num_tokens: int) -> None:
        """Grow the sequence's block table so that it holds ``num_tokens`` tokens in all.

        Takes new blocks only for slots past the last block's end. Shrinking is not allowed.
        Raises NoFreeBlocksError (and changes nothing) when the pool is too small.
        """
        if num_tokens < self.num_tokens(seq_id):
            raise ValueError(f"sequence {seq_id} cannot shrink from {self.num_tokens(seq_id)} to {num_tokens} tokens")
        needed = self.blocks_needed(seq_id, num_tokens)
        if needed > len(self._free):
            raise NoFreeBlocksError(f"sequence {seq_id} needs {needed} blocks, {len(self._free)} free")
        table = self._tables.setdefault(seq_id, [])
        for _ in range(needed):
            block = self._free.popleft()
            self._ref_counts[block] = 1
            table.append(block)
        self._num_tokens[seq_id] = num_tokens

    def free(self, seq_id: int) -> None:
        """Return every block of the sequence to the pool (a no-op for an unknown sequence)."""
        for block in self._tables.pop(seq_id, []):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free.append(block)
        self._num_tokens.pop(seq_id, None)
