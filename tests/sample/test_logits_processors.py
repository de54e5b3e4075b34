"""The sampler's logits processors against transformers' (``transformers.generation.logits_process``)
on the same logits, and its sampling frequencies against the filtered distribution (chi-square).

No model: sequences are built by hand. The oracle for each processor is the transformers class of
the same name; presence/frequency penalties have none, so their oracle is the OpenAI formula
written out plainly: logit[j] - frequency * count[j] - presence * (count[j] > 0), output tokens only.
"""
import pytest
import torch
from transformers.generation import logits_process as hf

from pagedgen.core.sequence import Sequence
from pagedgen.sample import logits_processors as lp
from pagedgen.sample import sampler as sampler_module
from pagedgen.sample.sampler import Sampler, inverse_cdf_sample
from pagedgen.sampling_params import SamplingParams

VOCAB = 64
EOS = 2


def _seq(prompt: list[int], output: list[int], params: SamplingParams, seq_id: int = 0) -> Sequence:
    return Sequence(
        seq_id=seq_id,
        request_id=str(seq_id),
        token_ids=list(prompt) + list(output),
        num_prompt_tokens=len(prompt),
        sampling_params=params,
        eos_token_ids=frozenset([EOS]),
        max_model_len=10_000,
        seed=params.seed,
    )


def _random_case(seed: int, rows: int = 4):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, VOCAB, generator=g) * 3  # positive and negative logits
    prompts = [torch.randint(0, VOCAB, (7,), generator=g).tolist() for _ in range(rows)]
    outputs = [torch.randint(0, VOCAB, (9,), generator=g).tolist() for _ in range(rows)]
    return logits, prompts, outputs


def _process(logits, prompts, outputs, params_list):
    seqs = [_seq(p, o, sp, i) for i, (p, o, sp) in enumerate(zip(prompts, outputs, params_list))]
    return Sampler._process(logits.clone(), seqs, params_list)


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.equal(torch.isinf(a), torch.isinf(b)), "different tokens filtered out"
    finite = torch.isfinite(a)
    torch.testing.assert_close(a[finite], b[finite], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_transformers(penalty):
    logits, prompts, outputs = _random_case(0)
    ours = _process(logits, prompts, outputs, [SamplingParams(repetition_penalty=penalty)] * len(prompts))
    input_ids = torch.tensor([p + o for p, o in zip(prompts, outputs)])
    _same(ours, hf.RepetitionPenaltyLogitsProcessor(penalty)(input_ids, logits.clone()))


def test_presence_and_frequency_penalties_follow_openai_on_output_tokens_only():
    logits, prompts, outputs = _random_case(1)
    outputs[0] = [5, 5, 5, 9]
    prompts[0] = [7, 7, 11]  # prompt tokens are not penalised
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)] * len(prompts)
    ours = _process(logits, prompts, outputs, params)
    expected = logits.clone()
    for r, out in enumerate(outputs):
        for tok in set(out):
            expected[r, tok] -= 0.25 * out.count(tok) + 0.5
    _same(ours, expected)
    assert ours[0, 5] == pytest.approx(logits[0, 5].item() - 0.75 - 0.5)
    assert ours[0, 7] == logits[0, 7] and ours[0, 11] == logits[0, 11]


def test_all_penalties_compose_in_vllm_order_and_rows_stay_independent():
    logits, prompts, outputs = _random_case(2)
    params = [
        SamplingParams(repetition_penalty=1.5, presence_penalty=-1.0, frequency_penalty=0.3),
        SamplingParams(),  # untouched row in the same batch
        SamplingParams(repetition_penalty=0.8),
        SamplingParams(frequency_penalty=2.0),
    ]
    ours = _process(logits, prompts, outputs, params)
    for r, sp in enumerate(params):
        ids = torch.tensor([prompts[r] + outputs[r]])
        expected = hf.RepetitionPenaltyLogitsProcessor(sp.repetition_penalty)(ids, logits[r : r + 1].clone())[0]
        for tok in set(outputs[r]):
            expected[tok] -= sp.frequency_penalty * outputs[r].count(tok) + sp.presence_penalty
        _same(ours[r], expected)
    assert torch.equal(ours[1], logits[1])


def test_logit_bias_matches_sequence_bias_processor():
    logits, prompts, outputs = _random_case(3)
    bias = {3: 5.0, 17: -100.0, 40: 0.5}
    ours = _process(logits, prompts, outputs, [SamplingParams(logit_bias=bias)] * len(prompts))
    proc = hf.SequenceBiasLogitsProcessor([[[tok], b] for tok, b in bias.items()])
    input_ids = torch.tensor([p + o for p, o in zip(prompts, outputs)])
    _same(ours, proc(input_ids, logits.clone()))


