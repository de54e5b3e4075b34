"""End-to-end oracle: greedy output on stories260K is token-identical to transformers' generate.

One transformers reference (per prompt, no padding) serves four pagedgen configurations, each a
single ``generate`` call over all prompts: defaults, a KV cache small enough to force preemption,
one sequence at a time, and a token budget small enough to prefill prompts in chunks.
"""
import random

import pytest
import torch

from conftest import story_openings
from pagedgen import LLM, SamplingParams

NUM_PROMPTS = 32


@pytest.fixture(scope="module")
def workload(hf_model, hf_tokenizer):
    prompts = story_openings(NUM_PROMPTS, seed=0)
    rng = random.Random(1)
    max_tokens = [rng.randint(1, 200) for _ in prompts]
    max_tokens[0] = 200
    reference = []
    with torch.inference_mode():
        for p, m in zip(prompts, max_tokens):
            ids = hf_tokenizer(p, return_tensors="pt").input_ids
            out = hf_model.generate(ids, do_sample=False, max_new_tokens=m, pad_token_id=0)
            reference.append(out[0, ids.shape[1] :].tolist())
    return prompts, max_tokens, reference


def _run(stories_path, workload, **llm_kwargs):
    prompts, max_tokens, reference = workload
    llm = LLM(stories_path, **llm_kwargs)
    params = [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outputs]
    mismatched = [i for i in range(len(prompts)) if got[i] != reference[i]]
    assert not mismatched, f"prompts {mismatched} differ from transformers, first: {got[mismatched[0]]} vs {reference[mismatched[0]]}"
    for o, m, ref in zip(outputs, max_tokens, reference):
        reason = "stop" if ref and ref[-1] == 2 and len(ref) <= m else "length"
        assert o.outputs[0].finish_reason == reason
    return llm


def test_greedy_matches_transformers(stories_path, workload):
    llm = _run(stories_path, workload)
    assert llm.get_stats().num_preemptions == 0


def test_greedy_matches_transformers_with_preemption(stories_path, workload):
    llm = _run(stories_path, workload, num_kv_blocks=40)  # 640 token slots for 32 sequences
    stats = llm.get_stats()
    assert stats.num_preemptions > 0
    assert stats.num_free_blocks == stats.num_kv_blocks  # everything returned


def test_greedy_matches_transformers_one_seq_at_a_time(stories_path, workload):
    llm = _run(stories_path, workload, max_num_seqs=1)
    assert llm.get_stats().num_steps >= sum(workload[1])  # at least one step per generated token


def test_greedy_matches_transformers_chunked_prefill(stories_path, workload, hf_tokenizer):
    budget = 12
    longest = max(len(hf_tokenizer(p).input_ids) for p in workload[0])
    assert longest > budget, "the workload must contain prompts longer than the token budget"
    _run(stories_path, workload, max_num_batched_tokens=budget)
