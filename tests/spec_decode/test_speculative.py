"""Speculative decoding (issue 34): the config's checks, the n-gram proposer against its plain
reference, and the rejection sampler's exactness (greedy identity; a chi-square test that sampled
tokens follow the target's distribution with a deliberately bad draft)."""
import json
import os
import random

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from pagedgen import LLM
from pagedgen.engine_args import EngineArgs
from pagedgen.sample.rejection_sampler import ACCEPT_STREAM, RESIDUAL_STREAM, greedy_verify, rejection_sample, spec_uniforms
from pagedgen.spec_decode.config import SpeculativeConfig
from pagedgen.spec_decode.ngram import NgramProposer, propose, propose_reference

MODEL = "../shared/models/stories260K"


# ----- config ----------------------------------------------------------------------------------------
def test_config_defaults_follow_vllm():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max, c.disable_by_batch_size) == (5, 5, None)
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 6,
                                     "disable_by_batch_size": 8})
    assert (c.prompt_lookup_min, c.prompt_lookup_max, c.disable_by_batch_size) == (2, 6, 8)
    assert SpeculativeConfig.from_dict(c) == c


@pytest.mark.parametrize("bad, exc, words", [
    ([], TypeError, "must be a dict"),
    ({"method": "ngram"}, ValueError, "num_speculative_tokens"),
    ({"num_speculative_tokens": 2}, ValueError, "'method'"),
    ({"method": "eagle", "num_speculative_tokens": 2}, ValueError, "one of ('ngram', 'draft_model')"),
    ({"method": "ngram", "num_speculative_tokens": 0}, ValueError, "num_speculative_tokens'] must be [1, 32], got 0"),
    ({"method": "ngram", "num_speculative_tokens": 33}, ValueError, "[1, 32]"),
    ({"method": "ngram", "num_speculative_tokens": 2.0}, TypeError, "must be an int"),
    ({"method": "ngram", "num_speculative_tokens": True}, TypeError, "must be an int"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, ValueError, "prompt_lookup_min'] must be [1, 1024]"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 3}, ValueError, "<= prompt_lookup_max (3), got 4"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1}, ValueError, "disable_by_batch_size'] must be >= 2"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": MODEL}, ValueError, "draft_model' only"),
    ({"method": "ngram", "num_speculative_tokens": 2, "k": 3}, ValueError, "unknown keys ['k']"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, ValueError, "needs 'model'"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": MODEL, "prompt_lookup_max": 3}, ValueError, "'ngram' only"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "/no/such/folder"}, FileNotFoundError, "/no/such/folder"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": f"{MODEL}/config.json"}, ValueError, "got a file"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": ""}, ValueError, "empty path"),
    ({"method": 1, "num_speculative_tokens": 2}, TypeError, "'method'] must be a str"),
    ({"method": ["ngram"], "num_speculative_tokens": 2}, TypeError, "'method'] must be a str"),
])
def test_config_refuses_bad_fields(bad, exc, words):
    with pytest.raises(exc) as info:
        SpeculativeConfig.from_dict(bad)
    assert words in str(info.value)


def test_config_takes_numpy_ints_and_mappings():
    import types

    c = SpeculativeConfig.from_dict(types.MappingProxyType({"method": "ngram", "num_speculative_tokens": np.int64(3),
                                                            "prompt_lookup_max": np.int32(4)}))
    assert (c.num_speculative_tokens, c.prompt_lookup_max) == (3, 4) and type(c.num_speculative_tokens) is int


