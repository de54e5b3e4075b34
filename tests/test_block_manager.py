"""Block manager: property tests (hypothesis) of ownership, leaks and the utilisation figure."""
from hypothesis import given, settings, strategies as st

import pytest

from pagedgen.engine.block_manager import BlockManager, NoFreeBlocksError, cdiv


def _check_invariants(bm: BlockManager) -> None:
    owned = [b for seq in list(bm._tables) for b in bm.block_table(seq)]
    free = bm.free_block_ids()
    assert len(owned) == len(set(owned)), "a block has two owners"
    assert len(free) == len(set(free)), "a block is twice in the free pool"
    assert not set(owned) & set(free), "a block is both owned and free"
    assert sorted(owned + free) == list(range(bm.num_blocks)), "a block was lost"
    for b in owned:
        assert bm.ref_count(b) == 1
    for b in free:
        assert bm.ref_count(b) == 0


ops = st.lists(
    st.tuples(st.sampled_from(["grow", "free"]), st.integers(0, 7), st.integers(0, 40)),
    min_size=1,
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(ops=ops, num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 4, 16]))
def test_random_allocate_append_free(ops, num_blocks, block_size):
    bm = BlockManager(num_blocks, block_size)
    tokens: dict[int, int] = {}  # hand count of each sequence's tokens
    for op, seq, n in ops:
        if op == "grow":
            target = tokens.get(seq, 0) + n
            needed = cdiv(target, block_size) - cdiv(tokens.get(seq, 0), block_size)
            assert bm.blocks_needed(seq, target) == needed
            if bm.can_allocate(seq, target):
                free_before = bm.num_free_blocks
                bm.allocate(seq, target)
                tokens[seq] = target
                assert bm.num_free_blocks == free_before - needed  # a new block only when the last fills
            else:
                assert needed > bm.num_free_blocks
                with pytest.raises(NoFreeBlocksError):
                    bm.allocate(seq, target)
        else:
            bm.free(seq)
            tokens.pop(seq, None)
        _check_invariants(bm)
        used_slots = sum(tokens.values())
        allocated = sum(cdiv(t, block_size) for t in tokens.values()) * block_size
        assert bm.num_used_slots == used_slots
        assert bm.num_allocated_slots == allocated
        assert bm.utilization() == (used_slots / allocated if allocated else 1.0)
    for seq in list(tokens):
        bm.free(seq)
    assert bm.num_free_blocks == num_blocks and bm.num_used_blocks == 0


def test_block_table_maps_tokens_to_slots():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate(0, 3)
    bm.allocate(1, 5)
    bm.allocate(0, 9)
    assert len(bm.block_table(0)) == 3 and len(bm.block_table(1)) == 2
    assert bm.utilization() == pytest.approx((9 + 5) / (5 * 4))
    with pytest.raises(ValueError):
        bm.allocate(0, 2)  # no shrinking


def test_bad_sizes():
    with pytest.raises(ValueError):
        BlockManager(0, 16)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