def test_min_tokens_matches_min_new_tokens_processor():
    logits, prompts, _ = _random_case(4, rows=1)
    stop_ids = [9, 33]
    sp = SamplingParams(min_tokens=3, stop_token_ids=stop_ids)
    for n_out in range(5):
        output = [10] * n_out
        ours = _process(logits, prompts, [output], [sp])
        proc = hf.MinNewTokensLengthLogitsProcessor(len(prompts[0]), 3, [EOS] + stop_ids)
        _same(ours, proc(torch.tensor([prompts[0] + output]), logits.clone()))
    # ignore_eos: EOS is no stop token, so min_tokens does not ban it
    ours = _process(logits, prompts, [[]], [sp.clone(ignore_eos=True)])
    assert torch.isfinite(ours[0, EOS]) and torch.isinf(ours[0, 9])


@pytest.mark.parametrize(
    "ours, theirs",
    [
        (lambda x: lp.apply_top_k_top_p(x, torch.full((x.shape[0],), 5), None), hf.TopKLogitsWarper(5)),
        (lambda x: lp.apply_top_k_top_p(x, None, torch.full((x.shape[0],), 0.8)), hf.TopPLogitsWarper(0.8)),
        (lambda x: lp.apply_top_k_top_p(x, None, torch.full((x.shape[0],), 0.05)), hf.TopPLogitsWarper(0.05)),
        (lambda x: lp.apply_min_p(x, torch.full((x.shape[0],), 0.1)), hf.MinPLogitsWarper(0.1)),
        (lambda x: lp.apply_min_p(x, torch.full((x.shape[0],), 1.0)), hf.MinPLogitsWarper(1.0)),
    ],
)
def test_warpers_match_transformers(ours, theirs):
    logits, prompts, _ = _random_case(5, rows=6)
    ids = torch.tensor(prompts)
    _same(ours(logits.clone()), theirs(ids, logits.clone()))


def test_top_k_then_top_p_per_row_matches_transformers():
    logits, prompts, _ = _random_case(6, rows=3)
    ks, ps = [3, 0, 40], [1.0, 0.6, 0.9]
    ours = lp.apply_top_k_top_p(logits.clone(), torch.tensor(ks), torch.tensor(ps))
    for r, (k, p) in enumerate(zip(ks, ps)):
        expected = logits[r : r + 1].clone()
        if k:
            expected = hf.TopKLogitsWarper(k)(None, expected)
        expected = hf.TopPLogitsWarper(p)(None, expected)
        _same(ours[r : r + 1], expected)


# ----- sampling frequencies ----------------------------------------------------------------------
# The sampler draws N tokens from one row of logits (N identical rows in one call). Under a correct
# sampler the counts are multinomial(N, p), with p the distribution transformers' warpers leave:
# Pearson's statistic X2 = sum_j (count_j - N p_j)^2 / (N p_j) over the tokens with p_j > 0 is then
# asymptotically chi-square with (kept tokens - 1) degrees of freedom. Its p-value is the
# regularised upper incomplete gamma function Q(df / 2, X2 / 2) (torch.special.gammaincc; no scipy).
# The test fails when the p-value is below 1e-6, so a correct sampler fails it for at most ~1 seed
# in a million (the approximation is good here: every kept token expects >= 200 draws). A filtered
# token drawn even once fails it too. Seeded, so the outcome is the same on every run.
N_DRAWS = 20_000
P_VALUE_FLOOR = 1e-6


def _chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    kept = probs > 0
    expected = N_DRAWS * probs[kept].double()
    assert expected.min() >= 200, "choose logits that keep the chi-square approximation valid"
    stat = ((counts[kept].double() - expected) ** 2 / expected).sum()
    df = int(kept.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


SMALL_LOGITS = torch.log(torch.tensor([0.30, 0.20, 0.15, 0.12, 0.09, 0.07, 0.04, 0.03]))


@pytest.mark.parametrize(
    "params, warpers",
    [
        (SamplingParams(temperature=1.0), []),
        (SamplingParams(temperature=0.7), [hf.TemperatureLogitsWarper(0.7)]),
        (SamplingParams(temperature=1.5, top_k=4), [hf.TemperatureLogitsWarper(1.5), hf.TopKLogitsWarper(4)]),
        (SamplingParams(temperature=1.0, top_p=0.7), [hf.TopPLogitsWarper(0.7)]),
        (SamplingParams(temperature=1.0, min_p=0.3), [hf.MinPLogitsWarper(0.3)]),
        (SamplingParams(temperature=0.9, logit_bias={7: 2.0}), "bias"),
    ],
)
def test_sampling_frequencies_match_distribution(params, warpers):
    logits = SMALL_LOGITS.clone()
    if warpers == "bias":
        logits[7] += 2.0
        warpers = [hf.TemperatureLogitsWarper(0.9)]
    expected = logits.unsqueeze(0)
    for w in warpers:
        expected = w(None, expected)
    probs = expected.softmax(dim=-1)[0]

    sampler = Sampler(seed=1234)
    seqs = [_seq([1], [], params, i) for i in range(N_DRAWS)]
    tokens = torch.tensor(sampler(SMALL_LOGITS.expand(N_DRAWS, -1).clone(), seqs).token_ids)
    counts = torch.bincount(tokens, minlength=len(SMALL_LOGITS))
    assert counts[probs == 0].sum() == 0, f"filtered tokens were sampled: {counts.tolist()} vs {probs.tolist()}"
    p_value = _chi_square_p_value(counts, probs)
    assert p_value > P_VALUE_FLOOR, f"counts {counts.tolist()} do not fit {probs.tolist()} (p = {p_value:.2e})"


def test_chi_square_check_has_power():
    """The check rejects a sampler that is only slightly off (temperature 1.1 instead of 1.0)."""
    probs = SMALL_LOGITS.softmax(dim=-1)
    sampler = Sampler(seed=1234)
    seqs = [_seq([1], [], SamplingParams(temperature=1.1), i) for i in range(N_DRAWS)]
    tokens = torch.tensor(sampler(SMALL_LOGITS.expand(N_DRAWS, -1).clone(), seqs).token_ids)
    assert _chi_square_p_value(torch.bincount(tokens, minlength=8), probs) < P_VALUE_FLOOR


def test_greedy_rows_take_the_argmax_of_processed_logits():
    logits = SMALL_LOGITS.expand(3, -1).clone()
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, logit_bias={5: 10.0}), SamplingParams(temperature=0, repetition_penalty=100.0)]
    seqs = [_seq([1], [], params[0], 0), _seq([1], [], params[1], 1), _seq([0], [], params[2], 2)]
    assert Sampler(0)(logits, seqs).token_ids == [0, 5, 1]


