"""Every supported family against transformers: one parametrised test over tiny random-weight
checkpoints (``tiny_checkpoints.FAMILIES``; vLLM's tests/models/language/generation/test_common.py).

Sliding windows: the Mistral entry attends over the last 16 tokens in every layer, the Qwen2 entry
over 24 in its second layer only (``max_window_layers``); prompts (up to 45 tokens) and completions
(40) run past both windows.

For each family, transformers' own model is the oracle (float32, eager attention, one prompt at a
time, no padding): greedy ``generate(do_sample=False)`` for 10 prompts x 40 tokens, and the
log-softmax of one forward pass over prompt + completion for every token's logprob. pagedgen must
give the same tokens and logprobs within 1e-4, with its defaults, under preemption (a KV cache of
12 blocks for 10 sequences), with chunked prefill (8 tokens per step) and from the prefix cache (a
second call whose prompts share cached blocks).

bf16 (the rule): both sides round activations to 8 significant bits, in different places
(transformers' eager attention rounds q·k to bf16, pagedgen's kernels accumulate in float32), so
with these large random weights both are up to ~0.7 nats off the float32 logprobs, and ties and
near-ties occur. So: (1) over prompt and completion, pagedgen's bf16 logprobs are no further from
transformers' float32 ones than 1.25x transformers' own bf16 error + 0.05; (2) its greedy tokens
equal transformers' bf16 ``generate`` up to the first difference, and there transformers' bf16
logprob of pagedgen's token is within ``BF16_TIE`` of its best (a near-tie, not an error); (3) past
that point too, pagedgen's greedy choices are as good as transformers' bf16 ones, judged by the
float32 model: the largest gap between the float32 best logprob and that of the token chosen (each
side's completion scored teacher-forced by float32 transformers) is at most 1.25x transformers'
bf16 one + ``BF16_ULP``, and at least 85% of pagedgen's tokens are the argmax of transformers' bf16
forward pass over pagedgen's own prompt + completion (measured: float32 gaps 0.03-0.23 nats for
pagedgen, 0.07-0.71 for transformers' bf16; 89-99% argmax).
"""
from __future__ import annotations

import copy
import os
from dataclasses import dataclass

import pytest
import torch

import tiny_checkpoints
from pagedgen import LLM, SamplingParams

ATOL = 1e-4
MAX_TOKENS = 40
BF16_TIE = 0.5  # nats; the partings seen are at gaps of 0-0.125 (1-2 bf16 ulps of logits of 8-16)
BF16_ULP = 0.125  # nats: one bf16 ulp of a logit in [16, 32), two in [8, 16)

def _prompts() -> list[list[int]]:
    """10 token-id prompts of 3-45 tokens; the last four share a 33-token prefix (two full blocks)."""
    gen = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(1, tiny_checkpoints.VOCAB, (n,), generator=gen).tolist()  # noqa: E731
    shared = ids(33)
    return [ids(n) for n in (3, 11, 6, 17, 9, 24)] + [shared + ids(n) for n in (1, 5, 3, 12)]


PROMPTS = _prompts()
SHARED_PROMPTS = [6, 7, 8, 9]  # indices of the prompts that share a prefix
ALL = list(range(len(PROMPTS)))
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@dataclass
class Reference:
    """transformers' greedy completions and the logprobs of every token after the first."""

    tokens: list[list[int]]
    logprobs: list[list[float]]  # [prompt][position - 1]: logprob of token `position` (prompt + completion)


@dataclass
class Family:
    name: str
    path: str
    hf_model: object
    reference: Reference


def _reference(hf_model) -> Reference:
    tokens, logprobs = [], []
    with torch.inference_mode():
        for ids in PROMPTS:
            out = hf_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_TOKENS)
            full = out[0].tolist()
            lp = hf_model(out).logits[0].float().log_softmax(dim=-1)  # [len, vocab], row i predicts i + 1
            tokens.append(full[len(ids) :])
            logprobs.append(lp[:-1].gather(1, out[0, 1:, None])[:, 0].tolist())
    return Reference(tokens, logprobs)


