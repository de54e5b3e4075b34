"""The block pool's self-check and its repair after an aborted step (``BlockManager.check`` and
``BlockManager.repair`` call these); the accounting itself is block_manager.py.

**After an aborted step nothing stays findable.** A block is named and entered in the prefix cache
when ``allocate`` fills it, before the model step writes it, so that a sequence admitted in the same
step can share it: the forward pass writes every token's keys and values of a layer before any
attention of that layer reads them. If the step is interrupted instead (any exception, a
KeyboardInterrupt between any two bytecodes), those entries name blocks of garbage. So the engine
then frees every sequence and calls ``repair``, which empties the prefix cache, checks the pool
(``check``) and, if an interrupt landed inside the bookkeeping, rebuilds the free queue and the
counts from scratch. Emptying the whole cache (not only the aborted step's entries) also makes the
engine exactly a fresh one, up to the numbering of its blocks: the next call's outputs equal a
fresh LLM's bit for bit, where cache hits would change the batches (the kernels are not
batch-invariant, so a row's logits can differ in the last bits with the other rows of its step).
"""
from __future__ import annotations

from collections import OrderedDict

from pagedgen.core.blocks import RELEASED, cdiv

# ``bm`` below is a pagedgen.core.block_manager.BlockManager, whose private state these functions
# read and reset; not imported, so that imports run one way (block_manager -> this module).


def check(bm: BlockManager) -> list[str]:
    """Problems with the pool's bookkeeping (empty when it is whole): every block is in the free
    queue exactly once or held by as many block tables as its reference count says, the slot and
    logical-block counters agree with the tables, and every prefix-cache entry names a full block
    that knows its name. Costs one pass over the blocks and the tables."""
    problems = []
    counts = [0] * bm.num_blocks
    filled = [0] * bm.num_blocks
    bs = bm.block_size
    held_entries = 0
    for seq_id, table in bm._tables.items():
        n = bm._num_tokens.get(seq_id, 0)
        if cdiv(n, bs) != len(table):
            problems.append(f"sequence {seq_id} holds {n} tokens in {len(table)} blocks")
        released = bm._released.get(seq_id, 0)
        if not 0 <= released <= len(table) or any(b != RELEASED for b in table[:released]):
            problems.append(f"sequence {seq_id}'s {released} released entries are not placeholders")
        for i in range(released, len(table)):
            b = table[i]
            counts[b] += 1
            filled[b] = max(filled[b], min(bs, n - i * bs))
        held_entries += len(table) - released
    if not set(bm._released) <= set(bm._tables):
        problems.append("released entries recorded for a sequence without a table")
    if len(bm._free) + sum(c > 0 for c in counts) != bm.num_blocks:
        problems.append(f"{len(bm._free)} free + {sum(c > 0 for c in counts)} held blocks != {bm.num_blocks}")
    for b in range(bm.num_blocks):
        if bm._ref_counts[b] != counts[b]:
            problems.append(f"block {b} has reference count {bm._ref_counts[b]} but {counts[b]} tables hold it")
        if (b in bm._free) != (counts[b] == 0):
            problems.append(f"block {b} is {'free' if b in bm._free else 'not free'} with {counts[b]} owners")
    held = [b for b in range(bm.num_blocks) if counts[b]]
    if bm._used_slots != sum(filled[b] for b in held):
        problems.append(f"used slots {bm._used_slots} != {sum(filled[b] for b in held)}")
    if bm._logical_blocks != held_entries:
        problems.append(f"logical blocks {bm._logical_blocks} != {held_entries}")
    for name, b in bm._prefix_cache.items():
        if bm._prefix_cache.name_of(b) != name or bm._filled[b] != bs:
            problems.append(f"prefix-cache entry of block {b} is inconsistent")
    return problems

def repair(bm: BlockManager) -> list[str]:
    """After an aborted step, once the caller has freed every sequence it knows: free whatever
    is still held, empty the prefix cache (see the module docstring), then ``check``; if a
    problem remains (an interrupt landed inside the bookkeeping), rebuild the pool from
    scratch. Returns the problems found (empty when the pool was whole)."""
    for seq_id in list(bm._tables):
        bm.free(seq_id)
    bm._prefix_cache.clear()
    for b in bm._free:
        bm._filled[b] = 0
    bm._pending_copies = []
    problems = check(bm)
    if problems:
        _rebuild(bm)
    return problems

def _rebuild(bm: BlockManager) -> None:
    """Every block free and empty (the free queue's order kept, lost blocks at its end), no
    tables, the counters zero."""
    order = [b for b in bm._free if 0 <= b < bm.num_blocks]
    order += [b for b in range(bm.num_blocks) if b not in bm._free]
    bm._free = OrderedDict.fromkeys(order)
    bm._ref_counts = [0] * bm.num_blocks
    bm._filled = [0] * bm.num_blocks
    bm._tables, bm._num_tokens, bm._hashes, bm._released = {}, {}, {}, {}
    bm._used_slots = bm._logical_blocks = 0
