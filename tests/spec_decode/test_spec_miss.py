"""A cheap speculation miss (issue 34, docs/speculative.md "Cost of a miss"): the incremental n-gram
index against the plain reference, verify rows without per-row views for greedy requests, and the
per-sequence back-off after full misses (outputs equal speculation off, statistics count exactly
the drafts verified)."""
import random

import pytest

from pagedgen import LLM, SamplingParams
from pagedgen.spec_decode import verify
from pagedgen.spec_decode.ngram import INDEX_MAX_N, NgramIndex, propose_reference
from pagedgen.spec_decode.speculator import MAX_PAUSE, MISS_LIMIT, Speculator

MODEL = "../shared/models/stories260K"
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


# ----- the incremental n-gram index ----------------------------------------------------------------
def test_ngram_index_matches_the_reference_as_a_sequence_grows():
    rng = random.Random(1)
    for _ in range(300):
        vocab = rng.choice([2, 3, 5, 20])
        lo = rng.randint(1, 4)
        hi = rng.randint(lo, INDEX_MAX_N)
        index, ids = NgramIndex(lo, hi), []
        for _ in range(rng.randrange(0, 50)):
            for _ in range(rng.choice([1, 1, 1, 2, 4])):  # one token a step, or several accepted at once
                ids.append(rng.randrange(vocab))
            k = rng.randint(1, 8)
            assert index.propose(ids, k) == propose_reference(ids, k, lo, hi), (ids, k, lo, hi)


def test_ngram_index_starts_again_on_a_shorter_sequence_and_refuses_long_n():
    index = NgramIndex(1, 3)
    assert index.propose([0, 1, 2, 3, 0, 1, 2], 2) == [3, 0]
    assert index.propose([5, 6, 5], 2) == [6, 5]  # not a continuation: rebuilt, no stale n-grams
    assert index.propose([5, 6, 5], 2) == propose_reference([5, 6, 5], 2, 1, 3)
    with pytest.raises(ValueError, match="max_n <= 8"):
        NgramIndex(1, INDEX_MAX_N + 1)


# ----- verify rows ---------------------------------------------------------------------------------
class _Seq:
    def __init__(self, params, plain_greedy):
        self.sampling_params, self.plain_greedy, self.token_ids = params, plain_greedy, [1, 2, 3]


@pytest.mark.parametrize("params, views", [
    (SamplingParams(temperature=0), False),
    (SamplingParams(temperature=0, logprobs=2, logit_bias={3: 1.0}), False),  # reads logits only
    (SamplingParams(temperature=0, min_tokens=4), True),  # the output count decides the ban
    (SamplingParams(temperature=0, repetition_penalty=1.3), True),  # the tokens seen
    (SamplingParams(temperature=0.7, seed=3), True),  # the position of the draw
])
def test_draft_rows_build_views_only_where_sampling_reads_tokens(params, views):
    assert verify.reads_tokens(params) == views
    if views:
        return  # views are dataclasses.replace of a real Sequence: covered by the identity tests
    seq = _Seq(params, params.greedy and params.logprobs is None and not params.changes_logits)
    rows, samplers = verify.draft_rows(seq, [7, 8, 9], row_end=10)
    assert list(rows) == [6, 7, 8, 9] and all(s is seq for s in samplers)


# ----- back-off ------------------------------------------------------------------------------------
def _speculator():
    from pagedgen.spec_decode.config import SpeculativeConfig

    return Speculator(SpeculativeConfig.from_dict(SPEC))


def test_back_off_pauses_grow_after_full_misses_and_reset_on_an_accepted_draft():
    spec = _speculator()
    pauses = []
    for _ in range(MISS_LIMIT + 6):
        spec._back_off(7, 0)
        pauses.append(spec._backoff[7][1])
    assert pauses[: MISS_LIMIT - 1] == [0] * (MISS_LIMIT - 1)
    assert pauses[MISS_LIMIT - 1 :] == [min(MAX_PAUSE, 1 << i) for i in range(7)]
    misses = spec._backoff[7][0]
    spec._back_off(7, 1)  # a draft kept: the misses halve, no new pause
    assert spec._backoff[7][0] == misses // 2
    while 7 in spec._backoff:
        spec._back_off(7, 2)
    assert spec._backoff.get(7) is None  # a sequence that keeps hitting counts no misses
    spec._back_off(7, 0)
    assert spec._backoff[7] == [1, 0 if MISS_LIMIT > 1 else 1]
    off = Speculator(spec.config, miss_limit=None)
    for _ in range(10):
        off._back_off(7, 0)
    assert 7 not in off._backoff


def _generate(prompts, params, spec=None, miss_limit=MISS_LIMIT):
    llm = LLM(MODEL, num_kv_blocks=512, block_size=4, speculative_config=spec)
    planned = [0, 0]  # drafts handed to the step, steps with a paused sequence
    if spec is not None:
        speculator = llm.llm_engine.speculator
        speculator.miss_limit = miss_limit
        plan = speculator.plan

        def counting_plan(batch, scheduler):
            planned[1] += sum(1 for seq in batch.seqs if speculator._backoff.get(seq.seq_id, [0, 0])[1])
            drafts = plan(batch, scheduler)
            planned[0] += sum(len(d) for d in drafts.values())
            return drafts

        speculator.plan = counting_plan
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert not llm.llm_engine.block_manager.check()
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs], llm.get_stats(), planned


def test_back_off_keeps_outputs_and_counts_only_verified_drafts(stories_path):
    """Prompts that restart a passage (lookup mostly misses): sequences pause, outputs equal
    speculation off, and the statistics count exactly the drafts that were verified."""
    from conftest import story_openings

    texts = story_openings(24, seed=3)
    prompts = [t + " " + " ".join(t.split()[:4]) for t in texts]
    params = [SamplingParams(temperature=0, max_tokens=48), SamplingParams(temperature=0.8, seed=5, max_tokens=40, n=2),
              SamplingParams(temperature=0, max_tokens=40, min_tokens=8, repetition_penalty=1.2)]
    params = [params[i % 3] for i in range(len(prompts))]
    ref, _, _ = _generate(prompts, params)
    got, stats, (drafts, paused) = _generate(prompts, params, SPEC)
    assert got == ref
    assert paused > 0, "no sequence paused: the back-off was not exercised"
    assert stats.num_draft_tokens == drafts and 0 < stats.num_accepted_tokens < drafts
    assert sum(stats.acceptance_rate_per_position) > 0
    always, always_stats, (always_drafts, always_paused) = _generate(prompts, params, SPEC, miss_limit=None)
    assert always == ref and always_paused == 0
    assert always_stats.num_draft_tokens == always_drafts > drafts  # the back-off proposed less