@pytest.fixture(scope="module", params=list(tiny_checkpoints.FAMILIES))
def family(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    hf_model = tiny_checkpoints.build(request.param, path)
    window = getattr(hf_model.config, "sliding_window", None)
    assert not window or max(map(len, PROMPTS)) > window, "the prompts must be longer than the window"
    reference = _reference(hf_model)
    # the test means something only if the random model's outputs depend on the prompt
    assert len({tuple(t) for t in reference.tokens}) == len(PROMPTS), "greedy outputs do not vary between prompts"
    return Family(request.param, path, hf_model, reference)


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0, prompt_logprobs=0)


def _check(family: Family, outputs, indices: list[int]) -> None:
    """pagedgen's outputs for the prompts ``indices`` equal the reference: tokens, prompt and sample
    logprobs."""
    ref = family.reference
    for out, i in zip(outputs, indices):
        what = f"{family.name}, prompt {i}"
        assert out.prompt_token_ids == PROMPTS[i], what
        completion = out.outputs[0]
        assert completion.token_ids == ref.tokens[i], f"{what}: {completion.token_ids} != transformers' {ref.tokens[i]}"
        n = len(out.prompt_token_ids)
        want = ref.logprobs[i]
        if out.prompt_logprobs is None:  # not asked for: only the completion's
            want = want[n - 1 :]
        got = [out.prompt_logprobs[p][tok].logprob for p, tok in enumerate(out.prompt_token_ids) if p > 0] if out.prompt_logprobs else []
        got += [entry[tok].logprob for tok, entry in zip(completion.token_ids, completion.logprobs)]
        assert len(got) == len(want) and got == pytest.approx(want, abs=ATOL), what


def test_default_and_prefix_caching(family):
    llm = LLM(family.path)
    _check(family, llm.generate(PROMPTS, GREEDY, use_tqdm=False), ALL)
    # prefix caching: the shared-prefix prompts again, in another order, read their cached blocks
    # (prompt logprobs need every prompt position computed, so they are not asked for here)
    again = SHARED_PROMPTS[::-1]
    outputs = llm.generate([PROMPTS[i] for i in again], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0), use_tqdm=False)
    assert all(o.num_cached_tokens >= 32 for o in outputs), [o.num_cached_tokens for o in outputs]
    _check(family, outputs, again)


def test_preemption(family):
    longest = max(map(len, PROMPTS)) + MAX_TOKENS
    llm = LLM(family.path, num_kv_blocks=12, max_model_len=96, enable_prefix_caching=False)
    assert longest <= 96
    _check(family, llm.generate(PROMPTS, GREEDY, use_tqdm=False), ALL)
    stats = llm.get_stats()
    assert stats.num_preemptions > 0 and stats.num_free_blocks == stats.num_kv_blocks


def test_chunked_prefill(family):
    budget = 8
    assert max(map(len, PROMPTS)) > budget
    llm = LLM(family.path, max_num_batched_tokens=budget, enable_prefix_caching=False)
    _check(family, llm.generate(PROMPTS, GREEDY, use_tqdm=False), ALL)


