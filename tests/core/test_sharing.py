"""Parallel sampling (n) and beam search share KV blocks by forking block tables (copy-on-write)
and give the same results as without sharing: n=4 seeded completions are reproducible whatever
shares the batch, greedy n=4 equals greedy, beam search equals transformers' beam search."""
import pytest
import torch

from conftest import story_openings
from pagedgen import LLM, BeamSearchParams, SamplingParams


@pytest.fixture(scope="module")
def prompts():
    return story_openings(8, seed=5)


def _texts(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def test_parallel_sampling_is_seeded_and_shares_blocks(llm, prompts):
    params = SamplingParams(n=4, seed=7, temperature=1.0, max_tokens=24)
    alone = llm.generate(prompts[:1], params, use_tqdm=False)
    copies_before = llm.get_stats().num_copy_on_write
    crowd = [SamplingParams(temperature=1.0, max_tokens=30)] * 5 + [params] + [SamplingParams(n=3, temperature=0.5, max_tokens=10)] * 2
    mixed = llm.generate(prompts[1:6] + prompts[:1] + prompts[6:8], crowd, use_tqdm=False)
    assert _texts(alone)[0] == _texts(mixed)[5], "a seeded n=4 request changed with its batch"
    assert [c.index for c in alone[0].outputs] == [0, 1, 2, 3]
    assert len({tuple(t) for t in _texts(alone)[0]}) > 1, "four samples at temperature 1 should differ"
    stats = llm.get_stats()
    assert stats.num_copy_on_write > copies_before  # forked samples wrote their shared last block
    assert stats.peak_sharing_savings > 0.0


def test_parallel_sampling_greedy_equals_greedy(llm, prompts):
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    four = llm.generate(prompts, SamplingParams(n=4, temperature=0, max_tokens=40), use_tqdm=False)
    for g, f in zip(greedy, four):
        assert len(f.outputs) == 4
        assert all(c.token_ids == g.outputs[0].token_ids for c in f.outputs)


def test_parallel_sampling_survives_preemption(stories_path, prompts, llm):
    params = SamplingParams(n=3, seed=11, max_tokens=60)
    reference = _texts(llm.generate(prompts, params, use_tqdm=False))
    small = LLM(stories_path, num_kv_blocks=40)
    assert _texts(small.generate(prompts, params, use_tqdm=False)) == reference
    assert small.get_stats().num_preemptions > 0


# stories260K (llama2.c) never emits its EOS token; with "." as EOS, beams end at sentence ends, so
# the finished-hypothesis pool, the length penalty and early stopping all take part.
BEAM_CASES = [(2, 1.0, False, None), (4, 1.0, False, None), (2, 1.0, False, "."), (4, 0.6, True, "."), (4, 1.5, "never", ".")]


@pytest.fixture(scope="module")
def hf_beams(hf_model, hf_tokenizer, prompts):
    """transformers' beam search: {case: [(tokens, score)]}."""
    out = {}
    with torch.inference_mode():
        for width, lp, es, eos in BEAM_CASES:
            eos_id = hf_tokenizer.convert_tokens_to_ids(eos) if eos else hf_model.generation_config.eos_token_id
            rows = []
            for p in prompts:
                ids = hf_tokenizer(p, return_tensors="pt").input_ids
                r = hf_model.generate(
                    ids, num_beams=width, do_sample=False, max_new_tokens=48, length_penalty=lp, early_stopping=es,
                    eos_token_id=eos_id, output_scores=True, return_dict_in_generate=True, pad_token_id=0,
                )
                rows.append((r.sequences[0, ids.shape[1]:].tolist(), float(r.sequences_scores[0])))
            out[(width, lp, es, eos)] = rows
    return out


@pytest.mark.parametrize("width, lp, es, eos", BEAM_CASES)
def test_beam_search_matches_transformers(stories_path, prompts, hf_beams, width, lp, es, eos):
    llm = LLM(stories_path, num_kv_blocks=512)
    if eos:
        llm.eos_token_ids = frozenset([llm.tokenizer.convert_tokens_to_ids(eos)])
    params = BeamSearchParams(beam_width=width, max_tokens=48, length_penalty=lp, early_stopping=es)
    outputs = llm.beam_search(prompts, params, use_tqdm=False)
    for (ref_tokens, ref_score), out in zip(hf_beams[(width, lp, es, eos)], outputs):
        best = out.sequences[0]
        assert best.output_token_ids == ref_tokens
        assert best.score == pytest.approx(ref_score, abs=1e-4)
        assert best.cum_logprob / len(best.output_token_ids) ** lp == pytest.approx(best.score)
        assert len(out.sequences) <= width
        assert [s.score for s in out.sequences] == sorted((s.score for s in out.sequences), reverse=True)
    if eos:
        assert any(o.sequences[0].finish_reason == "stop" for o in outputs), "some best beams should end at EOS"
    assert llm.get_stats().num_used_blocks == 0


def test_beam_search_shares_blocks_and_survives_preemption(stories_path, prompts, llm):
    params = BeamSearchParams(beam_width=4, max_tokens=40)
    reference = [[s.output_token_ids for s in o.sequences] for o in llm.beam_search(prompts, params, use_tqdm=False)]
    small = LLM(stories_path, num_kv_blocks=24, max_model_len=384)  # the cache holds 384 tokens
    got = [[s.output_token_ids for s in o.sequences] for o in small.beam_search(prompts, params, use_tqdm=False)]
    assert got == reference
    stats = small.get_stats()
    assert stats.num_preemptions > 0 and stats.peak_sharing_savings > 0.3
    assert stats.num_used_blocks == 0  # every beam's blocks returned


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(beam_width=0, max_tokens=4), ValueError, "beam_width must be at least 1"),
        (dict(beam_width=2, max_tokens=0), ValueError, "max_tokens must be at least 1"),
        (dict(beam_width=2.0, max_tokens=4), TypeError, "beam_width must be an int"),
        (dict(beam_width=2, max_tokens=4, early_stopping="sometimes"), ValueError, "early_stopping must be"),
    ],
)
def test_bad_beam_search_params(kwargs, error, match):
    with pytest.raises(error, match=match):
        BeamSearchParams(**kwargs)


def test_beam_search_bad_input(llm):
    with pytest.raises(ValueError, match="beam_width must be at most max_num_seqs"):
        llm.beam_search(["a"], BeamSearchParams(beam_width=1000, max_tokens=4))
    with pytest.raises(TypeError, match="params must be a BeamSearchParams"):
        llm.beam_search(["a"], SamplingParams())
    with pytest.raises(ValueError, match=r"prompts\[1\].*max_model_len"):
        llm.beam_search(["a", "word " * 600], BeamSearchParams(beam_width=2, max_tokens=4))
    with pytest.raises(ValueError, match=r"n must be at most max_num_seqs"):
        llm.generate(["a"], SamplingParams(n=1000))
    assert llm.beam_search([], BeamSearchParams(beam_width=2, max_tokens=4)) == []


def test_beam_search_params_reject_nan_and_non_bool_early_stopping():
    with pytest.raises(ValueError, match="length_penalty must be a finite number"):
        BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=float("nan"))
    with pytest.raises(ValueError, match="early_stopping must be True, False or 'never'"):
        BeamSearchParams(beam_width=2, max_tokens=4, early_stopping=1)
