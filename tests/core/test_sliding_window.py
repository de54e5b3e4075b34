"""Sliding-window models hold a bounded number of KV blocks per sequence, and stay exact.

The Mistral checkpoint of ``tiny_checkpoints`` attends over the last W = 16 tokens in every layer.
With blocks of B = 4 tokens, a sequence computing n tokens from position c > 0 may hold at most
ceil((W + n - 2) / B) + 1 blocks during that step (``BlockManager``'s module docstring), so a decode
step holds at most ceil(15 / 4) + 1 = 5 blocks however long the sequence grows (here up to 120
tokens: 30 blocks without the window). Each run checks that bound at every step, transformers'
greedy tokens and logprobs (1e-4, float32) for prompts and generations several windows long, and
that the pool is whole afterwards: by default, under recompute and swap preemption, from the
prefix cache, and with n > 1 (forks share, copy and release their blocks by reference count;
sampled completions are checked through transformers' logprobs of the tokens drawn).

The Qwen2 checkpoint has a full-attention layer beside its windowed one: nothing is released.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import tiny_checkpoints
import torch

from pagedgen import LLM, SamplingParams
from pagedgen.core.block_manager import cdiv

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ATOL = 1e-4
W, BS = 16, 4
MAX_TOKENS = 80
DECODE_BOUND = cdiv(W - 1, BS) + 1  # 5 blocks


def _prompts() -> list[list[int]]:
    """6 token-id prompts of 18-40 tokens (longer than the window), the last three sharing a
    29-token prefix (7 full blocks, more than the window); then 6 of 3-8 tokens, whose blocks grow
    from 1-2 to 5 as they pass the window (so that a small pool preempts)."""
    gen = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(1, tiny_checkpoints.VOCAB, (n,), generator=gen).tolist()  # noqa: E731
    shared = ids(29)
    return [ids(n) for n in (18, 40, 23)] + [shared + ids(n) for n in (3, 8, 11)] + [ids(n) for n in (3, 5, 7, 4, 6, 8)]


PROMPTS = _prompts()
LONG = list(range(6))
SHARED = [3, 4, 5]


@dataclass
class Mistral:
    path: str
    hf_model: object
    tokens: list[list[int]]  # transformers' greedy completions of PROMPTS


def _hf_logprobs(hf_model, ids: list[int]) -> list[float]:
    """transformers' logprob of every token of ``ids`` after the first (float32, one forward)."""
    seq = torch.tensor([ids])
    with torch.inference_mode():
        lp = hf_model(seq).logits[0].float().log_softmax(dim=-1)  # [len, vocab]
    return lp[:-1].gather(1, seq[0, 1:, None])[:, 0].tolist()


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("mistral"))
    hf_model = tiny_checkpoints.build("mistral", path)
    assert hf_model.config.sliding_window == W
    tokens = []
    with torch.inference_mode():
        for ids in PROMPTS:
            out = hf_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_TOKENS)
            tokens.append(out[0, len(ids) :].tolist())
    assert len({tuple(t) for t in tokens}) == len(PROMPTS), "greedy outputs do not vary between prompts"
    return Mistral(path, hf_model, tokens)


def _watch_blocks(llm: LLM) -> list[tuple[int, int, int]]:
    """Record (first position, new tokens, blocks held) of every sequence of every step, read
    from the block manager when the step's model call starts (its blocks allocated); also keep a
    worker's mirror of the block tables from the steps' plain-data deltas and check it against the
    block manager's tables (released entries included)."""
    engine = llm.llm_engine
    bm, schedule, execute, seen, mirror = engine.block_manager, engine.scheduler.schedule, engine.model_runner.execute, [], {}

    def watched_schedule():
        plan = schedule()
        plan.apply_block_tables(mirror)
        for seq_id in plan.seq_ids:
            assert mirror[seq_id] == bm.block_table(seq_id), f"the mirror of sequence {seq_id}'s table is stale"
        return plan

    def watched(batch):
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seen.append((seq.num_computed_tokens, n, len(bm.held_blocks(seq.seq_id))))
        return execute(batch)

    engine.scheduler.schedule, engine.model_runner.execute = watched_schedule, watched
    return seen


def _check_bound(seen: list[tuple[int, int, int]]) -> None:
    """Every step within the bound (``BlockManager``'s module docstring); long decodes ran."""
    for start, n, held in seen:
        bound = cdiv(n, BS) if start == 0 else cdiv(W + n - 2, BS) + 1
        assert held <= bound, f"{held} blocks held computing {n} tokens from position {start} (bound {bound})"
    decodes = [(start, held) for start, n, held in seen if n == 1]
    assert max(held for _, held in decodes) <= DECODE_BOUND
    assert max(start for start, _ in decodes) >= 100  # 25 blocks' worth of context, at most 5 held


