"""Batch invariance end to end (issue 13): a request's token ids and every logprob are bitwise the same
whatever else shares its steps.

The sweep: each configuration below against the default one (``LLM(model, max_model_len=128)``),
in float32 and bfloat16, on stories260K and on a random-weight Llama with grouped-query attention
and head size 64. The requests mix greedy ones with top-k logprobs, seeded sampling with n = 4
(top-k/top-p, logprobs), seeded sampling with min-p and penalties, and one with prompt logprobs;
some prompts share a 20-token prefix (one full block and a part of the next: partial prefix-cache
hits), and some are longer than the 24-token step budget of the chunked-prefill configuration.
Compared: every completion's token ids, cumulative logprob and logprob dictionaries (sampled token
and top-k, with ranks), and the prompt logprobs, with ``==`` on the floats.

The sweep and the needle also run with the 1-byte KV cache (``kv_cache_dtype="int8"``, bfloat16):
its values are quantized per token (pagedgen/ops/kv_quant.py), so the same holds bit for bit.
The sweep runs with int8 W8A8 and FP8 W8A16 weights too (stories260K, ``quantization="int8"`` / ``"fp8"``),
and with int4 W4A16 weights (stories260K written as an AWQ checkpoint).

Also: the "needle" (one request alone vs among 200 companions with other sampling parameters and
lengths), repeated ``generate`` calls on one LLM (the second finds its prefixes cached), and beam
search alone vs among other prompts and with fewer sequences per step.

One torch thread (tiny models: two threads mostly wait for each other on a shared machine); the
per-op tests (tests/layers/test_batch_invariance_ops.py) run with the default thread count.
"""
from __future__ import annotations

import os
import random
import shutil

import pytest
import torch

from conftest import GPT2_TOKENIZER
from pagedgen import LLM, BeamSearchParams, SamplingParams

MAX_MODEL_LEN = 128
TINY_KV = dict(num_kv_blocks=10)  # 160 tokens: 10 sequences of up to ~60 tokens must preempt
CONFIGS = {
    "max_num_seqs=1": dict(max_num_seqs=1),
    "max_num_seqs=7": dict(max_num_seqs=7),
    "recompute": dict(TINY_KV),
    "swap": dict(TINY_KV, preemption_mode="swap"),
    "chunked-24": dict(max_num_batched_tokens=24),
    "no-prefix-cache": dict(enable_prefix_caching=False),
    "shuffled": dict(shuffle=True),
}
PREEMPTING = ("recompute", "swap")
DTYPES = ["float32", "bfloat16"]
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """10 token-id prompts of 3-45 tokens; four share a 20-token prefix, three exceed 24 tokens."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731 (no BOS/EOS ids)
    shared = ids(20)
    return [ids(n) for n in (3, 11, 30, 7, 45, 16)] + [shared + ids(n) for n in (1, 9, 26, 4)]


def _params() -> list[SamplingParams]:
    out = []
    for i in range(10):
        if i % 3 == 0:
            p = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True)
        elif i % 3 == 1:
            p = SamplingParams(n=4, temperature=0.9, top_k=20, top_p=0.9, seed=100 + i, max_tokens=10, logprobs=1, ignore_eos=True)
        else:
            p = SamplingParams(temperature=1.0, min_p=0.05, repetition_penalty=1.2, presence_penalty=0.2, seed=200 + i,
                               max_tokens=14, logprobs=0, ignore_eos=True)
        out.append(p)
    out[4] = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    return out


def _with_n1(p: SamplingParams) -> SamplingParams:
    """``p`` with n = 1: its one completion is completion 0 of ``p`` (same seed, same generator)."""
    return p.clone(n=1)


def _logprobs(entries) -> list | None:
    return None if entries is None else [None if d is None else [(k, v.logprob, v.rank) for k, v in d.items()] for d in entries]


def signature(out) -> tuple:
    """Everything a request returns that is computed from the model, floats as they are."""
    return (out.prompt_token_ids, _logprobs(out.prompt_logprobs),
            [(c.index, c.token_ids, c.cumulative_logprob, _logprobs(c.logprobs)) for c in out.outputs])


def run(path: str, dtype: str, prompts, params, shuffle: bool = False, **kwargs):
    """Signatures in input order, and the LLM's stats."""
    order = list(range(len(prompts)))
    if shuffle:
        random.Random(1).shuffle(order)
    llm = LLM(path, dtype=dtype, max_model_len=MAX_MODEL_LEN, **kwargs)
    outs = llm.generate([prompts[i] for i in order], [params[i] for i in order], use_tqdm=False)
    result = [None] * len(order)
    for j, i in enumerate(order):
        result[i] = signature(outs[j])
    return result, llm.get_stats()


