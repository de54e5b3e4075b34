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

**Sliding window** (``sliding_window`` W > 0: every layer attends over (p - W, p], Mistral). A
sequence whose next token to compute is at position c never reads keys before c - W + 1 again, so
its logical blocks wholly before that position are *released* (reference count - 1, back to the
pool at 0) when it next allocates. Their block-table entries become ``RELEASED`` placeholders, so
logical indices stay right; the kernels never read them (the window), like the padding of the
step's block tables. With block_size B, a step computing n tokens of a sequence holds at most

    ceil((W + n - 2) / B) + 1 blocks of it; decoding (n = 1): ceil((W - 1) / B) + 1 <= ceil(W / B) + 1

(the W - 1 + n positions from c - W + 1 to c + n - 1), in place of ceil((c + n) / B). A released
block that is shared (fork, beams) or cached stays with its other owners / findable in the prefix
cache exactly as after ``free``. Models where some layer attends over everything keep every block
(W = 0; the engine sets W only when every layer has a window: ``ModelConfig.sliding_window``).

Sharing (paper sections 4.3-4.4):
- **Reference counts.** A block may sit in several block tables (``fork``: parallel samples, beams);
  it returns to the pool when its count drops to 0.
- **Copy-on-write.** Full blocks are never written again, so only a sequence's last, partly filled
  block can be written while shared. ``allocate`` then gives the writer a fresh block and records a
  (src, dst) copy, which the model runner performs with the ``copy_blocks`` op before the step.
- **Prefix caching** (``enable_prefix_caching``). A full block is named by a hash of its parent's
  hash and its token ids, so equal prefixes give equal hash chains. ``match_prefix`` finds the
  cached full blocks of a new sequence's tokens; they are shared instead of recomputed. At most
  ``len(tokens) - 1`` tokens can hit: the last token is always computed, since its logits are needed
  to sample (a prompt that is an exact multiple of the block size recomputes its last block).
  Blocks whose count drops to 0 keep their hash and stay findable until the pool needs them:
  the free queue hands out the least recently freed block first and forgets its hash then (LRU).
  The names and the lookup are ``prefix_cache``'s.

**After an aborted step nothing stays findable**: see ``block_pool_check``, which holds ``check`` and
``repair``.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Sequence

from pagedgen.core import block_pool_check
from pagedgen.core.blocks import RELEASED, cdiv, hash_block
from pagedgen.core.prefix_cache import PrefixCache

__all__ = ["RELEASED", "BlockManager", "NoFreeBlocksError", "cdiv", "hash_block"]


class NoFreeBlocksError(RuntimeError):
    """Raised by ``allocate`` when the pool cannot cover the request (callers check ``can_allocate``)."""


