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
