"""``SamplingParams.prompt_logprob_start``: prompt logprobs from a position on, the context before it
from the prefix cache (computed once for requests that share it, in one call), the entries equal
bit for bit to those of the whole prompt's (stories260K, fp32, batch-invariant CPU kernels)."""
import pytest

from pagedgen import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONTEXT = [(7 * j) % 400 + 5 for j in range(70)]  # 4 full blocks of 16 and 6 tokens
CHOICES = [[100 + i, 200 + i, 300 + i] for i in range(4)]


def _params(start=None, k=2):
    return SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k, prompt_logprob_start=start)


def _prompts():
    return [{"prompt_token_ids": CONTEXT + c} for c in CHOICES]


def _entries(out):
    return [None if e is None else {t: (lp.logprob, lp.rank) for t, lp in e.items()} for e in out.prompt_logprobs]


@pytest.fixture(scope="module")
def whole(stories_path):
    """Each prompt's logprobs over the whole prompt (no prefix-cache hit: vLLM's default)."""
    llm = LLM(stories_path, num_kv_blocks=128)
    outs = llm.generate(_prompts(), _params(), use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0, 0] and llm.get_stats().prefix_cache_hit_rate == 0.0
    return [_entries(o) for o in outs], [o.outputs[0].token_ids for o in outs]


def test_a_shared_context_is_computed_once_and_the_entries_equal_the_whole_prompts(stories_path, whole):
    llm = LLM(stories_path, num_kv_blocks=128)
    start = len(CONTEXT)
    outs = llm.generate(_prompts(), _params(start), use_tqdm=False)
    # request 0 computes the context; the others share its 4 full blocks in the same step
    assert [o.num_cached_tokens for o in outs] == [0, 64, 64, 64]
    stats = llm.get_stats()
    assert stats.num_steps == 1 and stats.num_prefill_tokens == 73 + 3 * (73 - 64)
    for out, expected, tokens in zip(outs, *whole):
        got = _entries(out)
        assert len(got) == len(out.prompt_token_ids) == 73
        assert got[:start] == [None] * start
        assert got[start:] == expected[start:]  # bit for bit
        assert out.outputs[0].token_ids == tokens
    # a second call takes the context from the cache for every request
    again = llm.generate(_prompts(), _params(start), use_tqdm=False)
    assert [o.num_cached_tokens for o in again] == [64] * 4 and [_entries(o) for o in again] == [_entries(o) for o in outs]


@pytest.mark.parametrize("start", [0, 1, 2, 16, 17, 33, 72])
def test_the_cache_stops_before_the_first_row_needed(stories_path, whole, start):
    """Cached blocks end at or before position start - 1 (the row that predicts token ``start``),
    whatever the block boundary; 0 and 1 mean the whole prompt (the first token has no logprob)."""
    llm = LLM(stories_path, num_kv_blocks=128, max_num_seqs=1)  # one at a time: request 0 fills the cache first
    outs = llm.generate(_prompts(), _params(start, k=0), use_tqdm=False)
    hit = max(start - 1, 0) // 16 * 16
    assert [o.num_cached_tokens for o in outs] == [0] + [min(hit, 64)] * 3
    for out, expected in zip(outs, whole[0]):
        got = _entries(out)
        first = max(start, 1)
        assert got[:first] == [None] * first
        # k = 0: each entry holds the prompt token alone, as the whole prompt's entry has it
        assert got[first:] == [{tok: e[tok]} for e, tok in zip(expected[first:], out.prompt_token_ids[first:])]


def test_a_start_past_the_prompt_leaves_every_entry_none_and_preemption_keeps_them(stories_path, whole):
    llm = LLM(stories_path, num_kv_blocks=128)
    outs = llm.generate(_prompts(), _params(1000), use_tqdm=False)
    assert all(_entries(o) == [None] * 73 for o in outs)
    assert [o.outputs[0].token_ids for o in outs] == whole[1]
    # a cache too small for all four at once: preempted and recomputed, the entries stay those of the whole prompt
    small = LLM(stories_path, num_kv_blocks=8, max_model_len=96, max_num_batched_tokens=32)
    outs = small.generate(_prompts(), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, prompt_logprobs=2,
                                                     prompt_logprob_start=40), use_tqdm=False)
    assert small.get_stats().num_preemptions > 0
    for out, expected in zip(outs, whole[0]):
        assert _entries(out)[40:] == expected[40:] and _entries(out)[:40] == [None] * 40


def test_bad_values_are_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"SamplingParams.prompt_logprob_start must be None or an int >= 0, got -1"):
        SamplingParams(prompt_logprobs=0, prompt_logprob_start=-1)
    with pytest.raises(ValueError, match=r"prompt_logprob_start=3 needs prompt_logprobs"):
        SamplingParams(prompt_logprob_start=3)
    with pytest.raises(TypeError, match=r"SamplingParams.prompt_logprob_start must be an int, got float"):
        SamplingParams(prompt_logprobs=0, prompt_logprob_start=2.0)