@pytest.fixture(scope="module")
def gqa64_path(tmp_path_factory):
    """A random-weight Llama with 4 query heads, 2 KV heads of 64 features, 2 layers, 4096 tokens."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    if not os.path.isdir(GPT2_TOKENIZER):
        pytest.skip(f"tokenizer not found at {GPT2_TOKENIZER}")
    folder = str(tmp_path_factory.mktemp("gqa64"))
    config = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, max_position_embeddings=256, initializer_range=0.1,
                         bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder, safe_serialization=True)
    for f in os.listdir(GPT2_TOKENIZER):
        if f.endswith((".json", ".txt")):
            shutil.copy(os.path.join(GPT2_TOKENIZER, f), folder)
    return folder


@pytest.fixture(scope="module", params=["stories260K", "gqa64"])
def model_path(request, stories_path):
    return stories_path if request.param == "stories260K" else request.getfixturevalue("gqa64_path")


DTYPES_KV = [("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "int8")]


def _sweep(model_path: str, dtype: str, **extra) -> None:
    vocab = 512 if model_path.endswith("stories260K") else 4096
    prompts, params = _prompts(vocab), _params()
    base, _ = run(model_path, dtype, prompts, params, **extra)
    assert any(c[1] != base[i][2][0][1] for i in range(1, 10, 3) for c in base[i][2][1:])  # n=4 completions differ
    for name, kwargs in CONFIGS.items():
        one = kwargs.get("max_num_seqs") == 1  # n <= max_num_seqs: there the n=4 requests ask for completion 0 only
        got, stats = run(model_path, dtype, prompts, [_with_n1(p) if one else p for p in params], **kwargs, **extra)
        if name in PREEMPTING:
            assert stats.num_preemptions > 0, name
        for i, (a, b) in enumerate(zip(base, got)):
            if one and params[i].n > 1:
                a = (a[0], a[1], a[2][:1])
            assert a == b, f"{name}: request {i} differs"


@pytest.mark.parametrize("dtype,kv_cache_dtype", DTYPES_KV)
def test_sweep_is_bitwise_the_default(model_path, dtype, kv_cache_dtype):
    _sweep(model_path, dtype, kv_cache_dtype=kv_cache_dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sweep_with_int8_weights_is_bitwise_the_default(stories_path, dtype):
    """The same sweep with int8 W8A8 weights (``quantization="int8"``, docs/quantization.md)."""
    _sweep(stories_path, dtype, quantization="int8")


@pytest.mark.parametrize("dtype", DTYPES)
def test_sweep_with_fp8_weights_is_bitwise_the_default(stories_path, dtype):
    """The same sweep with FP8 W8A16 weights (``quantization="fp8"``: the fp8_linear kernel on packed panels
    where it is built, else dequantized into the float GEMM; docs/quantization.md)."""
    _sweep(stories_path, dtype, quantization="fp8")


@pytest.fixture(scope="module")
def int4_path(tmp_path_factory, hf_model, stories_path):
    """stories260K as an AWQ int4 checkpoint (group 32, tests/support/int4_checkpoints.py)."""
    import int4_checkpoints

    folder = os.path.join(str(tmp_path_factory.mktemp("int4")), "stories260K")  # _sweep reads the vocabulary off the name
    int4_checkpoints.write_int4(hf_model, stories_path, folder, "awq", 32)
    return folder


@pytest.mark.parametrize("dtype", DTYPES)
def test_sweep_with_int4_weights_is_bitwise_the_default(int4_path, dtype):
    """The same sweep with int4 W4A16 weights (an AWQ checkpoint: codes dequantized in the kernel's
    registers, each output summed over k in order, docs/quantization.md)."""
    _sweep(int4_path, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_repeated_generate_calls_and_prefix_hits_are_bitwise_the_first(stories_path, dtype):
    prompts, params = _prompts(512, seed=3), _params()
    llm = LLM(stories_path, dtype=dtype, max_model_len=MAX_MODEL_LEN)
    first = [signature(o) for o in llm.generate(prompts, params, use_tqdm=False)]
    again = llm.generate(prompts[::-1], params[::-1], use_tqdm=False)[::-1]  # its prefixes now come from the cache
    assert sum(o.num_cached_tokens for o in again) > 0
    assert [signature(o) for o in again] == first


def _companions(n: int, vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(7)
    prompts, params = [], []
    for i in range(n):
        prompts.append([rng.randrange(3, vocab) for _ in range(rng.randint(1, 60))])
        kind = i % 5
        m = rng.randint(1, 30)
        params.append([
            SamplingParams(temperature=0.0, max_tokens=m),
            SamplingParams(temperature=rng.uniform(0.3, 1.5), top_k=rng.choice([0, 5, 50]), max_tokens=m),  # no seed
            SamplingParams(temperature=0.8, seed=i, n=2, max_tokens=m, logprobs=rng.choice([0, 5])),
            SamplingParams(temperature=1.0, top_p=0.8, frequency_penalty=0.5, seed=i, max_tokens=m, prompt_logprobs=1),
            SamplingParams(temperature=0.0, max_tokens=m, logprobs=2, min_tokens=min(m, 3)),
        ][kind])
    return prompts, params


@pytest.mark.parametrize("dtype,kv_cache_dtype", DTYPES_KV)
def test_needle_alone_or_among_200_companions(stories_path, dtype, kv_cache_dtype):
    needle = list(range(40, 75))  # 35 tokens: two blocks and a part
    needle_params = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=24, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    kv = dict(max_model_len=MAX_MODEL_LEN, kv_cache_dtype=kv_cache_dtype)
    alone = LLM(stories_path, dtype=dtype, **kv).generate([needle], needle_params, use_tqdm=False)[0]
    prompts, params = _companions(200, 512)
    prompts.insert(117, needle)
    params.insert(117, needle_params)
    crowd = LLM(stories_path, dtype=dtype, max_num_seqs=64, **kv).generate(prompts, params, use_tqdm=False)
    assert len(alone.outputs[0].token_ids) == 24
    assert signature(crowd[117]) == signature(alone)


@pytest.mark.parametrize("dtype", DTYPES)
def test_beam_search_alone_or_among_others(stories_path, dtype):
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (12, 5, 30, 21)]
    params = BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True)

    def beams(llm, ps):
        return [[(s.tokens, s.cum_logprob, s.score) for s in out.sequences] for out in llm.beam_search(ps, params, use_tqdm=False)]

    alone = beams(LLM(stories_path, dtype=dtype, max_model_len=MAX_MODEL_LEN), prompts[:1])[0]
    assert beams(LLM(stories_path, dtype=dtype, max_model_len=MAX_MODEL_LEN), prompts[1:3] + prompts[:1] + prompts[3:])[2] == alone
    assert beams(LLM(stories_path, dtype=dtype, max_model_len=MAX_MODEL_LEN, max_num_seqs=4, **TINY_KV), prompts)[0] == alone


def test_batch_invariant_argument():
    from pagedgen.engine_args import EngineArgs

    with pytest.raises(TypeError, match="batch_invariant must be a bool or None"):
        LLM("unused", batch_invariant="yes")
    assert EngineArgs.from_dict({"model": "m", "batch_invariant": "false"}).batch_invariant is False
    assert EngineArgs(model="m").batch_invariant is None