def _check_pool_whole(llm: LLM) -> None:
    bm, stats = llm.llm_engine.block_manager, llm.get_stats()
    assert bm.check() == [] and stats.num_free_blocks == stats.num_kv_blocks


def _check_greedy(mistral: Mistral, outputs, indices) -> None:
    """Each completion of ``outputs`` (for PROMPTS[i], i in ``indices``) is transformers' greedy
    one, logprobs within ATOL."""
    assert len(outputs) == len(indices)
    for out, i in zip(outputs, indices):
        assert out.prompt_token_ids == PROMPTS[i]
        want = _hf_logprobs(mistral.hf_model, PROMPTS[i] + mistral.tokens[i])[len(PROMPTS[i]) - 1 :]
        for completion in out.outputs:
            assert completion.token_ids == mistral.tokens[i], f"prompt {i}: {completion.token_ids} != transformers' {mistral.tokens[i]}"
            got = [entry[tok].logprob for tok, entry in zip(completion.token_ids, completion.logprobs)]
            assert got == pytest.approx(want, abs=ATOL), f"prompt {i}"


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


@pytest.mark.in_process
def test_the_engine_gets_the_window(mistral, tmp_path):
    assert LLM(mistral.path, block_size=BS).llm_engine.block_manager.sliding_window == W
    qwen2 = str(tmp_path / "qwen2")
    tiny_checkpoints.build("qwen2", qwen2)  # a full-attention layer beside a 24-token window
    llm = LLM(qwen2, block_size=BS)
    assert llm.model_config.sliding_window == 0 and llm.llm_engine.block_manager.sliding_window == 0
    seen = _watch_blocks(llm)
    llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    assert [held for start, n, held in seen] == [cdiv(start + n, BS) for start, n, held in seen]  # every block kept


SMALL_POOL = dict(num_kv_blocks=30, max_model_len=120, enable_prefix_caching=False)  # 12 sequences of up to 5 blocks


@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(SMALL_POOL, preemption_mode="recompute"),
    dict(SMALL_POOL, preemption_mode="swap"),
], ids=["default", "recompute", "swap"])
@pytest.mark.in_process
def test_bounded_blocks_match_transformers(mistral, kwargs):
    llm = LLM(mistral.path, block_size=BS, **kwargs)
    seen = _watch_blocks(llm)
    indices = list(range(len(PROMPTS))) if kwargs else LONG
    _check_greedy(mistral, llm.generate([PROMPTS[i] for i in indices], GREEDY, use_tqdm=False), indices)
    _check_bound(seen)
    stats = llm.get_stats()
    if "preemption_mode" in kwargs:
        assert stats.num_preemptions > 0
        assert (stats.num_swaps_out > 0) == (kwargs["preemption_mode"] == "swap")
    _check_pool_whole(llm)
    # prefix caching: the shared-prefix prompts again read cached blocks, those before the window
    # of the first token computed only as placeholders
    if not kwargs:
        outputs = llm.generate([PROMPTS[i] for i in SHARED], GREEDY, use_tqdm=False)
        assert all(o.num_cached_tokens >= 28 for o in outputs), [o.num_cached_tokens for o in outputs]
        _check_greedy(mistral, outputs, SHARED)
        _check_bound(seen)
        _check_pool_whole(llm)


@pytest.mark.in_process
def test_parallel_samples_share_and_release_blocks(mistral):
    """n > 1: greedy completions all equal transformers'; seeded sampled ones (n = 3) have
    transformers' logprobs for the tokens drawn (so every fork read the right keys)."""
    llm = LLM(mistral.path, block_size=BS)
    seen = _watch_blocks(llm)
    greedy = SamplingParams(n=2, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    _check_greedy(mistral, llm.generate(PROMPTS[:2], greedy, use_tqdm=False), [0, 1])
    sampled = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate(PROMPTS[2:4], sampled, use_tqdm=False)
    for out in outputs:
        assert len({tuple(c.token_ids) for c in out.outputs}) == 3  # the forks parted
        for c in out.outputs:
            want = _hf_logprobs(mistral.hf_model, out.prompt_token_ids + c.token_ids)[len(out.prompt_token_ids) - 1 :]
            assert [e[t].logprob for t, e in zip(c.token_ids, c.logprobs)] == pytest.approx(want, abs=ATOL)
    assert llm.llm_engine.block_manager.num_copies > 0  # copy-on-write of the shared last blocks
    _check_bound(seen)
    _check_pool_whole(llm)
