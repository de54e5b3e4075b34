"""Logprobs and prompt logprobs equal the log-softmax of transformers' logits for the same tokens
(stories260K, fp32, atol 1e-4), also when prompts are prefilled in chunks and sequences preempted,
and when a long prompt's logprob rows go through the lm_head in chunks; computed from a log-sum-exp
per row, never a [rows, vocab] log-softmax, and for greedy rows from bf16 logits as they are (no
float32 copy). The kernel itself against its reference: tests/ops/test_ops_logprob_topk.py."""
import math

import pytest
import torch

from conftest import story_openings
from pagedgen import LLM, SamplingParams

ATOL = 1e-4
pytestmark = pytest.mark.usefixtures("one_torch_thread")



@pytest.fixture(scope="module")
def prompts():
    return story_openings(4, seed=3)


@pytest.fixture(scope="module")
def hf_logprobs(hf_model):
    """token ids -> [len, vocab] float32 log-softmax of transformers' logits (row i predicts i + 1)."""

    def run(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return hf_model(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)

    return run


PARAMS = SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.3, seed=11, max_tokens=12, logprobs=3, prompt_logprobs=2)


def _check_entry(entry: dict, token: int, ref: torch.Tensor, k: int) -> None:
    """One position: the chosen token with its rank, and the top k with ranks 1..k."""
    assert token in entry and len(entry) in (k, k + 1)
    assert entry[token].logprob == pytest.approx(ref[token].item(), abs=ATOL)
    lo = int((ref > ref[token] + ATOL).sum()) + 1  # rank bounds that tolerate float noise
    hi = int((ref >= ref[token] - ATOL).sum())
    assert lo <= entry[token].rank <= hi
    top = sorted((lp.rank, tid) for tid, lp in entry.items() if tid != token or lp.rank <= k)
    ref_top = ref.topk(k).values
    for (rank, tid), ref_value in zip([t for t in top if t[0] <= k], ref_top.tolist()):
        assert entry[tid].logprob == pytest.approx(ref_value, abs=ATOL)
    assert sorted(r for r, _ in top if r <= k) == list(range(1, k + 1))
    for tid, lp in entry.items():
        assert lp.logprob == pytest.approx(ref[tid].item(), abs=ATOL)
        assert lp.decoded_token is not None


def _check_request(out, hf_logprobs, k_sample: int = 3, k_prompt: int = 2) -> None:
    prompt, completion = out.prompt_token_ids, out.outputs[0]
    ref = hf_logprobs(prompt + completion.token_ids)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        _check_entry(out.prompt_logprobs[i], prompt[i], ref[i - 1], k_prompt)
    assert len(completion.logprobs) == len(completion.token_ids)
    for t, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        _check_entry(entry, token, ref[len(prompt) - 1 + t], k_sample)
    expected_sum = sum(ref[len(prompt) - 1 + t, tok].item() for t, tok in enumerate(completion.token_ids))
    assert completion.cumulative_logprob == pytest.approx(expected_sum, abs=ATOL * len(completion.token_ids))


def test_logprobs_and_prompt_logprobs_match_transformers(llm, prompts, hf_logprobs):
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    for out in outs:
        _check_request(out, hf_logprobs)


def test_chunked_prefill_and_preemption_give_the_same_logprobs(stories_path, llm, prompts, hf_logprobs):
    """A token budget of 5 splits every prompt over several steps; 16 blocks of 8 slots for 4
    sequences force recompute preemptions (prompt logprobs must not be recorded twice)."""
    small = LLM(stories_path, block_size=8, num_kv_blocks=16, max_num_batched_tokens=5, max_model_len=128)
    outs = small.generate(prompts, PARAMS.clone(max_tokens=16), use_tqdm=False)
    assert small.get_stats().num_preemptions > 0
    for out in outs:
        _check_request(out, hf_logprobs)


def test_logprobs_off_and_zero(llm, prompts):
    off = llm.generate(prompts[:1], SamplingParams(max_tokens=4, seed=1), use_tqdm=False)[0]
    assert off.prompt_logprobs is None
    assert off.outputs[0].logprobs is None and off.outputs[0].cumulative_logprob is None
    zero = llm.generate(prompts[:1], SamplingParams(max_tokens=4, seed=1, logprobs=0, prompt_logprobs=0), use_tqdm=False)[0]
    assert zero.outputs[0].token_ids == off.outputs[0].token_ids  # asking for logprobs changes nothing
    for tok, entry in zip(zero.outputs[0].token_ids, zero.outputs[0].logprobs):
        assert list(entry) == [tok]
    for tok, entry in zip(zero.prompt_token_ids[1:], zero.prompt_logprobs[1:]):
        assert list(entry) == [tok]
    assert math.isclose(zero.outputs[0].cumulative_logprob, sum(e[t].logprob for t, e in zip(zero.outputs[0].token_ids, zero.outputs[0].logprobs)))


