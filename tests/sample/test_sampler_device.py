"""The sampler on the logits' device against the host sampler it replaced (tests/support/host_sampler_reference.py).

Given the same logits, every ``SamplingParams`` field gives the same tokens, bit for bit, and the
same logprobs (within 1e-6); the counter-based draws in torch int64 arithmetic equal the plain
Python reference bit for bit; and a step brings its results back to the host in one copy. Runs on
the CPU and, where there is one, on a CUDA GPU (the same logits moved there).
"""
import random
import sys

import pytest
import torch
from host_sampler_reference import HostSampler

from pagedgen.core.sequence import Sequence
from pagedgen.sample import sampler as sampler_mod
from pagedgen.sample.sampler import Sampler, as_int64, counter_uniform, counter_uniforms_torch
from pagedgen.sampling_params import SamplingParams
from pagedgen.structured_output import token_bitmask
from pagedgen.structured_output.token_bitmask import GrammarBitmask

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
VOCAB = 1000

PARAMS = {
    "greedy": SamplingParams(temperature=0),
    "greedy_logprobs": SamplingParams(temperature=0, logprobs=3),
    "temperature_seed": SamplingParams(temperature=0.8, seed=5),
    "negative_seed": SamplingParams(temperature=1.0, seed=-(2**63) + 7),
    "unseeded": SamplingParams(temperature=1.0),
    "top_k": SamplingParams(temperature=1.0, top_k=20, seed=1),
    "top_p": SamplingParams(temperature=1.0, top_p=0.8, seed=2),
    "top_k_top_p": SamplingParams(temperature=0.7, top_k=50, top_p=0.9),
    "min_p": SamplingParams(temperature=1.0, min_p=0.05, seed=3),
    "penalties": SamplingParams(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4, seed=4),
    "greedy_penalties": SamplingParams(temperature=0, repetition_penalty=2.0, presence_penalty=1.0),
    "logit_bias": SamplingParams(temperature=1.0, logit_bias={3: 5.0, 7: -2.0, 11: 3.5}, seed=6),
    "allowed": SamplingParams(temperature=1.0, allowed_token_ids=list(range(40, 90)), seed=7),
    "min_tokens": SamplingParams(temperature=0, min_tokens=50, max_tokens=64, stop_token_ids=[4, 9]),
    "logprobs0": SamplingParams(temperature=1.0, logprobs=0, seed=8),
    "logprobs5": SamplingParams(temperature=0.9, top_k=30, logprobs=5, seed=9),
}


def _seqs(rng: random.Random, names: list[str]) -> list[Sequence]:
    seqs = []
    for i, name in enumerate(names):
        p = PARAMS[name]
        tokens = [rng.randrange(VOCAB) for _ in range(rng.randint(6, 40))]
        seqs.append(Sequence(seq_id=100 + i, request_id=str(i), token_ids=tokens, num_prompt_tokens=5, sampling_params=p,
                             eos_token_ids=frozenset({2}), max_model_len=512,
                             seed=None if p.seed is None else as_int64(p.seed), index=i % 3))
    return seqs