def test_bf16_agrees_with_transformers_bf16(family):
    """The bf16 rule of the module docstring, for 4 of the prompts."""
    hf_bf16 = copy.deepcopy(family.hf_model).to(torch.bfloat16)
    llm = LLM(family.path, dtype="bfloat16")
    err_pagedgen = err_transformers = 0.0
    argmax_hits = num_tokens = 0
    gap_pagedgen = gap_transformers = 0.0  # float32 best logprob - float32 logprob of the chosen token
    for out in llm.generate(PROMPTS[::3], GREEDY, use_tqdm=False):  # 4 prompts
        ids, got = out.prompt_token_ids, out.outputs[0]
        seq = torch.tensor([ids + got.token_ids])
        with torch.inference_mode():
            fp32_all = family.hf_model(seq).logits[0].float().log_softmax(dim=-1)[:-1]  # [len - 1, vocab], row i predicts i + 1
            fp32 = fp32_all.gather(1, seq[0, 1:, None])[:, 0]
            bf16_all = hf_bf16(seq).logits[0].float().log_softmax(dim=-1)[:-1]
            bf16 = bf16_all.gather(1, seq[0, 1:, None])[:, 0]
            ref = hf_bf16.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_TOKENS, output_logits=True, return_dict_in_generate=True)
            ref_fp32 = family.hf_model(ref.sequences).logits[0].float().log_softmax(dim=-1)[len(ids) - 1 : -1]  # [MAX_TOKENS, vocab]
        done = len(ids) - 1  # rows from here chose the completion
        gap_pagedgen = max(gap_pagedgen, (fp32_all[done:].max(dim=-1).values - fp32[done:]).max().item())
        ref_tokens = ref.sequences[0, len(ids) :, None]
        gap_transformers = max(gap_transformers, (ref_fp32.max(dim=-1).values - ref_fp32.gather(1, ref_tokens)[:, 0]).max().item())
        argmax_hits += int((bf16_all[done:].argmax(dim=-1) == seq[0, len(ids) :]).sum())
        num_tokens += len(got.token_ids)
        mine = [out.prompt_logprobs[p][tok].logprob for p, tok in enumerate(ids) if p > 0]
        mine += [entry[tok].logprob for tok, entry in zip(got.token_ids, got.logprobs)]
        err_pagedgen = max(err_pagedgen, (torch.tensor(mine) - fp32).abs().max().item())
        err_transformers = max(err_transformers, (bf16 - fp32).abs().max().item())
        for t, (tok, ref_tok) in enumerate(zip(got.token_ids, ref.sequences[0, len(ids) :].tolist())):
            if tok != ref_tok:  # the greedy paths part: only at a near-tie of transformers' bf16 logits
                step = ref.logits[t][0].float().log_softmax(dim=-1)  # [vocab]
                gap = (step[ref_tok] - step[tok]).item()
                assert gap <= BF16_TIE, f"{family.name}: token {t} differs from transformers' bf16 by {gap:.3f} nats"
                break
    assert err_pagedgen <= 1.25 * err_transformers + 0.05, (family.name, err_pagedgen, err_transformers)
    assert gap_pagedgen <= 1.25 * gap_transformers + BF16_ULP, (family.name, gap_pagedgen, gap_transformers)
    assert argmax_hits >= 0.85 * num_tokens, f"{family.name}: {argmax_hits} of {num_tokens} greedy tokens are transformers' bf16 argmax"


_MATMULS = {torch.nn.functional.linear, torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm, torch.einsum,
            torch.Tensor.__matmul__, torch.Tensor.matmul, torch.Tensor.mm, torch.Tensor.bmm, torch.Tensor.addmm}


def test_every_matmul_goes_through_linear(family):
    """``pagedgen.layers.matmul.linear`` is the single point of the model's matmuls (attention's own
    arithmetic inside ``pagedgen.ops`` excepted): later work makes it batch-invariant there."""
    import sys

    from torch.overrides import TorchFunctionMode

    from pagedgen.layers import matmul as linear_module
    from pagedgen.model import loader

    single_point = linear_module.linear.__code__
    ops_dir = os.path.join(os.path.dirname(linear_module.__file__), "..", "..", "ops")  # matmul/__init__.py
    ops_dir = os.path.realpath(ops_dir)
    stray, seen = [], []

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in _MATMULS:
                frame, ok = sys._getframe(1), False
                while frame is not None and not ok:
                    ok = frame.f_code is single_point or os.path.realpath(frame.f_code.co_filename).startswith(ops_dir)
                    frame = frame.f_back
                (seen if ok else stray).append(func.__name__)
            return func(*args, **(kwargs or {}))

    hf_config = loader.load_hf_config(family.path)
    model = loader.load_model(family.path, hf_config, loader.model_config_from_hf(hf_config, torch.float32))
    cfg = model.config
    T, block = 5, 16
    caches = [(torch.zeros(1, block, cfg.num_kv_heads, cfg.head_dim), torch.zeros(1, block, cfg.num_kv_heads, cfg.head_dim)) for _ in range(cfg.num_layers)]
    from pagedgen.ops import AttentionMetadata

    attn = AttentionMetadata(torch.arange(T), torch.zeros(1, 1, dtype=torch.int32), torch.tensor([T], dtype=torch.int32), torch.tensor([0, T], dtype=torch.int32), T)
    with Watch():
        model.forward(torch.tensor(PROMPTS[1][:T]), torch.arange(T), attn, caches, torch.tensor([T - 1]))
    assert not stray, f"{family.name}: matmuls outside pagedgen.layers.matmul.linear: {stray}"
    assert seen  # the watch saw the projections
