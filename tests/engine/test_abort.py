"""An interrupted step leaves no trace: prefix-cache entries of blocks the aborted step was writing
are gone (the cache is emptied), the pool holds every block again, and the next call equals a
fresh LLM's."""
import pytest
from conftest import story_openings

from pagedgen import LLM, SamplingParams, ops
from pagedgen.core.block_manager import BlockManager

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)


def _prompts():
    return [p + " " + p for p in story_openings(6, seed=1)]  # 2-5 full blocks each


def _key(outputs):
    return [[(c.token_ids, [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs]) for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def fresh(stories_path):
    return _key(LLM(stories_path).generate(_prompts(), PARAMS, use_tqdm=False))


@pytest.mark.parametrize("fail_at_call", [1, 5 * 3 + 1])  # step 1's first layer; step 4's first layer
def test_interrupt_inside_the_forward_pass_leaves_no_cached_garbage(stories_path, fresh, monkeypatch, fail_at_call):
    llm = LLM(stories_path)
    real, calls = ops.reshape_and_cache, {"n": 0}

    def interrupted(*args):
        real(*args)  # the keys and values of this layer are written: the blocks hold a partial step
        calls["n"] += 1
        if calls["n"] == fail_at_call:
            raise KeyboardInterrupt

    monkeypatch.setattr(ops, "reshape_and_cache", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(_prompts(), PARAMS, use_tqdm=False)
    monkeypatch.setattr(ops, "reshape_and_cache", real)
    bm = llm.engine.block_manager
    assert bm.check() == [] and bm.num_free_blocks == bm.num_blocks
    assert _key(llm.generate(_prompts(), PARAMS, use_tqdm=False)) == fresh
    assert llm.generate(_prompts(), PARAMS, use_tqdm=False)[0].num_cached_tokens > 0  # the cache works again


def test_repair_empties_the_prefix_cache_and_rebuilds_a_broken_pool():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    bm.allocate(0, 5, [1, 2, 3, 4, 5])
    bm.allocate(1, 5, [7, 8, 9, 10, 11])  # named when allocated, but the step writing them is aborted
    assert len(bm.match_prefix([7, 8, 9, 10, 11])) == 2  # findable inside the step (same forward pass)
    bm.free(0)
    assert bm.repair() == []  # sequence 1 was not freed by the caller: repair frees it
    assert bm.match_prefix([7, 8, 9, 10, 11]) == bm.match_prefix([1, 2, 3, 4, 5]) == []
    assert bm.num_free_blocks == 8 and bm.num_used_slots == 0 and bm.num_logical_blocks == 0

    # an interrupt inside the bookkeeping: a block out of the free queue that no table holds
    bm.allocate(2, 3, [1, 2, 3])
    lost, _ = bm._free.popitem(last=False)
    bm._ref_counts[lost] = 1
    problems = bm.repair()
    assert problems and any(f"block {lost}" in p for p in problems)
    assert bm.check() == [] and bm.num_free_blocks == 8 and bm.free_block_ids()[-1] == lost