@pytest.mark.parametrize("damage, exc, words", [
    ("no config", FileNotFoundError, "config.json"),
    ("bad json", ValueError, "config.json"),
    ("no weights", FileNotFoundError, "safetensors"),
    ("truncated weights", ValueError, "safetensors"),
])
def test_a_broken_draft_checkpoint_is_named_as_the_draft(tmp_path, damage, exc, words):
    """Errors reading the draft's files name speculative_config['model'], not just a path that could
    be mistaken for the target's; the class is kept (FileNotFoundError / ValueError)."""
    import shutil

    draft = tmp_path / "draft"
    shutil.copytree(MODEL, draft)
    if damage == "no config":
        os.remove(draft / "config.json")
    elif damage == "bad json":
        (draft / "config.json").write_text("{not json")
    elif damage == "no weights":
        os.remove(draft / "model.safetensors")
    else:
        data = (draft / "model.safetensors").read_bytes()
        (draft / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(exc) as info:
        LLM(MODEL, num_kv_blocks=64, speculative_config={"method": "draft_model", "num_speculative_tokens": 2, "model": str(draft)})
    message = str(info.value)
    assert "speculative_config['model']" in message and words in message, message


def test_llm_checks_the_config_before_loading(tmp_path):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(str(tmp_path / "not-even-a-model"), speculative_config={"method": "ngram", "num_speculative_tokens": 0})


def test_draft_with_another_vocabulary_is_refused(tmp_path):
    draft = tmp_path / "draft"
    draft.mkdir()
    cfg = json.loads(open(f"{MODEL}/config.json").read())
    cfg["vocab_size"] += 7
    (draft / "config.json").write_text(json.dumps(cfg))
    import shutil
    shutil.copy(f"{MODEL}/model.safetensors", draft / "model.safetensors")
    with pytest.raises(ValueError, match=r"vocab_size \d+, the target has \d+"):
        LLM(MODEL, num_kv_blocks=64, speculative_config={"method": "draft_model", "num_speculative_tokens": 2, "model": str(draft)})


def test_cli_flag_parses_json():
    import argparse
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args(["--model", MODEL, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'])
    assert EngineArgs.from_cli_args(ns).speculative_config == {"method": "ngram", "num_speculative_tokens": 4}
    assert EngineArgs.from_cli_args(parser.parse_args(["--model", MODEL])).speculative_config is None


# ----- n-gram proposer -------------------------------------------------------------------------------
def test_ngram_example_from_the_docstring():
    ids = [0, 1, 2, 3, 0, 1, 2, 4, 0, 1, 2]  # a b c d a b c e a b c
    assert propose(ids, 3, 1, 3) == [4, 0, 1]
    assert propose(ids, 8, 3, 3) == [4, 0, 1, 2, 4, 0, 1, 2]  # past the end: the period (4) repeats
    assert propose([7, 5, 5, 5], 4, 1, 2) == [5, 5, 5, 5]  # a loop of one token: k proposals, not one
    assert propose([5, 6, 7], 3, 1, 3) == []  # no earlier occurrence
    assert propose([], 3, 1, 3) == [] and propose([9], 3, 1, 3) == []


def test_ngram_matches_the_plain_reference():
    rng = random.Random(0)
    for _ in range(2000):
        vocab = rng.choice([2, 3, 5, 20])
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(0, 60))]
        k, lo = rng.randint(1, 8), rng.randint(1, 4)
        hi = rng.randint(lo, 6)
        assert propose(ids, k, lo, hi) == propose_reference(ids, k, lo, hi), (ids, k, lo, hi)


def test_ngram_proposer_switches_off_at_batch_size():
    cfg = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
                                       "prompt_lookup_max": 2, "disable_by_batch_size": 3})
    p = NgramProposer(cfg)
    batch = [[1, 2, 3, 1, 2], [4, 4, 4]]
    assert p.propose(batch) == [[3, 1], [4, 4]]
    assert p.propose(batch, num_running=3) == [[], []]