# ----- sharing: fork, copy-on-write, prefix caching ---------------------------------------------
class Model:
    """A hand-kept model of the cache: the token stored in every slot, to check what blocks hold."""

    def __init__(self, bm: BlockManager):
        self.bm = bm
        self.slots: dict[tuple[int, int], int] = {}  # (block, offset) -> token id
        self.tokens: dict[int, list[int]] = {}  # seq -> its token ids (all, computed or not)

    def write(self, seq: int, start: int, end: int) -> None:
        """Apply pending copies, then store tokens [start, end) of seq in its slots."""
        bs = self.bm.block_size
        for src, dst in self.bm.take_copies():
            for off in range(bs):
                if (src, off) in self.slots:
                    self.slots[(dst, off)] = self.slots[(src, off)]
        table = self.bm.block_table(seq)
        for p in range(start, end):
            block = table[p // bs]
            assert self.bm.ref_count(block) == 1, "a write landed in a shared block"
            self.slots[(block, p % bs)] = self.tokens[seq][p]

    def check_holds(self, seq: int) -> None:
        bs = self.bm.block_size
        table = self.bm.block_table(seq)
        for p in range(self.bm.num_tokens(seq)):
            assert self.slots.get((table[p // bs], p % bs)) == self.tokens[seq][p], "a block holds other tokens"


def _check_shared_invariants(bm: BlockManager, live: set[int]) -> None:
    counts: dict[int, int] = {}
    for seq in live:
        for b in bm.block_table(seq):
            counts[b] = counts.get(b, 0) + 1
    free = bm.free_block_ids()
    assert len(free) == len(set(free))
    for b in range(bm.num_blocks):
        assert bm.ref_count(b) == counts.get(b, 0), "reference count differs from the tables holding the block"
        assert (b in set(free)) == (counts.get(b, 0) == 0), "a block in use is free, or a free block is lost"
    filled: dict[int, int] = {}
    for seq in live:
        n = bm.num_tokens(seq)
        for i, b in enumerate(bm.block_table(seq)):
            filled[b] = max(filled.get(b, 0), min(bm.block_size, n - i * bm.block_size))
    assert bm.num_used_slots == sum(filled.values())
    assert bm.num_logical_blocks == sum(len(bm.block_table(s)) for s in live)


shared_ops = st.lists(
    st.tuples(st.sampled_from(["new", "grow", "grow", "fork", "fork", "free"]), st.integers(0, 3), st.integers(0, 3), st.integers(1, 9)),
    min_size=4,
    max_size=60,
)


@settings(max_examples=250, deadline=None)
@given(ops=shared_ops, num_blocks=st.integers(2, 30), block_size=st.sampled_from([2, 4]), caching=st.booleans(),
       vocab=st.integers(1, 3))
def test_random_fork_append_free_with_sharing(ops, num_blocks, block_size, caching, vocab):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
    model = Model(bm)
    live: set[int] = set()
    rng = iter(range(10**9))
    for op, a, b, n in ops:
        if op == "new" and a not in live:
            # a prompt drawn from a tiny vocabulary, so that prefixes repeat and hit the cache
            model.tokens[a] = [(next(rng) * 7 + a) % vocab for _ in range(n)]
            hits = bm.match_prefix(model.tokens[a])
            assert len(hits) * block_size <= n - 1  # the last token is always computed
            if bm.can_allocate(a, n, hits):
                bm.allocate(a, n, model.tokens[a], hits)
                live.add(a)
                for i, blk in enumerate(hits):  # a hit holds exactly these tokens
                    for off in range(block_size):
                        assert model.slots.get((blk, off)) == model.tokens[a][i * block_size + off]
                model.write(a, len(hits) * block_size, n)
        elif op == "grow" and a in live:
            old = bm.num_tokens(a)
            model.tokens[a] = model.tokens[a][:old] + [(old + k) % vocab for k in range(n)]
            if bm.can_allocate(a, old + n):
                last = bm.block_table(a)[-1] if bm.block_table(a) else None
                shared_partial = last is not None and bm.ref_count(last) > 1 and old % block_size != 0
                copies_before = bm.num_copies
                bm.allocate(a, old + n, model.tokens[a])
                assert bm.num_copies - copies_before == (1 if shared_partial else 0), "copy only on a write to a shared block"
                model.write(a, old, old + n)
        elif op == "fork" and a in live and b not in live:
            bm.fork(a, b)
            model.tokens[b] = list(model.tokens[a])
            live.add(b)
        elif op == "free" and a in live:
            bm.free(a)
            live.discard(a)
        _check_shared_invariants(bm, live)
        for seq in live:
            model.check_holds(seq)
    for seq in list(live):
        bm.free(seq)
    assert bm.num_free_blocks == num_blocks and bm.num_used_slots == 0 and bm.num_logical_blocks == 0


def test_fork_then_write_copies_only_the_partial_last_block():
    bm = BlockManager(num_blocks=10, block_size=4)
    bm.allocate(0, 6)  # blocks: full + 2 of 4
    bm.fork(0, 1)
    bm.fork(0, 2)
    assert bm.num_used_blocks == 2 and bm.sharing_savings() == pytest.approx(1 - 2 / 6)
    bm.allocate(1, 7)
    bm.allocate(2, 7)
    bm.allocate(0, 7)  # the last owner writes in place
    copies = bm.take_copies()
    assert len(copies) == 2 and all(src == bm.block_table(0)[1] for src, _ in copies)
    assert bm.block_table(0)[0] == bm.block_table(1)[0] == bm.block_table(2)[0]  # the full block stays shared
    assert bm.num_used_blocks == 4


def test_prefix_cache_hits_and_lru_eviction():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    prompt = [5, 6, 7, 8, 9]
    bm.allocate(0, 5, prompt)
    bm.free(0)
    assert bm.num_free_blocks == 4
    hits = bm.match_prefix(prompt)
    assert len(hits) == 2  # [5 6] [7 8]; the last token is computed
    assert bm.match_prefix([5, 6, 7, 8]) == hits[:1]  # whole-block prompt: its last block is recomputed
    assert bm.match_prefix([5, 6, 1, 2, 3]) == hits[:1]
    assert bm.match_prefix([6, 6, 7, 8, 9]) == []
    bm.allocate(1, 5, prompt, hits)
    assert bm.block_table(1)[:2] == hits and bm.num_used_blocks == 3
    bm.free(1)
    bm.allocate(2, 8, [1] * 8)  # needs all 4 blocks: evicts every cached one
    assert bm.match_prefix(prompt) == []
