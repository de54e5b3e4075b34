"""Prefix caching and preemption (recompute, swap) never change greedy output."""
import pytest

from conftest import story_openings
from pagedgen import LLM, SamplingParams


@pytest.fixture(scope="module")
def prompts(hf_tokenizer):
    """Token-id prompts that hit, partly hit and miss the prefix cache (block_size 16)."""
    text = " ".join(story_openings(40, seed=3))
    ids = hf_tokenizer(text).input_ids
    shared = ids[:32]  # exactly two blocks
    out = [
        shared,  # an exact multiple of the block size: wholly cached on the second call
        shared + ids[100:110],  # shares both blocks
        shared[:20] + ids[200:230],  # shares the first block only
        ids[300:345],  # its own prefix
        shared + ids[400:402],
        ids[500:503],  # shorter than one block
    ]
    return out * 2  # repeats hit blocks filled earlier in the same call


def _greedy(llm, prompts, max_tokens=40):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(stories_path, prompts):
    return _greedy(LLM(stories_path, enable_prefix_caching=False, num_kv_blocks=512), prompts)


def test_prefix_caching_gives_identical_output(stories_path, prompts, reference):
    llm = LLM(stories_path, enable_prefix_caching=True, num_kv_blocks=512)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    first = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == reference
    # in one call: prompt 1 and 4 share prompt 0's two blocks, prompt 2 its first, prompt 3/5 nothing
    assert [o.num_cached_tokens for o in first[:6]] == [0, 32, 16, 0, 32, 0]
    # the repeats find their own blocks: all full blocks but the one holding the last token
    assert [o.num_cached_tokens for o in first[6:]] == [((len(p) - 1) // 16) * 16 for p in prompts[6:]]
    hit_rate = llm.get_stats().prefix_cache_hit_rate
    # a second call finds every prompt cached, the whole-block prompt (32 tokens) recomputing its last block
    second = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in second] == reference
    assert second[0].num_cached_tokens == 16
    assert [o.num_cached_tokens for o in second] == [((len(p) - 1) // 16) * 16 for p in prompts]
    assert llm.get_stats().prefix_cache_hit_rate > hit_rate


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("caching", [False, True])
def test_preemption_gives_identical_output(stories_path, prompts, reference, mode, caching):
    llm = LLM(stories_path, enable_prefix_caching=caching, num_kv_blocks=34, preemption_mode=mode)
    assert _greedy(llm, prompts) == reference
    stats = llm.get_stats()
    assert stats.num_preemptions > 0
    if mode == "swap":
        assert stats.num_swaps_out > 0 and stats.num_swaps_in == stats.num_swaps_out and stats.num_recomputes == 0
    else:
        assert stats.num_recomputes == stats.num_preemptions
    assert stats.num_used_blocks == 0


def test_swap_space_too_small_falls_back_to_recompute(stories_path, prompts, reference):
    one_block = 2 * 5 * 4 * 8 * 4 * 16  # layers, kv heads, head_dim, fp32 bytes, block_size
    llm = LLM(stories_path, num_kv_blocks=34, preemption_mode="swap", swap_space_bytes=one_block)
    assert _greedy(llm, prompts) == reference
    assert llm.get_stats().num_recomputes > 0
