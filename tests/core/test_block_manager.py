"""Block manager: property tests (hypothesis) of ownership, leaks and the utilisation figure, with
and without a sliding window (blocks before it released, the bound of the module docstring)."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedgen.core.block_manager import RELEASED, BlockManager, NoFreeBlocksError, cdiv


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
        """The sequence's blocks hold its tokens: all of them, or with a sliding window W those the
        next token attends to (positions > num_tokens - W), in blocks it still holds."""
        bm, bs, w = self.bm, self.bm.block_size, self.bm.sliding_window
        table, n = bm.block_table(seq), bm.num_tokens(seq)
        for p in range(max(0, n - w + 1) if w else 0, n):
            assert p // bs >= bm.num_released(seq), "a block the window still reads was released"
            assert self.slots.get((table[p // bs], p % bs)) == self.tokens[seq][p], "a block holds other tokens"


def _check_shared_invariants(bm: BlockManager, live: set[int]) -> None:
    assert bm.check() == []
    counts: dict[int, int] = {}
    for seq in live:
        assert bm.block_table(seq)[: bm.num_released(seq)] == [RELEASED] * bm.num_released(seq)
        for b in bm.held_blocks(seq):
            counts[b] = counts.get(b, 0) + 1
    free = bm.free_block_ids()
    assert len(free) == len(set(free))
    for b in range(bm.num_blocks):
        assert bm.ref_count(b) == counts.get(b, 0), "reference count differs from the tables holding the block"
        assert (b in set(free)) == (counts.get(b, 0) == 0), "a block in use is free, or a free block is lost"
    filled: dict[int, int] = {}
    for seq in live:
        n = bm.num_tokens(seq)
        for i, b in enumerate(bm.held_blocks(seq), bm.num_released(seq)):
            filled[b] = max(filled.get(b, 0), min(bm.block_size, n - i * bm.block_size))
    assert bm.num_used_slots == sum(filled.values())
    assert bm.num_logical_blocks == sum(len(bm.held_blocks(s)) for s in live)


def _window_bound(bm: BlockManager, start: int, end: int) -> int:
    """Blocks a sequence computing tokens [start, end) may hold with a sliding window (the module
    docstring's bound): ceil((W + n - 2) / B) + 1 for n = end - start, all of them from 0."""
    w, bs, n = bm.sliding_window, bm.block_size, end - start
    return cdiv(end, bs) if start == 0 or not w else cdiv(w + n - 2, bs) + 1


shared_ops = st.lists(
    st.tuples(st.sampled_from(["new", "grow", "grow", "fork", "fork", "free"]), st.integers(0, 3), st.integers(0, 3), st.integers(1, 9)),
    min_size=4,
    max_size=60,
)


@settings(max_examples=250, deadline=None)
@given(ops=shared_ops, num_blocks=st.integers(2, 30), block_size=st.sampled_from([2, 4]), caching=st.booleans(),
       vocab=st.integers(1, 3), window=st.sampled_from([0, 0, 1, 3, 5, 8]))
def test_random_fork_append_free_with_sharing(ops, num_blocks, block_size, caching, vocab, window):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching, sliding_window=window)
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
                free_before, needed = bm.num_free_blocks, bm.blocks_needed(a, n, hits)
                bm.allocate(a, len(hits) * block_size, model.tokens[a], hits)  # as the scheduler does
                bm.allocate(a, n, model.tokens[a])
                assert bm.num_free_blocks == free_before - needed
                assert len(bm.held_blocks(a)) <= _window_bound(bm, len(hits) * block_size, n)
                live.add(a)
                for i, blk in enumerate(hits):  # a hit holds exactly these tokens
                    for off in range(block_size):
                        assert model.slots.get((blk, off)) == model.tokens[a][i * block_size + off]
                model.write(a, len(hits) * block_size, n)
            else:
                assert bm.blocks_needed(a, n, hits) > bm.num_free_blocks
        elif op == "grow" and a in live:
            old = bm.num_tokens(a)
            model.tokens[a] = model.tokens[a][:old] + [(old + k) % vocab for k in range(n)]
            if bm.can_allocate(a, old + n):
                last = bm.block_table(a)[-1] if bm.block_table(a) else None
                shared_partial = last is not None and bm.ref_count(last) > 1 and old % block_size != 0
                copies_before, free_before, needed = bm.num_copies, bm.num_free_blocks, bm.blocks_needed(a, old + n)
                bm.allocate(a, old + n, model.tokens[a])
                assert bm.num_copies - copies_before == (1 if shared_partial else 0), "copy only on a write to a shared block"
                assert bm.num_free_blocks == free_before - needed  # blocks_needed counts the releases
                assert len(bm.held_blocks(a)) <= _window_bound(bm, old, old + n)
                model.write(a, old, old + n)
            else:
                with pytest.raises(NoFreeBlocksError):
                    bm.allocate(a, old + n, model.tokens[a])
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