class BlockManager:
    """Allocates physical KV blocks to sequences, with reference counts, copy-on-write and an
    optional prefix cache.

    Args:
        num_blocks: blocks in the pool (>= 1).
        block_size: token slots per block (>= 1).
        enable_prefix_caching: name full blocks by their token prefix and reuse them.
        sliding_window: tokens every layer attends over (0: all); blocks wholly before it are
            released (see the module docstring).

    Invariants (checked by the property tests): a block with reference count 0 is in the free
    queue exactly once, a block with count c > 0 is in exactly c block tables (counting only the
    entries past each table's released ones) and not in the free queue; no block is lost; freeing
    every sequence leaves the pool full.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False, sliding_window: int = 0) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        if sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0 tokens (0: no window), got {sliding_window}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU first
        self._ref_counts = [0] * num_blocks
        self._filled = [0] * num_blocks  # slots of each physical block that hold tokens
        self._tables: dict[int, list[int]] = {}
        self._released: dict[int, int] = {}  # leading RELEASED entries of a table (absent: 0)
        self._num_tokens: dict[int, int] = {}  # tokens of each sequence in its blocks
        self._hashes: dict[int, list[bytes]] = {}  # names of each sequence's full blocks, in order
        self._prefix_cache = PrefixCache(num_blocks, block_size)  # the prefix cache: block names <-> physical blocks
        self._pending_copies: list[tuple[int, int]] = []
        self._used_slots = 0  # sum of _filled over blocks in use
        self._logical_blocks = 0  # sum of block-table lengths
        self.num_prefix_queries = 0  # tokens looked up in the prefix cache
        self.num_prefix_hits = 0  # of those, tokens found
        self.num_copies = 0  # copy-on-write block copies

    # ----- queries -------------------------------------------------------------------------------
    def block_table(self, seq_id: int) -> list[int]:
        """The sequence's block table (logical -> physical); empty if it holds no blocks. Its first
        ``num_released(seq_id)`` entries are ``RELEASED`` placeholders (sliding window)."""
        return self._tables.get(seq_id, [])

    def num_released(self, seq_id: int) -> int:
        """Leading logical blocks of the sequence released before its sliding window."""
        return self._released.get(seq_id, 0)

    def held_blocks(self, seq_id: int) -> list[int]:
        """The physical blocks the sequence holds (its table less the released entries)."""
        return self._tables.get(seq_id, [])[self._released.get(seq_id, 0) :]

    def num_tokens(self, seq_id: int) -> int:
        """Tokens of the sequence held in its blocks."""
        return self._num_tokens.get(seq_id, 0)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def free_block_ids(self) -> list[int]:
        """Blocks in the free queue (reference count 0), least recently freed first."""
        return list(self._free)

    def is_cached(self, block_id: int) -> bool:
        """True when the block is findable in the prefix cache."""
        return self._prefix_cache.is_cached(block_id)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free, or cached with no owner)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_used_slots(self) -> int:
        """Token slots holding real tokens, over all blocks in use (a shared slot counts once)."""
        return self._used_slots

    @property
    def num_allocated_slots(self) -> int:
        """Token slots in blocks that are in use."""
        return self.num_used_blocks * self.block_size

    @property
    def num_logical_blocks(self) -> int:
        """Blocks the block tables would take if nothing were shared (released entries excluded)."""
        return self._logical_blocks

    def utilization(self) -> float:
        """Slots holding real tokens / slots allocated (the paper's KV utilisation; 1.0 when idle)."""
        allocated = self.num_allocated_slots
        return self._used_slots / allocated if allocated else 1.0

    def sharing_savings(self) -> float:
        """1 - physical blocks used / blocks unshared tables would need (0.0 when idle)."""
        return 1.0 - self.num_used_blocks / self._logical_blocks if self._logical_blocks else 0.0

    def match_prefix(self, token_ids: Sequence[int], salt: Optional[bytes] = None) -> list[int]:
        """Cached full blocks holding a prefix of ``token_ids[:-1]`` under ``salt`` (a LoRA adapter's key), in order (changes nothing)."""
        return self._prefix_cache.match(token_ids, salt) if self.enable_prefix_caching else []

    def blocks_needed(self, seq_id: int, num_tokens: int, prefix_blocks: Sequence[int] = ()) -> int:
        """Free blocks that ``allocate(seq_id, num_tokens, ..., prefix_blocks)`` would take, net of
        those it returns to the pool first (blocks wholly before the sliding window that only this
        sequence holds): negative when it returns more than it takes."""
        bs = self.block_size
        if prefix_blocks:  # a new table: cached blocks, those before the window not even taken
            skip = self._window_start_block(len(prefix_blocks) * bs)
            revived = sum(1 for b in prefix_blocks[skip:] if self._ref_counts[b] == 0)  # from the free queue
            return max(0, cdiv(num_tokens, bs) - len(prefix_blocks)) + revived
        table = self._tables.get(seq_id, [])
        needed = max(0, cdiv(num_tokens, bs) - len(table))
        if table and self._needs_copy(seq_id, num_tokens):
            needed += 1
        if self.sliding_window and table:
            released = self._released.get(seq_id, 0)
            drop = self._window_start_block(self._num_tokens.get(seq_id, 0))
            needed -= sum(1 for b in table[released:drop] if self._ref_counts[b] == 1)
        return needed

    def can_allocate(self, seq_id: int, num_tokens: int, prefix_blocks: Sequence[int] = ()) -> bool:
        return self.blocks_needed(seq_id, num_tokens, prefix_blocks) <= len(self._free)

    def blocks_needed_copy(self, num_tokens: int, num_released: int, num_new_tokens: int = 0) -> int:
        """Free blocks that ``allocate_copy(.., num_tokens, num_released)`` and then growing the
        copy by ``num_new_tokens`` tokens would take."""
        kept = max(num_released, self._window_start_block(num_tokens))
        return cdiv(num_tokens + num_new_tokens, self.block_size) - kept

    def can_allocate_copy(self, num_tokens: int, num_released: int, num_new_tokens: int = 0) -> bool:
        return self.blocks_needed_copy(num_tokens, num_released, num_new_tokens) <= len(self._free)

    # ----- changes -------------------------------------------------------------------------------
    def allocate(
        self,
        seq_id: int,
        num_tokens: int,
        token_ids: Optional[Sequence[int]] = None,
        prefix_blocks: Sequence[int] = (),
        salt: Optional[bytes] = None,
    ) -> None:
        """Grow the sequence's blocks so that they hold ``num_tokens`` tokens in all.

        Args:
            num_tokens: the sequence's token count after this step (never less than now).
            token_ids: the sequence's tokens (at least ``num_tokens``); needed with prefix caching
                to name the blocks that become full.
            prefix_blocks: cached blocks from ``match_prefix`` that start an empty block table.
            salt: the sequence's prefix-cache key (``Sequence.cache_salt``: its LoRA adapter's; None: the base model).

        Takes new blocks only for slots past the last block's end, plus one copy-on-write block when
        the last block is shared and partly filled. Blocks that become full enter the prefix cache.
        With a sliding window, first releases the blocks wholly before the window of the first new
        token (prefix blocks there are entered as ``RELEASED`` without being taken).
        Raises NoFreeBlocksError (changing nothing) when the pool is too small.
        """
        old = self._num_tokens.get(seq_id, 0)
        if num_tokens < old:
            raise ValueError(f"sequence {seq_id} cannot shrink from {old} to {num_tokens} tokens")
        if not prefix_blocks and self.append_in_place(seq_id, num_tokens, token_ids, salt):
            return
        if prefix_blocks and self._tables.get(seq_id):
            raise ValueError(f"sequence {seq_id} already holds blocks: prefix blocks start a table")
        needed = self.blocks_needed(seq_id, num_tokens, prefix_blocks)
        if needed > len(self._free):
            raise NoFreeBlocksError(f"sequence {seq_id} needs {needed} blocks, {len(self._free)} free")
        bs = self.block_size
        table = self._tables.setdefault(seq_id, [])
        hashes = self._hashes.setdefault(seq_id, [])
        if prefix_blocks:
            skip = self._window_start_block(len(prefix_blocks) * bs)
            for i, block in enumerate(prefix_blocks):
                hashes.append(self._prefix_cache.name_of(block))
                if i < skip:
                    table.append(RELEASED)
                else:
                    self._share(block)
                    table.append(block)
                    self._logical_blocks += 1
            if skip:
                self._released[seq_id] = skip
        elif self.sliding_window:
            self._release(seq_id, self._window_start_block(old))
        before = len(table)
        if self._needs_copy(seq_id, num_tokens):
            src, dst = table[-1], self._new_block()
            self._ref_counts[src] -= 1  # still > 0: another table holds it
            self._filled[dst] = self._filled[src]
            self._used_slots += self._filled[dst]
            table[-1] = dst
            self._pending_copies.append((src, dst))
            self.num_copies += 1
        num_blocks = cdiv(num_tokens, bs)
        while len(table) < num_blocks:
            table.append(self._new_block())
        self._logical_blocks += len(table) - before
        for i in range(max(old // bs, self._released.get(seq_id, 0)), num_blocks):  # slots that now hold tokens
            block, fill = table[i], min(bs, num_tokens - i * bs)
            if fill > self._filled[block]:
                self._used_slots += fill - self._filled[block]
                self._filled[block] = fill
        self._num_tokens[seq_id] = num_tokens
        if self.enable_prefix_caching and token_ids is not None:
            self._name_full_blocks(seq_id, num_tokens, token_ids, salt)

    def append_in_place(self, seq_id: int, num_tokens: int, token_ids: Optional[Sequence[int]] = None, salt: Optional[bytes] = None) -> bool:
        """The common decode case of ``allocate``: when the sequence's new tokens (up to
        ``num_tokens`` in all) fit its last block and that block is not shared, record them and
        return True; otherwise change nothing and return False."""
        table = self._tables.get(seq_id)
        if not table:
            return False
        old = self._num_tokens[seq_id]
        bs = self.block_size
        last = table[-1]
        fill = num_tokens - (len(table) - 1) * bs  # slots of the last block that will hold tokens
        if not old % bs or not old <= num_tokens or fill > bs or self._ref_counts[last] != 1:
            return False
        if self.sliding_window and self._window_start_block(old) > self._released.get(seq_id, 0):
            return False  # blocks to release: the table changes
        self._used_slots += num_tokens - old
        self._filled[last] = fill
        self._num_tokens[seq_id] = num_tokens
        if fill == bs and self.enable_prefix_caching and token_ids is not None:
            self._name_full_blocks(seq_id, num_tokens, token_ids, salt)
        return True

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Give back the slots past ``num_tokens`` (speculative decoding: the rejected draft tokens'
        lookahead slots). Blocks the rollback empties return to the pool. Lookahead slots are
        allocated without token ids, so no block past the committed tokens was ever named in the
        prefix cache; the last kept block is the sequence's own (copy-on-write ran when the
        lookahead was allocated)."""
        old = self._num_tokens.get(seq_id, 0)
        if num_tokens >= old:
            return
        bs, table = self.block_size, self._tables[seq_id]
        keep = max(cdiv(num_tokens, bs), self._released.get(seq_id, 0))
        while len(table) > keep:
            self._drop_ref(table.pop())
            self._logical_blocks -= 1
        if table and num_tokens % bs:
            last, fill = table[-1], num_tokens - (len(table) - 1) * bs
            if self._filled[last] > fill:
                self._used_slots -= self._filled[last] - fill
                self._filled[last] = fill
        self._num_tokens[seq_id] = num_tokens
        del self._hashes.setdefault(seq_id, [])[num_tokens // bs :]

    def fork(self, parent_id: int, child_id: int) -> None:
        """Give ``child_id`` the same blocks as ``parent_id`` (reference counts + 1; no copy yet)."""
        if self._tables.get(child_id):
            raise ValueError(f"sequence {child_id} already holds blocks")
        table = list(self.block_table(parent_id))
        released = self._released.get(parent_id, 0)
        for block in table[released:]:
            self._ref_counts[block] += 1
        self._tables[child_id] = table
        if released:
            self._released[child_id] = released
        self._hashes[child_id] = list(self._hashes.get(parent_id, []))
        self._num_tokens[child_id] = self.num_tokens(parent_id)
        self._logical_blocks += len(table) - released

    def free(self, seq_id: int) -> None:
        """Drop the sequence's claim on its blocks (a no-op for an unknown sequence).

        Blocks whose count reaches 0 go to the back of the free queue, the sequence's last block
        first, so that with prefix caching the shared beginnings of prompts are evicted last.
        A cached block keeps its tokens (findable by ``match_prefix``) until it is handed out again.
        """
        table = self._tables.pop(seq_id, [])
        released = self._released.pop(seq_id, 0)
        self._logical_blocks -= len(table) - released
        for i in range(len(table) - 1, released - 1, -1):
            self._drop_ref(table[i])
        self._num_tokens.pop(seq_id, None)
        self._hashes.pop(seq_id, None)

    def allocate_copy(self, seq_id: int, num_tokens: int, num_released: int) -> None:
        """A new block table for ``num_tokens`` tokens computed elsewhere (swap out to, or swap in
        from, another pool) whose first ``num_released`` logical blocks were released: blocks only
        for the rest, and also none for blocks before this pool's own sliding window. The caller
        copies the tokens of ``held_blocks`` in. Raises NoFreeBlocksError (changing nothing) when
        the pool is too small (callers check ``can_allocate_copy``)."""
        if self._tables.get(seq_id):
            raise ValueError(f"sequence {seq_id} already holds blocks")
        needed = self.blocks_needed_copy(num_tokens, num_released)
        if needed > len(self._free):
            raise NoFreeBlocksError(f"sequence {seq_id} needs {needed} blocks, {len(self._free)} free")
        kept = max(num_released, self._window_start_block(num_tokens))
        bs = self.block_size
        table = self._tables[seq_id] = [RELEASED] * kept
        if kept:
            self._released[seq_id] = kept
        self._hashes.setdefault(seq_id, [])
        for i in range(kept, cdiv(num_tokens, bs)):
            block = self._new_block()
            table.append(block)
            self._filled[block] = min(bs, num_tokens - i * bs)
            self._used_slots += self._filled[block]
            self._logical_blocks += 1
        self._num_tokens[seq_id] = num_tokens

    def take_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) copy-on-write copies recorded since the last call, to run before the step."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count a prefix-cache lookup of ``num_tokens`` tokens of which ``num_hit_tokens`` hit."""
        self.num_prefix_queries += num_tokens
        self.num_prefix_hits += num_hit_tokens

    # ----- internals -----------------------------------------------------------------------------
    def _window_start_block(self, position: int) -> int:
        """Logical blocks wholly before the sliding window of a token at ``position`` (and of every
        later one): it attends over positions > position - W, so block i is out once
        (i + 1) * block_size <= position - W + 1. 0 without a window."""
        w = self.sliding_window
        return max(0, position - w + 1) // self.block_size if w else 0

    def _release(self, seq_id: int, num_blocks: int) -> None:
        """Release the sequence's logical blocks before ``num_blocks`` that it still holds (the
        newest first, as ``free``, so that the oldest stay findable in the prefix cache longest)."""
        table, released = self._tables[seq_id], self._released.get(seq_id, 0)
        if num_blocks <= released:
            return
        for i in range(num_blocks - 1, released - 1, -1):
            self._drop_ref(table[i])
            table[i] = RELEASED
        self._released[seq_id] = num_blocks
        self._logical_blocks -= num_blocks - released

    def _drop_ref(self, block: int) -> None:
        """One owner less; at 0 the block joins the back of the free queue (a cached block keeps
        its tokens and stays findable until it is handed out again)."""
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            self._used_slots -= self._filled[block]
            if not self.is_cached(block):
                self._filled[block] = 0
            self._free[block] = None

    def _needs_copy(self, seq_id: int, num_tokens: int) -> bool:
        """True when the next write lands in a shared, partly filled last block."""
        table = self._tables.get(seq_id)
        if not table:
            return False
        old = self._num_tokens.get(seq_id, 0)
        return num_tokens > old and old % self.block_size != 0 and self._ref_counts[table[-1]] > 1

    def _share(self, block: int) -> None:
        """One more owner for an existing (cached) block, reviving it from the free queue if idle."""
        if self._ref_counts[block] == 0:
            del self._free[block]
            self._used_slots += self._filled[block]
        self._ref_counts[block] += 1

    def _new_block(self) -> int:
        """An empty block for one owner: the least recently freed, forgotten by the prefix cache."""
        block, _ = self._free.popitem(last=False)
        self._prefix_cache.forget(block)
        self._filled[block] = 0
        self._ref_counts[block] = 1
        return block

    def _name_full_blocks(self, seq_id: int, num_tokens: int, token_ids: Sequence[int], salt: Optional[bytes] = None) -> None:
        """Name the sequence's blocks that are now full (under ``salt``) and offer them to the prefix cache."""
        self._prefix_cache.name_full_blocks(self._tables[seq_id], self._hashes[seq_id], self._released.get(seq_id, 0), num_tokens, token_ids, salt)

    # ----- after an aborted step (block_pool_check.py) ----------------------------------------------
    def check(self) -> list[str]:
        """Problems with the pool's bookkeeping, empty when it is whole (``block_pool_check.check``)."""
        return block_pool_check.check(self)

    def repair(self) -> list[str]:
        """Make the pool whole after an aborted step (``block_pool_check.repair``); returns the
        problems found."""
        return block_pool_check.repair(self)