def _bitmask(rng: random.Random, seqs: list[Sequence]) -> GrammarBitmask:
    chosen = [s.seq_id for s in seqs if rng.random() < 0.3] or [seqs[0].seq_id]
    words = torch.randint(-(2**31), 2**31, (len(chosen), -(-VOCAB // 32)), dtype=torch.int64,
                          generator=torch.Generator().manual_seed(rng.randrange(1 << 30))).to(torch.int32)
    return GrammarBitmask(chosen, words)


def _compare(got, want) -> None:
    assert got.token_ids == want.token_ids
    assert (got.logprobs is None) == (want.logprobs is None)
    for g, w in zip(got.logprobs or [], want.logprobs or []):
        assert (g is None) == (w is None)
        if g is None:
            continue
        assert list(g) == list(w)  # the same tokens in the same order (chosen, then the top k)
        for token in g:
            assert g[token].rank == w[token].rank
            assert g[token].logprob == pytest.approx(w[token].logprob, abs=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(PARAMS))
def test_each_field_matches_the_host_sampler(device, name):
    """Rows of one field among greedy rows: the same tokens and logprobs as the host sampler."""
    rng = random.Random(sorted(PARAMS).index(name))
    seqs = _seqs(rng, [name, "greedy", name, name])
    logits = torch.randn(len(seqs), VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    want = HostSampler(11)(logits.clone(), seqs)
    _compare(Sampler(11)(logits.clone().to(device), seqs), want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batches_with_a_grammar_match_the_host_sampler(device, dtype):
    rng = random.Random(5)
    for trial in range(6):
        names = [rng.choice(sorted(PARAMS)) for _ in range(rng.randint(1, 24))]
        seqs = _seqs(rng, names)
        logits = (torch.randn(len(seqs), VOCAB, generator=torch.Generator().manual_seed(trial)) * 4).to(dtype)
        mask = _bitmask(rng, seqs) if trial % 2 else None
        want = HostSampler(3)(logits.clone(), seqs, mask)
        _compare(Sampler(3)(logits.clone().to(device), seqs, mask), want)


@pytest.mark.parametrize("device", DEVICES)
def test_counter_uniforms_in_torch_equal_the_python_reference(device):
    rng = random.Random(2)
    extremes = [0, 1, -1, 2**63 - 1, -(2**63), 2**62, -(2**62) - 3]
    cols = [extremes + [rng.randrange(-(2**63), 2**63) for _ in range(3000)] for _ in range(3)]
    for col in cols:
        rng.shuffle(col)
    got = counter_uniforms_torch(*(torch.tensor(c, device=device) for c in cols))
    assert got.dtype == torch.float64 and got.device.type == device
    assert got.tolist() == [counter_uniform(k, s, p) for k, s, p in zip(*cols)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("names", [["greedy"] * 5, ["greedy", "temperature_seed", "logprobs5", "penalties", "allowed", "min_tokens"]])
def test_one_copy_to_the_host_per_step(device, names, monkeypatch):
    """The sampler's results reach the host through ``_to_host`` exactly once; no ``.item()``,
    ``.tolist()`` or ``.cpu()`` touches a tensor on the logits' device anywhere else."""
    calls = []
    real = sampler_mod._to_host
    monkeypatch.setattr(sampler_mod, "_to_host", lambda t: calls.append(t.shape) or real(t))
    seqs = _seqs(random.Random(0), names)
    logits = torch.randn(len(seqs), VOCAB).to(device)
    syncs = []

    class Watch(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in (torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.cpu) and args[0].device.type != "cpu":
                syncs.append(func.__name__)
            return func(*args, **(kwargs or {}))

    with Watch():
        out = Sampler(0)(logits, seqs)
    assert len(calls) == 1 and len(out.token_ids) == len(seqs)
    assert syncs == ([] if device == "cpu" else ["cpu"])  # the one copy inside _to_host


def _sparse_bitmask(rng: random.Random, seqs: list[Sequence], vocab: int, kinds=("few", "few", "few", "one", "many")) -> GrammarBitmask:
    """Constrained rows of every kind: a few allowed tokens (sampled among them alone), one, many
    (past MAX_CANDIDATES: the full masked row), none inside the vocabulary (the grammar manager
    ends such a request before it is sampled: structured_output/grammar.py); some rows unconstrained."""
    chosen = [s.seq_id for s in seqs if rng.random() < 0.8] or [seqs[0].seq_id]
    words = torch.zeros(len(chosen), -(-vocab // 32) + 1, dtype=torch.int64)  # one word wider than the vocabulary
    for row in range(len(chosen)):
        kind = rng.choice(kinds)
        count = {"few": rng.randint(2, 60), "one": 1, "many": token_bitmask.MAX_CANDIDATES + rng.randint(1, 500), "none": 0}[kind]
        for t in rng.sample(range(vocab), count):
            words[row, t // 32] |= 1 << (t % 32)
        if kind == "none":
            words[row, -1] = 1  # a bit past the vocabulary only
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return GrammarBitmask(chosen, words)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_with_few_allowed_tokens_sample_among_them_as_the_full_masked_row(device, dtype, monkeypatch):
    """A grammar row allowing few tokens is sampled over its candidates alone: the same tokens and
    logprobs as the host sampler over the full masked rows, in batches that mix such rows with
    dense-mask, unconstrained, logprob and penalised rows; and the step still makes one copy."""
    vocab = 3000
    monkeypatch.setattr(sys.modules[__name__], "VOCAB", vocab)
    calls, used = [], []
    real_host, real_candidates = sampler_mod._to_host, GrammarBitmask.candidates
    monkeypatch.setattr(sampler_mod, "_to_host", lambda t: calls.append(t.shape) or real_host(t))
    monkeypatch.setattr(GrammarBitmask, "candidates", lambda self, *a: used.append(r := real_candidates(self, *a)) or r)
    rng = random.Random(11)
    for trial in range(12):
        names = [rng.choice(sorted(PARAMS)) for _ in range(rng.randint(1, 40))]
        seqs = _seqs(rng, names)
        logits = (torch.randn(len(seqs), vocab, generator=torch.Generator().manual_seed(100 + trial)) * 4).to(dtype)
        mask = _sparse_bitmask(rng, seqs, vocab)
        want = HostSampler(3)(logits.clone(), seqs, mask)
        calls.clear()
        _compare(Sampler(3)(logits.clone().to(device), seqs, mask), want)
        assert len(calls) == 1
    sampled_alone = sum(len(c.rows) for c in used if c is not None)
    assert sampled_alone > 50  # the candidate path did the work it is for


def test_small_vocabularies_sample_full_masked_rows(monkeypatch):
    """Below ``MIN_CANDIDATE_VOCAB`` no row takes the candidate path (its fixed cost outweighs
    sampling a short row); the tokens are the host sampler's either way."""
    used = []
    monkeypatch.setattr(GrammarBitmask, "candidates", lambda self, *a: used.append(1))
    rng = random.Random(3)
    seqs = _seqs(rng, ["temperature_seed", "greedy", "top_p"] * 4)
    vocab = token_bitmask.MIN_CANDIDATE_VOCAB - 1
    logits = torch.randn(len(seqs), vocab, generator=torch.Generator().manual_seed(7)) * 4
    mask = _sparse_bitmask(rng, seqs, vocab, kinds=("few", "one"))
    _compare(Sampler(3)(logits.clone(), seqs, mask), HostSampler(3)(logits.clone(), seqs, mask))
    assert not used


def test_candidates_are_a_row_wise_choice():
    """Which rows go to the candidate path, and their tokens, depend on each row alone."""
    rng = random.Random(4)
    seqs = _seqs(rng, ["temperature_seed", "greedy", "logprobs5", "penalties", "top_p", "greedy"])
    mask = _sparse_bitmask(random.Random(9), seqs, 3000, kinds=("few", "one", "many", "none"))
    eligible = [s.sampling_params.logprobs is None and not s.sampling_params.changes_logits for s in seqs]
    whole = mask.candidates(seqs, eligible, 3000)
    for i in range(len(seqs)):
        alone = mask.candidates([seqs[i]], [eligible[i]], 3000)
        if i in (whole.rows if whole else []):
            k = whole.rows.index(i)
            start = int(whole.counts[:k].sum())
            assert alone is not None and alone.pair_tokens.tolist() == whole.pair_tokens[start:start + whole.counts[k]].tolist()
        else:
            assert alone is None


def _allow(rows: list[list[int]], vocab: int) -> torch.Tensor:
    """The bitmask [len(rows), ceil(vocab / 32)] int32 allowing each row's tokens."""
    words = torch.zeros(len(rows), -(-vocab // 32), dtype=torch.int64)
    for r, tokens in enumerate(rows):
        for t in tokens:
            words[r, t // 32] |= 1 << (t % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


TRIALS, PROBES = 80, 128


def test_a_candidate_row_draws_the_same_token_whatever_shares_the_step(monkeypatch):
    """A seeded constrained row sampled among its few allowed tokens draws the same token alone and
    beside a row allowing many more (which widens the step's candidate tensor), probed where it
    matters: its logit moved ulp by ulp across the boundary between two tokens of its draw. The
    softmax's sum depends on a row's length, so padding a row to the step's widest one moved that
    boundary by a rounding error (a few probes in a hundred trials drew another token)."""
    vocab, sampler, rng = 256, Sampler(0), random.Random(5)
    monkeypatch.setattr(token_bitmask, "MIN_CANDIDATE_VOCAB", 0)  # the candidate path at this small vocabulary
    wide = list(range(150, 250))  # 100 allowed tokens
    kinds = [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9), dict(temperature=1.3, min_p=0.02), dict(temperature=1.0, top_k=8)]
    probed = 0
    for trial in range(TRIALS):
        count = rng.randint(3, 30)
        allowed = sorted(rng.sample(range(140), count))
        params = SamplingParams(seed=rng.randrange(1 << 40), **kinds[trial % len(kinds)])
        base = torch.full((vocab,), -3.0)
        base[allowed] = torch.randn(count, generator=torch.Generator().manual_seed(trial)) * 2

        row_mask, wide_mask = _allow([allowed], vocab), _allow([wide], vocab)
        wide_logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(1000 + trial))
        wide_seq = Sequence(seq_id=10**6, request_id="wide", token_ids=[5, 6, 7], num_prompt_tokens=3,
                            sampling_params=SamplingParams(temperature=1.0, seed=9), eos_token_ids=frozenset({2}), max_model_len=64)

        copies = [Sequence(seq_id=k, request_id=str(k), token_ids=[5, 6, 7], num_prompt_tokens=3, sampling_params=params,
                           eos_token_ids=frozenset({2}), max_model_len=64, seed=params.seed, index=0) for k in range(2 * PROBES + 1)]

        def draw(values: list[float], token: int, company: bool) -> list[int]:
            """The tokens of copies of the row (one seed, index and position: one draw) with ``token``'s logit set to each value."""
            logits = base.repeat(len(values), 1)  # [len(values), vocab]
            logits[:, token] = torch.tensor(values, dtype=torch.float32)
            seqs = copies[: len(values)]
            mask = row_mask.expand(len(values), -1)
            if company:
                logits, seqs, mask = torch.cat([logits, wide_logits]), seqs + [wide_seq], torch.cat([mask, wide_mask])
            return sampler(logits, seqs, GrammarBitmask([s.seq_id for s in seqs], mask.contiguous())).token_ids[: len(values)]

        token = draw([float(base[allowed[0]])], allowed[0], False)[0]
        if token == allowed[0]:
            continue
        low, high = -30.0, 30.0  # the draw takes ``token`` once its logit is high enough: find where
        for _ in range(6):  # a grid of 64 logits a call, narrowed to the first that draws ``token``
            grid = torch.linspace(low, high, 64, dtype=torch.float64).tolist()
            first = next(k for k, t in enumerate(draw(grid, token, False)) if t == token)
            low, high = grid[max(first - 1, 0)], grid[first]
        bits = torch.tensor([low], dtype=torch.float32).view(torch.int32) + torch.arange(-PROBES, PROBES + 1, dtype=torch.int32)
        probes = bits.view(torch.float32).tolist()  # neighbouring float32 logits around the boundary
        alone = draw(probes, token, False)
        assert len(set(alone)) > 1  # the probes straddle the boundary
        assert draw(probes, token, True) == alone, f"trial {trial}"
        probed += 1
    assert probed > TRIALS // 2