def test_sliding_window_bounds_the_blocks_of_a_long_decode():
    """Window 8, blocks of 4: decoding 92 tokens after a 10-token prompt, the sequence holds at
    most ceil((8 - 1) / 4) + 1 = 3 blocks; released entries are placeholders (logical indices kept);
    forks share and release their blocks by reference count; swap copies move only held blocks."""
    W, bs = 8, 4
    bm = BlockManager(num_blocks=12, block_size=bs, sliding_window=W)
    tokens = list(range(10))
    bm.allocate(0, 10, tokens)  # the prompt's step: all 3 blocks are written
    assert len(bm.held_blocks(0)) == 3
    for n in range(11, 103):
        tokens.append(n)
        assert bm.can_allocate(0, n)
        bm.allocate(0, n, tokens)
        assert len(bm.held_blocks(0)) <= cdiv(W - 1, bs) + 1 == 3
        assert bm.check() == []
    # the last allocate computed position 101, which attends to 94..101: blocks 0..22 released
    table = bm.block_table(0)
    assert len(table) == 26 and bm.num_released(0) == 23 and table[:23] == [RELEASED] * 23
    assert bm.num_used_blocks == 3 and bm.num_logical_blocks == 3

    bm.fork(0, 1)
    assert bm.num_released(1) == 23 and bm.num_used_blocks == 3 and bm.num_logical_blocks == 6
    for seq in (0, 1):  # both write position 102: the shared partial block is copied for the first
        bm.allocate(seq, 103, tokens + [102])
    assert len(bm.take_copies()) == 1
    for n in range(104, 110):  # positions 103..108: the shared blocks 23 and 24 are released by 1
        bm.allocate(1, n, tokens + list(range(102, n)))
    assert bm.num_released(1) == 25 and bm.check() == []
    assert bm.ref_count(bm.block_table(0)[23]) == bm.ref_count(bm.block_table(0)[24]) == 1  # 0 holds them

    cpu = BlockManager(num_blocks=3, block_size=bs)  # swap space of 3 blocks: enough for the held ones
    assert cpu.can_allocate_copy(bm.num_tokens(1), bm.num_released(1))
    cpu.allocate_copy(1, bm.num_tokens(1), bm.num_released(1))
    assert len(cpu.block_table(1)) == len(bm.block_table(1)) == 28 and len(cpu.held_blocks(1)) == len(bm.held_blocks(1)) == 3
    bm.free(1)
    bm.allocate_copy(7, cpu.num_tokens(1), cpu.num_released(1))  # swap in under another id
    assert bm.num_released(7) == 25 and len(bm.held_blocks(7)) == 3
    cpu.free(1)
    for seq in (0, 7):
        bm.free(seq)
    assert bm.check() == [] and cpu.check() == [] and bm.num_free_blocks == 12 and cpu.num_free_blocks == 3


def test_sliding_window_with_prefix_caching():
    """Prefix blocks wholly before the window of the first token to compute are entered as
    placeholders and not taken; released cached blocks stay findable; the pool is whole after."""
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True, sliding_window=8)
    prompt = list(range(1, 21))  # 5 full blocks
    bm.allocate(0, 20, prompt)
    bm.allocate(0, 21, prompt + [0])  # position 20 attends to 13..20: blocks 0-2 released
    assert bm.num_released(0) == 3 and bm.num_free_blocks == 8 - 3
    hits = bm.match_prefix(prompt + [5])
    assert len(hits) == 5  # the released blocks are still cached
    # a new sequence computes from position 20: blocks 0-2 are before its window
    assert bm.blocks_needed(1, 21, hits) == 1 + 0  # one new block; the two hits it keeps are held
    bm.allocate(1, 20, prompt + [5], hits)
    assert bm.block_table(1)[:3] == [RELEASED] * 3 and bm.block_table(1)[3:] == hits[3:]
    assert all(bm.ref_count(b) == 0 for b in hits[:3]) and all(bm.ref_count(b) == 2 for b in hits[3:])
    bm.allocate(1, 21, prompt + [5])
    assert bm.check() == []
    bm.free(0)
    bm.free(1)
    assert bm.repair() == [] and bm.num_free_blocks == 8


def test_bad_sliding_window():
    with pytest.raises(ValueError, match="sliding_window"):
        BlockManager(4, 16, sliding_window=-1)
