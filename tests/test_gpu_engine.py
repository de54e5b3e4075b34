"""The engine on a GPU: greedy output on stories260K (fp32) token-identical to transformers, with
CUDA graphs and eagerly. Skipped without a CUDA GPU."""
import random

import pytest
import torch

from conftest import story_openings
from pagedgen import LLM, SamplingParams

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]


@pytest.fixture(scope="module")
def workload(hf_model, hf_tokenizer):
    prompts = story_openings(16, seed=2)
    rng = random.Random(3)
    max_tokens = [rng.randint(1, 120) for _ in prompts]
    model = hf_model.to("cuda")
    reference = []
    with torch.inference_mode():
        for p, m in zip(prompts, max_tokens):
            ids = hf_tokenizer(p, return_tensors="pt").input_ids.to("cuda")
            out = model.generate(ids, do_sample=False, max_new_tokens=m, pad_token_id=0)
            reference.append(out[0, ids.shape[1] :].tolist())
    hf_model.to("cpu")
    return prompts, max_tokens, reference


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_gpu_greedy_matches_transformers(stories_path, workload, enforce_eager):
    prompts, max_tokens, reference = workload
    llm = LLM(stories_path, device="cuda", enforce_eager=enforce_eager, enforce_extension=True)
    assert llm.device.type == "cuda" and llm.engine.model_runner.kv_caches[0][0].is_cuda
    assert (llm.engine.model_runner.graphs is not None) == (not enforce_eager)
    outputs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference


def test_gpu_preemption_swap_and_sharing(stories_path, workload):
    prompts, _, _ = workload
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in LLM(stories_path, device="cpu").generate(prompts, params, use_tqdm=False)]
    llm = LLM(stories_path, device="cuda", num_kv_blocks=34, preemption_mode="swap")
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == reference
    assert llm.get_stats().num_swaps_out > 0
    four = llm.generate(prompts[:4], SamplingParams(n=4, temperature=0, max_tokens=32), use_tqdm=False)
    assert all(c.token_ids == reference[i][:32] for i, o in enumerate(four) for c in o.outputs)