# ----- rejection sampler -----------------------------------------------------------------------------
def test_greedy_verify_equals_argmax_decoding():
    assert greedy_verify([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all accepted + bonus
    assert greedy_verify([5, 6, 7, 8], [5, 9, 7]) == [5, 6]  # the target's token at the first mismatch
    assert greedy_verify([5], []) == [5]


def _draws(n_trials, k, seed):
    accept = [spec_uniforms(seed, 0, 100 * t, k, ACCEPT_STREAM) for t in range(n_trials)]
    resid = [spec_uniforms(seed, 0, 100 * t, k + 1, RESIDUAL_STREAM) for t in range(n_trials)]
    return accept, resid


@pytest.mark.parametrize("draft_kind", ["bad_draft_model", "ngram_wrong", "ngram_right"])
def test_sampled_tokens_follow_the_target(draft_kind):
    """Chi-square over many draws (fixed seeds): with a draft far from the target, the first emitted
    token follows p_0 and, when the first draft token was accepted, the second follows p_1."""
    vocab, k, trials = 6, 2, 6000
    g = torch.Generator().manual_seed(1)
    target = torch.softmax(torch.randn(k + 1, vocab, generator=g) * 1.5, dim=-1)  # [k + 1, vocab]
    if draft_kind == "bad_draft_model":
        q = torch.softmax(-4 * target.log()[:k], dim=-1)  # mass where the target has little
        draft_probs = q
    else:
        draft_probs = None
    accept_u, resid_u = _draws(trials, k, seed=12345)
    first, second = np.zeros(vocab), np.zeros(vocab)
    rng = np.random.default_rng(7)
    for t in range(trials):
        if draft_probs is not None:
            d = [int(rng.choice(vocab, p=draft_probs[i].double().numpy() / draft_probs[i].double().sum().item())) for i in range(k)]
        elif draft_kind == "ngram_wrong":
            d = [int(target[i].argmin()) for i in range(k)]  # always the target's least likely token
        else:
            d = [int(target[i].argmax()) for i in range(k)]
        out = rejection_sample(target, d, draft_probs, accept_u[t], resid_u[t])
        assert 1 <= len(out) <= k + 1
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    for counts, p in ((first, target[0]), (second, target[1])):
        expected = p.double().numpy() / p.double().sum().item() * counts.sum()
        assert chisquare(counts, expected).pvalue > 1e-3, (counts, expected)


def test_streams_do_not_collide_with_the_ordinary_draw():
    from pagedgen.sample.sampler import counter_uniforms
    ordinary = counter_uniforms([42] * 4, [3] * 4, [10, 11, 12, 13])
    assert not torch.equal(spec_uniforms(42, 3, 10, 4, ACCEPT_STREAM), ordinary)
    assert not torch.equal(spec_uniforms(42, 3, 10, 4, RESIDUAL_STREAM), ordinary)
    assert torch.equal(spec_uniforms(42, 3, 10, 4, ACCEPT_STREAM), spec_uniforms(42, 3, 10, 4, ACCEPT_STREAM))


# ----- n-gram speculation in the engine: outputs equal speculation off ------------------------------
from conftest import story_openings  # noqa: E402

from pagedgen import SamplingParams  # noqa: E402


def _spec(k, lo=1, hi=3, batch=None):
    cfg = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lo, "prompt_lookup_max": hi}
    if batch is not None:
        cfg["disable_by_batch_size"] = batch
    return cfg


def _run(prompts, params, **kw):
    llm = LLM(MODEL, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    bm = llm.llm_engine.block_manager
    assert bm.num_used_blocks == 0 or bm.enable_prefix_caching, "blocks left held after the call"
    assert not bm.check(), bm.check()
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs], llm.get_stats()


@pytest.fixture(scope="module")
def prompts64(stories_path):
    return story_openings(64)


@pytest.mark.parametrize("dtype, k, num_prompts, kw", [
    ("float32", 3, 64, dict(block_size=4, enable_prefix_caching=True)),
    ("bfloat16", 8, 64, dict(block_size=4)),
    ("float32", 1, 16, dict(block_size=16)),
    ("float32", 8, 16, dict(block_size=4, enable_prefix_caching=False, max_num_batched_tokens=64)),  # chunked prefill
])
def test_greedy_identity_64_prompts(prompts64, dtype, k, num_prompts, kw):
    params = SamplingParams(temperature=0, max_tokens=32)
    base = dict(dtype=dtype, num_kv_blocks=1024, **kw)
    ref, _ = _run(prompts64[:num_prompts], params, **base)
    got, stats = _run(prompts64[:num_prompts], params, speculative_config=_spec(k), **base)
    assert got == ref
    assert stats.num_draft_tokens > 0 and 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    assert 1 <= len(stats.acceptance_rate_per_position) <= k


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_identity_under_preemption_tiny_cache(prompts64, mode):
    """A cache too small for the batch: sequences are preempted while they hold lookahead slots."""
    params = SamplingParams(temperature=0, max_tokens=24)
    base = dict(num_kv_blocks=24, block_size=4, max_model_len=96, preemption_mode=mode)
    ref, ref_stats = _run(prompts64[:6], params, **base)
    got, stats = _run(prompts64[:6], params, speculative_config=_spec(4), **base)
    assert got == ref
    assert stats.num_preemptions > 0 and stats.num_accepted_tokens > 0


def test_seeded_sampling_n_penalties_logprobs_stops_identity(prompts64):
    """Seeded sampling, n > 1 (copy-on-write of the shared prompt), penalties, min_tokens,
    logprobs, a stop string met inside accepted tokens and max_tokens ending mid-proposal: the same
    tokens, text, logprobs and finish reasons as speculation off."""
    cases = [
        SamplingParams(temperature=0.8, seed=11, n=3, max_tokens=37),
        SamplingParams(temperature=0, max_tokens=29, stop=[" the"], min_tokens=3),
        SamplingParams(temperature=1.0, seed=5, presence_penalty=0.5, repetition_penalty=1.2, logprobs=2, max_tokens=33),
        SamplingParams(temperature=0, max_tokens=7),
    ]
    prompts = prompts64[:12]
    params = [cases[i % len(cases)] for i in range(len(prompts))]
    base = dict(num_kv_blocks=512, block_size=4)
    llm_ref, llm_spec = LLM(MODEL, **base), LLM(MODEL, speculative_config=_spec(5), **base)
    ref = llm_ref.generate(prompts, params, use_tqdm=False)
    got = llm_spec.generate(prompts, params, use_tqdm=False)
    for r, g in zip(ref, got):
        for rc, gc in zip(r.outputs, g.outputs):
            assert (gc.token_ids, gc.text, gc.finish_reason, gc.stop_reason) == (rc.token_ids, rc.text, rc.finish_reason, rc.stop_reason)
            assert gc.cumulative_logprob == rc.cumulative_logprob
            assert gc.logprobs == rc.logprobs
    assert llm_spec.get_stats().num_accepted_tokens > 0
    assert any(c.stop_reason == " the" for r in got for c in r.outputs)


def test_disable_by_batch_size_and_beams(prompts64):
    params = SamplingParams(temperature=0, max_tokens=20)
    got, stats = _run(prompts64[:8], params, num_kv_blocks=256, speculative_config=_spec(3, batch=8))
    ref, _ = _run(prompts64[:8], params, num_kv_blocks=256)
    assert got == ref and stats.num_draft_tokens == 0  # 8 running >= 8: no proposals
    from pagedgen import BeamSearchParams
    llm = LLM(MODEL, num_kv_blocks=256, speculative_config=_spec(3))
    beams = llm.beam_search([{"prompt": prompts64[0]}], BeamSearchParams(beam_width=2, max_tokens=10))
    ref_beams = LLM(MODEL, num_kv_blocks=256).beam_search([{"prompt": prompts64[0]}], BeamSearchParams(beam_width=2, max_tokens=10))
    assert [s.tokens for s in beams[0].sequences] == [s.tokens for s in ref_beams[0].sequences]  # beams do not speculate


def test_mp_executor_refused():
    with pytest.raises(ValueError, match="distributed_executor_backend=None"):
        LLM(MODEL, distributed_executor_backend="pickle", speculative_config=_spec(2))


def test_lookahead_slots_roll_back_and_never_enter_the_prefix_cache():
    from pagedgen.core.block_manager import BlockManager
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    bm.allocate(0, 6, list(range(6)))  # 2 blocks, the first full and named
    assert len(bm._prefix_cache) == 1
    bm.allocate(0, 14)  # 8 lookahead slots, no token ids: blocks 2 and 3, nothing named
    assert len(bm.block_table(0)) == 4 and len(bm._prefix_cache) == 1
    bm.truncate(0, 7)  # one draft accepted: blocks 2 and 3 emptied and freed
    assert len(bm.block_table(0)) == 2 and bm.num_free_blocks == 14 and bm.num_tokens(0) == 7
    assert not bm.check(), bm.check()
    bm.allocate(0, 9, list(range(9)))  # the next step's committed tokens name block 1
    assert len(bm._prefix_cache) == 2 and not bm.check()
    bm.free(0)
    assert bm.num_free_blocks == 16 and not bm.check()
