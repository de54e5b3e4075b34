"""End to end on stories260K: stop strings, stop tokens, min_tokens, ignore_eos, seeds and n.

The greedy completion of "Once upon a time" is ", there was a little girl named Lily. She loved to
play outside in the park. ..." with tokens ',' '▁there' '▁was' '▁a' '▁little' '▁g' 'ir' 'l'
'▁named' '▁Lily' ...: stop strings below span tokens ("girl named") or sit inside one ("ittl").
EOS is forced with logit_bias={EOS: 100} where a test needs it early.
"""
import pytest

from conftest import story_openings
from pagedgen import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPT = "Once upon a time"
EOS = 2



def _one(llm, params, prompt=PROMPT):
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]


@pytest.fixture(scope="module")
def base(llm):
    out = _one(llm, SamplingParams(temperature=0, max_tokens=24))
    assert out.text.startswith(", there was a little girl named Lily.")
    return out


@pytest.mark.parametrize(
    "stop, reason, cut",
    [
        ("girl named", "girl named", ", there was a little "),  # spans tokens
        ("ittl", "ittl", ", there was a l"),  # inside the token "▁little"
        (["play", "Lily", "girl named"], "girl named", ", there was a little "),  # earliest match wins
        (["Lily", "ily. S"], "Lily", ", there was a little girl named "),
    ],
)
def test_stop_strings(llm, base, stop, reason, cut):
    out = _one(llm, SamplingParams(temperature=0, max_tokens=24, stop=stop))
    assert (out.text, out.stop_reason, out.finish_reason) == (cut, reason, "stop")
    # the tokens stop with the one that completed the stop string
    assert out.token_ids == base.token_ids[: len(out.token_ids)]
    assert reason in llm.tokenizer.decode(out.token_ids) and reason not in llm.tokenizer.decode(out.token_ids[:-1])
    kept = _one(llm, SamplingParams(temperature=0, max_tokens=24, stop=stop, include_stop_str_in_output=True))
    assert kept.text == cut + reason and kept.token_ids == out.token_ids


def test_text_is_the_same_with_and_without_incremental_detokenization(llm, base):
    """A stop string that never matches switches on the incremental path; the text must not change."""
    assert base.text == llm.tokenizer.decode(base.token_ids, skip_special_tokens=True)
    for extra in ({}, dict(skip_special_tokens=False), dict(logit_bias={EOS: 100.0}, min_tokens=3)):
        plain = _one(llm, SamplingParams(temperature=0, max_tokens=24, **extra))
        incremental = _one(llm, SamplingParams(temperature=0, max_tokens=24, stop="never there", **extra))
        assert incremental.text == plain.text and incremental.token_ids == plain.token_ids
        assert incremental.stop_reason is None


def test_stop_token_ids(llm, base):
    lily = base.token_ids[9]
    assert llm.tokenizer.convert_ids_to_tokens(lily) == "▁Lily"
    for stop in ([], ["never there"]):  # decoded at the end, and incrementally
        out = _one(llm, SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[lily], stop=stop))
        assert (out.token_ids, out.finish_reason, out.stop_reason) == (base.token_ids[:10], "stop", lily)
        assert out.text == ", there was a little girl named"  # the stop token's text is left out
        kept = _one(llm, SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[lily], stop=stop, include_stop_str_in_output=True))
        assert kept.text == ", there was a little girl named Lily"


def test_min_tokens_suppresses_eos_and_stop_tokens(llm):
    forced_eos = SamplingParams(temperature=0, max_tokens=10, logit_bias={EOS: 100.0})
    out = _one(llm, forced_eos)
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([EOS], "stop", None)
    out = _one(llm, forced_eos.clone(min_tokens=5))
    assert len(out.token_ids) == 6 and EOS not in out.token_ids[:5] and out.token_ids[5] == EOS
    assert out.finish_reason == "stop"

    forced_stop = SamplingParams(temperature=0.7, seed=3, max_tokens=10, stop_token_ids=[300], logit_bias={300: 100.0}, min_tokens=4)
    out = _one(llm, forced_stop)
    assert len(out.token_ids) == 5 and 300 not in out.token_ids[:4] and out.stop_reason == 300


def test_min_tokens_delays_stop_strings(llm, base):
    # "," is the first token; with min_tokens=3 the next "," is the first to count
    plain = _one(llm, SamplingParams(temperature=0, max_tokens=40))
    assert plain.text.count(",") >= 2
    out = _one(llm, SamplingParams(temperature=0, max_tokens=40, stop=",", min_tokens=3))
    assert out.text == plain.text[: plain.text.index(",", 1)] and out.stop_reason == ","


def test_ignore_eos_generates_through_eos(llm):
    out = _one(llm, SamplingParams(temperature=0, max_tokens=6, logit_bias={EOS: 100.0}, ignore_eos=True))
    assert out.token_ids == [EOS] * 6 and out.finish_reason == "length"


# ----- seeds and n -------------------------------------------------------------------------------
SEEDED = SamplingParams(temperature=1.0, top_p=0.95, min_p=0.02, presence_penalty=0.5, seed=1234, max_tokens=24, logprobs=1)


@pytest.fixture(scope="module")
def others():
    return story_openings(10, seed=5)


@pytest.fixture(scope="module")
def alone(llm):
    return _one(llm, SEEDED)


def test_seeded_request_in_a_batch_of_unseeded_ones(llm, others, alone):
    prompts = others[:5] + [PROMPT] + others[5:]
    params = [SamplingParams(temperature=1.0, max_tokens=5 + 3 * i) for i in range(len(others))]
    params.insert(5, SEEDED)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[5].outputs[0].token_ids == alone.token_ids


def test_seeded_requests_ignore_order_and_other_seeds(llm, others, alone):
    prompts = [PROMPT] + others[:4]
    params = [SEEDED] + [SEEDED.clone(seed=s, max_tokens=10) for s in range(4)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    reversed_outs = llm.generate(prompts[::-1], params[::-1], use_tqdm=False)[::-1]
    assert outs[0].outputs[0].token_ids == alone.token_ids
    for a, b in zip(outs, reversed_outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_seeded_request_after_preemption(stories_path, others, alone):
    small = LLM(stories_path, block_size=8, num_kv_blocks=12, max_model_len=96)  # the cache holds 96 tokens
    prompts = others + [PROMPT]
    params = [SamplingParams(temperature=1.0, max_tokens=30)] * len(others) + [SEEDED]
    outs = small.generate(prompts, params, use_tqdm=False)
    assert small.get_stats().num_preemptions > 0
    assert outs[-1].outputs[0].token_ids == alone.token_ids


def test_n_completions(llm, alone):
    out = llm.generate([PROMPT], SEEDED.clone(n=3), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert out.outputs[0].token_ids == alone.token_ids  # completion 0 uses the seed itself
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    again = llm.generate(["Lily went", PROMPT], [SamplingParams(max_tokens=3), SEEDED.clone(n=3)], use_tqdm=False)[1]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, n=2, max_tokens=8, prompt_logprobs=1), use_tqdm=False)[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids
    assert len(greedy.prompt_logprobs) == len(greedy.prompt_token_ids)