def test_logprobs_are_of_the_raw_distribution(llm, prompts):
    """Temperature, penalties and top-k do not change the reported logprobs (raw model output)."""
    greedy = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=6, logprobs=2), use_tqdm=False)[0].outputs[0]
    forced = SamplingParams(temperature=0.3, top_k=1, repetition_penalty=1.0, max_tokens=6, logprobs=2)
    other = llm.generate(prompts[:1], forced, use_tqdm=False)[0].outputs[0]
    assert other.token_ids == greedy.token_ids  # top_k=1 is greedy
    for a, b in zip(greedy.logprobs, other.logprobs):
        assert a.keys() == b.keys()
        assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-6) for t in a)


def test_logprobs_from_the_logits_equal_the_log_softmax_and_rows_do_not_depend_on_the_chunk():
    """``logprob_tensors`` takes the raw logits (float32 or bf16) and a log-sum-exp per row: the
    values equal the log-softmax's to float32 rounding, ranks and the top k agree; the chunked form
    over hidden rows gives every row the same bits whatever the chunk size."""
    from pagedgen.sample.logprobs import chunked_logprob_tensors, logprob_tensors, unpack_logprob_dicts

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(37, 1000, generator=g) * 4
    ids = torch.randint(0, 1000, (37,), generator=g)
    for x in (logits, logits.to(torch.bfloat16)):
        ref = x.float().log_softmax(dim=-1)
        dicts = unpack_logprob_dicts(logprob_tensors(x, ids, 5), [5] * 37)
        for r, d in enumerate(dicts):
            chosen = d[int(ids[r])]
            assert chosen.logprob == pytest.approx(ref[r, ids[r]].item(), abs=1e-5)
            assert chosen.rank == int((ref[r] >= ref[r, ids[r]]).sum())
            top = sorted(((lp.rank, t) for t, lp in d.items() if lp.rank <= 5 and (t != int(ids[r]) or lp.rank <= 5)))
            assert [t for _, t in top][:5] == sorted(range(1000), key=lambda j: (-ref[r, j].item(), j))[:5]
    table = torch.randn(37, 1000, generator=g) * 4  # the "lm_head" looks a row's logits up (its GEMM's own
    hidden = torch.arange(37, dtype=torch.float32)[:, None]  # batch invariance is tests/layers' business)
    calls = []

    def head(h):
        calls.append(h.shape[0])
        return table[h[:, 0].long()]  # [n, 1000]

    whole = logprob_tensors(head(hidden), ids, 3)
    calls.clear()
    for chunk in (1, 7, 16, 37, 256):
        got = chunked_logprob_tensors(hidden, head, ids, 3, chunk_rows=chunk)
        assert torch.equal(got, whole) and max(calls) <= chunk
        calls.clear()


def test_a_long_prompts_logprobs_are_computed_in_chunks(stories_path, hf_logprobs, monkeypatch):
    """A 500-token prompt with prompt_logprobs in one step: the lm_head never runs over more than
    PROMPT_LOGPROB_CHUNK_ROWS rows at once (so never [prompt_len, vocab] logits), and every entry
    still equals transformers' log-softmax."""
    from pagedgen.sample import logprobs as logprobs_module

    monkeypatch.setattr(logprobs_module, "PROMPT_LOGPROB_CHUNK_ROWS", 128)
    llm = LLM(stories_path, max_num_batched_tokens=1024)
    rows = []
    real = llm.model.compute_logits
    monkeypatch.setattr(llm.model, "compute_logits", lambda h: rows.append(h.shape[0]) or real(h))
    prompt = [(11 * j) % 500 + 3 for j in range(500)]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1, logprobs=1),
                       use_tqdm=False)[0]
    assert llm.get_stats().num_steps == 2 and max(rows) <= 128 and sum(rows) >= 499  # 4 chunks of prompt rows + the sampled rows
    _check_request(out, hf_logprobs, k_sample=1, k_prompt=1)


def test_greedy_rows_with_logprobs_read_bf16_logits_as_they_are():
    """Greedy rows asking for logprobs, with no logits processing, take the argmax and the logprobs
    of bf16 logits as they are (issue 50: no [rows, vocab] float32 copy): the same tokens and the
    same logprob bits as the same logits given in float32."""
    from pagedgen.core.sequence import Sequence
    from pagedgen.sample.sampler import Sampler

    vocab, g = 3000, torch.Generator().manual_seed(6)
    params = [SamplingParams(temperature=0, logprobs=k) for k in (0, 3, 20, 5)]
    seqs = [Sequence(seq_id=i, request_id=str(i), token_ids=[1, 2, 3], num_prompt_tokens=3, sampling_params=p,
                     eos_token_ids=frozenset({2}), max_model_len=64) for i, p in enumerate(params)]
    logits = (torch.randn(len(seqs), vocab, generator=g) * 3).to(torch.bfloat16)
    copies = []

    class Watch(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in (torch.Tensor.float, torch.Tensor.to) and args[0].dim() == 2 and args[0].shape[1] == vocab:
                copies.append(func.__name__)
            return func(*args, **(kwargs or {}))

    with Watch():
        got = Sampler(0)(logits, seqs)
    assert copies == []
    want = Sampler(0)(logits.float(), seqs)
    assert got.token_ids == want.token_ids == logits.float().argmax(dim=-1).tolist()
    for a, b in zip(got.logprobs, want.logprobs):
        assert [(t, lp.logprob, lp.rank) for t, lp in a.items()] == [(t, lp.logprob, lp.rank) for t, lp in b.items()]
