"""The CPU KV cache's pages are faulted in bulk before a step writes them (pagedgen/worker/prefault.py):
every block a step writes lies below the touched frontier, zeroing never reaches a block in use,
and generation is the same with and without it."""
import pytest
import torch
from conftest import story_openings

from pagedgen import LLM, SamplingParams, ops
from pagedgen.worker.prefault import Prefaulter

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.in_process]


def _caches(num_blocks=16, layers=2):
    """NaN-filled [num_blocks, 2, 1, 4] key/value caches (a block is 2 tokens x 4 floats = 32 bytes per tensor)."""
    return [(torch.full((num_blocks, 2, 1, 4), float("nan")), torch.full((num_blocks, 2, 1, 4), float("nan"))) for _ in range(layers)]


def _touched(caches):
    """Blocks of every cache that are not NaN (written or zeroed), as one set per tensor."""
    return [set(torch.nonzero(~c.isnan().flatten(1).all(1)).flatten().tolist()) for pair in caches for c in pair]


def test_touches_the_named_blocks_and_a_chunk_in_every_layer():
    caches = _caches()
    block_bytes = 2 * 2 * 32  # 2 layers x (key + value) x 32 bytes
    pf = Prefaulter(caches, block_bytes, chunk_bytes=3 * block_bytes)  # at least 3 blocks at a time
    pf.before_step({7: (0, [2, 5])}, ())
    assert pf.touched == 6 and _touched(caches) == [set(range(6))] * 4
    assert all(float(c[:6].abs().sum()) == 0 for pair in caches for c in pair)  # zeroed
    caches[0][0][2] = 1.0  # a step writes block 2
    pf.before_step({7: (1, [4]), 8: (0, [])}, ([(1, 3)],))  # nothing past the frontier: nothing changes
    assert pf.touched == 6 and float(caches[0][0][2].sum()) == 8.0
    pf.before_step({}, ([], [(0, 7)]))  # a swap-in into block 7: the next chunk, 6 .. 8
    assert pf.touched == 9 and _touched(caches) == [set(range(9))] * 4 and float(caches[0][0][2].sum()) == 8.0
    pf.before_step({9: (0, [0, 15])}, ())  # RELEASED placeholders (0) and the pool's last block
    assert pf.touched == 16 and _touched(caches) == [set(range(16))] * 4 and float(caches[0][0][2].sum()) == 8.0


def test_every_written_block_is_touched_first(stories_path, monkeypatch):
    """A real run with copy-on-write (parallel samples), prefix caching and swap preemption: every
    slot reshape_and_cache writes and every copy / swap-in destination is a block the prefaulter
    had touched before the step."""
    llm = LLM(stories_path, num_kv_blocks=48, max_model_len=192, preemption_mode="swap", max_num_batched_tokens=64)
    runner = llm.llm_engine.model_runner
    pf = runner.prefaulter
    pf.chunk_blocks = 4  # small chunks, so that the frontier moves during the run
    caches = {id(k) for pair in runner.kv_caches for k in pair}
    bs = runner.cache_config.block_size
    checked = {"writes": 0, "copies": 0, "swap_ins": 0}
    real_rc, real_copy, real_swap = ops.reshape_and_cache, ops.copy_blocks, ops.swap_blocks

    def rc(key, value, key_cache, value_cache, slot_mapping):
        assert int(slot_mapping.max()) // bs < pf.touched
        checked["writes"] += 1
        return real_rc(key, value, key_cache, value_cache, slot_mapping)

    def copy(key_cache, value_cache, mapping):
        assert int(mapping[:, 1].max()) < pf.touched
        checked["copies"] += 1
        return real_copy(key_cache, value_cache, mapping)

    def swap(src, dst, mapping):
        if id(dst) in caches:
            assert int(mapping[:, 1].max()) < pf.touched
            checked["swap_ins"] += 1
        return real_swap(src, dst, mapping)

    monkeypatch.setattr(ops, "reshape_and_cache", rc)
    monkeypatch.setattr(ops, "copy_blocks", copy)
    monkeypatch.setattr(ops, "swap_blocks", swap)
    prompts = story_openings(8, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=40, ignore_eos=True)] * 4
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.finished for o in outs) and checked["writes"] > 0, checked
    assert checked["copies"] > 0 and checked["swap_ins"] > 0 and llm.get_stats().num_preemptions > 0, checked


def test_the_same_tokens_without_it(stories_path):
    prompts = story_openings(6, seed=11)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with_it = LLM(stories_path, num_kv_blocks=64, max_model_len=192)
    without = LLM(stories_path, num_kv_blocks=64, max_model_len=192)
    without.llm_engine.model_runner.prefaulter = None
    a = [o.outputs[0].token_ids for o in with_it.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in without.generate(prompts, params, use_tqdm=False)]
    assert a == b and with_it.llm_engine.model_runner.prefaulter.touched > 0
