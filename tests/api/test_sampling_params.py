"""SamplingParams: vLLM's names and defaults; every field refuses bad values with a message that
names the field and its allowed range; an unknown keyword is a TypeError. No model needed, except
for the vocabulary-dependent checks at the end (done by LLM.generate before any work starts)."""
import dataclasses

import pytest

from pagedgen import SamplingParams

# vLLM's SamplingParams defaults (vllm/sampling_params.py), for the fields pagedgen supports.
VLLM_DEFAULTS = dict(
    n=1,
    presence_penalty=0.0,
    frequency_penalty=0.0,
    repetition_penalty=1.0,
    temperature=1.0,
    top_p=1.0,
    top_k=0,
    min_p=0.0,
    seed=None,
    stop=[],
    stop_token_ids=[],
    ignore_eos=False,
    max_tokens=16,
    min_tokens=0,
    logprobs=None,
    prompt_logprobs=None,
    prompt_logprob_start=None,  # vLLM's (its CPU worker reads it; None: the whole prompt)
    detokenize=True,
    skip_special_tokens=True,
    spaces_between_special_tokens=True,
    include_stop_str_in_output=False,
    logit_bias=None,
    allowed_token_ids=None,
    structured_outputs=None,
)


def test_defaults_match_vllm():
    p = SamplingParams()
    assert {f.name for f in dataclasses.fields(p)} == set(VLLM_DEFAULTS)
    assert {k: getattr(p, k) for k in VLLM_DEFAULTS} == VLLM_DEFAULTS


def test_normalisation():
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(logit_bias={3: 1}).logit_bias == {3: 1.0}
    assert SamplingParams(temperature=0).greedy and not SamplingParams(temperature=0.5).greedy
    assert SamplingParams(min_tokens=16, max_tokens=16).min_tokens == 16
    assert SamplingParams(max_tokens=None, min_tokens=100).max_tokens is None


def test_numpy_numbers_are_taken_as_python_ones():
    """Values read from an array or a data frame (numpy ints and floats) are ints and numbers; they
    are stored as Python's (a sidecar, a hash or a request record sees the same values)."""
    import numpy as np

    p = SamplingParams(max_tokens=np.int64(8), n=np.int32(2), seed=np.uint16(3), temperature=np.float32(0.5),
                       stop_token_ids=[np.int64(7)], logit_bias={np.int64(3): np.float32(1.5)}, allowed_token_ids=list(np.arange(4)))
    assert (p.max_tokens, p.n, p.seed, p.stop_token_ids, p.logit_bias) == (8, 2, 3, [7], {3: 1.5})
    assert all(type(v) is int for v in (p.max_tokens, p.n, p.seed, *p.stop_token_ids, *p.logit_bias, *p.allowed_token_ids))
    assert type(p.temperature) is float and p.temperature == 0.5
    with pytest.raises(TypeError, match="max_tokens must be an int"):
        SamplingParams(max_tokens=np.bool_(True))