@pytest.mark.parametrize("u", [0.0, 1.0 - 2.0**-53])
def test_extreme_uniform_draw_never_picks_a_filtered_token(monkeypatch, u):
    """The smallest and largest U[0, 1) draws pick the first and last token that has probability
    (never a filtered one before, between or after them, never an index past the vocabulary)."""
    monkeypatch.setattr(sampler_module, "counter_uniforms", lambda keys, streams, positions: torch.full((len(keys),), u, dtype=torch.float64))
    inf = float("-inf")
    logits = torch.tensor([[inf, 0.0, inf, 1.0, inf, inf]]).expand(8, -1).clone()
    seqs = [_seq([1], [], SamplingParams(), i) for i in range(4)] + [_seq([1], [], SamplingParams(seed=i), i) for i in range(4)]
    assert set(Sampler(0)(logits, seqs).token_ids) == ({1} if u == 0.0 else {3})


def test_inverse_cdf_sample_is_row_wise():
    """A row's token depends only on its own probabilities and draw, not on the other rows."""
    gen = torch.Generator().manual_seed(0)
    probs = torch.rand(16, 1000, generator=gen).softmax(dim=-1)
    u = torch.rand(16, dtype=torch.float64, generator=gen)
    whole = inverse_cdf_sample(probs, u)
    assert [int(inverse_cdf_sample(probs[i : i + 1], u[i : i + 1])) for i in range(16)] == whole.tolist()
    cdf = probs.double().cumsum(-1)
    assert all(cdf[i, t - 1] <= u[i] * cdf[i, -1] < cdf[i, t] if t else u[i] * cdf[i, -1] < cdf[i, 0] for i, t in enumerate(whole.tolist()))


def test_allowed_token_ids_match_prefix_constrained_processor():
    """allowed_token_ids keeps only its tokens (as transformers' PrefixConstrainedLogitsProcessor with a
    fixed set); a row without it is untouched; the sampled tokens come from the set while the returned
    logprobs stay those of the raw distribution (rank among all tokens)."""
    logits, prompts, outputs = _random_case(5, rows=3)
    allowed = [[3, 17, 40], None, [9]]
    params = [SamplingParams(temperature=0, allowed_token_ids=a, logprobs=0) for a in allowed]
    ours = _process(logits, prompts, outputs, params)
    sets = [a if a is not None else list(range(VOCAB)) for a in allowed]
    oracle = hf.PrefixConstrainedLogitsProcessor(lambda batch_id, ids: sets[batch_id], num_beams=1)
    _same(ours, oracle(torch.tensor([p + o for p, o in zip(prompts, outputs)]), logits.clone()))

    seqs = [_seq(p, o, sp, i) for i, (p, o, sp) in enumerate(zip(prompts, outputs, params))]
    out = Sampler(0)(logits.clone(), seqs)
    raw = logits.log_softmax(dim=-1)
    assert out.token_ids == [max(a, key=lambda t: logits[0, t]) for a in [allowed[0]]] + [int(logits[1].argmax()), 9]
    for row, token in enumerate(out.token_ids):
        lp_row = out.logprobs[row][token]
        assert lp_row.logprob == pytest.approx(float(raw[row, token]), abs=1e-6)
        assert lp_row.rank == int((raw[row] >= raw[row, token]).sum())
    random_rows = [SamplingParams(temperature=1.0, allowed_token_ids=[4, 5])] * 200
    drawn = Sampler(7)(logits[:1].expand(200, -1).clone(), [_seq([1], [], sp, i) for i, sp in enumerate(random_rows)]).token_ids
    assert set(drawn) <= {4, 5}