def test_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'best_of_n'"):
        SamplingParams(best_of_n=2)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n=0), r"n must be at least 1, got 0"),
        (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\], got 2.5"),
        (dict(presence_penalty=-2.01), r"presence_penalty must be in \[-2, 2\]"),
        (dict(frequency_penalty=-3), r"frequency_penalty must be in \[-2, 2\], got -3.0"),
        (dict(repetition_penalty=0.0), r"repetition_penalty must be in \(0, inf\), got 0.0"),
        (dict(repetition_penalty=float("inf")), r"repetition_penalty must be in \(0, inf\)"),
        (dict(temperature=-0.5), r"temperature must be in \[0, inf\)"),
        (dict(temperature=float("nan")), r"temperature must be in \[0, inf\)"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(top_k=-3), r"top_k must be -1, 0 \(all tokens\) or a positive int, got -3"),
        (dict(min_p=1.5), r"min_p must be in \[0, 1\], got 1.5"),
        (dict(min_p=-0.1), r"min_p must be in \[0, 1\]"),
        (dict(seed=2**64), r"seed must be a 64-bit integer"),
        (dict(stop=["ok", ""]), r"stop must be non-empty strings"),
        (dict(stop="x", detokenize=False), r"stop needs detokenize=True"),
        (dict(stop_token_ids=[-1]), r"stop_token_ids must be non-negative token ids"),
        (dict(max_tokens=0), r"max_tokens must be at least 1 \(or None\), got 0"),
        (dict(min_tokens=-1), r"min_tokens must be in \[0, max_tokens\], got -1"),
        (dict(min_tokens=20, max_tokens=16), r"min_tokens must be in \[0, max_tokens=16\], got 20"),
        (dict(logprobs=-1), r"logprobs must be None or an int >= 0, got -1"),
        (dict(prompt_logprobs=-2), r"prompt_logprobs must be None or an int >= 0, got -2"),
        (dict(logit_bias={5: 150.0}), r"logit_bias must be valued in \[-100, 100\], got 150.0"),
        (dict(logit_bias={-5: 1.0}), r"logit_bias must be keyed by non-negative token ids, got -5"),
        (dict(allowed_token_ids=[]), r"allowed_token_ids must be None or a non-empty list of token ids, got \[\]"),
        (dict(allowed_token_ids=[3, -1]), r"allowed_token_ids must be non-negative token ids"),
    ],
)
def test_out_of_range_is_a_value_error_naming_field_and_range(kwargs, match):
    with pytest.raises(ValueError, match=r"SamplingParams\." + match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n=2.0), r"n must be an int"),
        (dict(n=None), r"n must be an int"),
        (dict(presence_penalty="1"), r"presence_penalty must be a number"),
        (dict(frequency_penalty=None), r"frequency_penalty must be a number"),
        (dict(repetition_penalty=True), r"repetition_penalty must be a number"),
        (dict(temperature="hot"), r"temperature must be a number"),
        (dict(min_p=[0.1]), r"min_p must be a number"),
        (dict(top_k=1.5), r"top_k must be an int"),
        (dict(seed=1.5), r"seed must be an int"),
        (dict(min_tokens=None), r"min_tokens must be an int"),
        (dict(logprobs=True), r"logprobs must be an int"),
        (dict(prompt_logprobs="3"), r"prompt_logprobs must be an int"),
        (dict(stop=3), r"stop must be a str or a list of str"),
        (dict(stop=["a", 3]), r"stop must be a str or a list of str"),
        (dict(stop_token_ids="2"), r"stop_token_ids must be a list of int"),
        (dict(ignore_eos="yes"), r"ignore_eos must be a bool"),
        (dict(detokenize=1), r"detokenize must be a bool"),
        (dict(skip_special_tokens=None), r"skip_special_tokens must be a bool"),
        (dict(spaces_between_special_tokens="no"), r"spaces_between_special_tokens must be a bool"),
        (dict(include_stop_str_in_output=0), r"include_stop_str_in_output must be a bool"),
        (dict(logit_bias=[(1, 2.0)]), r"logit_bias must be a dict"),
        (dict(logit_bias={"a": 2.0}), r"logit_bias must map int token ids to numbers"),
        (dict(allowed_token_ids=3), r"allowed_token_ids must be a list of int"),
        (dict(allowed_token_ids=[1, "2"]), r"allowed_token_ids must be a list of int"),
    ],
)
def test_wrong_type_is_a_type_error(kwargs, match):
    with pytest.raises(TypeError, match=r"SamplingParams\." + match):
        SamplingParams(**kwargs)


def test_clone_validates_again():
    p = SamplingParams(temperature=0.5, stop="x")
    assert p.clone(n=3).n == 3 and p.clone(n=3).stop == ["x"]
    with pytest.raises(ValueError, match="min_p must be in"):
        p.clone(min_p=2.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(stop_token_ids=[2, 512]), r"sampling_params\[1\].stop_token_ids has token id 512 outside the vocabulary \[0, 512\)"),
        (dict(logit_bias={600: 1.0}), r"sampling_params\[1\].logit_bias has token id 600 outside the vocabulary \[0, 512\)"),
        (dict(allowed_token_ids=[1, 512]), r"sampling_params\[1\].allowed_token_ids has token id 512 outside the vocabulary \[0, 512\)"),
        (dict(logprobs=513), r"sampling_params\[1\].logprobs must be in \[0, 512\]"),
        (dict(prompt_logprobs=1000), r"sampling_params\[1\].prompt_logprobs must be in \[0, 512\]"),
    ],
)
def test_vocabulary_checks_before_any_work(llm, kwargs, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(["a", "b"], [SamplingParams(max_tokens=2), SamplingParams(max_tokens=2, **kwargs)], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_seed_minus_one_means_no_seed():
    # as vLLM's SamplingParams: -1 is None, not the key -1 (the command line refuses `--seed -1`: cli/args.py)
    assert SamplingParams(temperature=1.0, seed=-1).seed is None
    assert SamplingParams(temperature=1.0, seed=-2).seed == -2
    assert SamplingParams(seed=5).clone(seed=-1).seed is None
