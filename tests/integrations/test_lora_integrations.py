"""LoRA through the integrations: lm_eval's ``lora_local_path`` (the vllm backend's model_arg) scores
and generates with the adapter (loglikelihoods within 1e-4 of transformers with the merged PEFT
adapter, greedy text equal to ``LLM.generate`` with the same ``LoRARequest``), and Ray's
``LLMPredictor(lora_request=...)`` runs every row with it; a bad adapter is refused at start."""
import numpy as np
import pytest
import torch

import lora_adapters as la
from pagedgen import LLM, LoRARequest, SamplingParams

CONTEXTS = ["Once upon a time there was a", "The little dog ran to the", "Lily and Tom went to the"]
CONTINUATIONS = [" little girl", " park and played", " store"]


@pytest.fixture(scope="module")
def adapter(stories_path, tmp_path_factory, one_torch_thread):
    return la.make_adapter(stories_path, str(tmp_path_factory.mktemp("lora") / "a"), r=32, alpha=16, seed=21, std=0.05,
                           targets=("q_proj", "v_proj", "up_proj"))


def test_lm_eval_lora_local_path(stories_path, adapter):
    pytest.importorskip("lm_eval", reason="lm_eval is not installed")
    from lm_eval.api.instance import Instance
    from transformers import AutoTokenizer

    from pagedgen.integrations.lm_eval import PagedGenLM

    lm = PagedGenLM(pretrained=stories_path, dtype="float32", max_length=128, device="cpu", lora_local_path=adapter)
    assert lm.llm.processor.loras.config.max_lora_rank == 32  # raised to the adapter's rank
    reqs = [Instance("loglikelihood", {}, (c, x), i) for i, (c, x) in enumerate(zip(CONTEXTS, CONTINUATIONS))]
    got = lm.loglikelihood(reqs, disable_tqdm=True)
    tok, merged = AutoTokenizer.from_pretrained(stories_path), la.merged_model(stories_path, adapter)
    base = la.merged_model(stories_path, None)
    for (ll, _), c, x in zip(got, CONTEXTS, CONTINUATIONS):
        ctx, whole = tok(c)["input_ids"], tok(c + x)["input_ids"]
        with torch.no_grad():
            lp = [torch.log_softmax(m(torch.tensor([whole])).logits[0].float(), -1) for m in (merged, base)]
        want = [sum(float(p[j - 1, whole[j]]) for j in range(len(ctx), len(whole))) for p in lp]
        assert abs(ll - want[0]) < 1e-4 and abs(ll - want[1]) > 1e-3
    gen = lm.generate_until([Instance("generate_until", {}, (c, {"until": ["\n"], "max_gen_toks": 8, "do_sample": False}), i)
                             for i, c in enumerate(CONTEXTS)], disable_tqdm=True)
    llm = LLM(stories_path, enable_lora=True, max_lora_rank=32)
    want = llm.generate(CONTEXTS, SamplingParams(temperature=0, max_tokens=8, stop=["\n"]), lora_request=LoRARequest("a", 1, adapter), use_tqdm=False)
    assert [g.strip() for g in gen] == [o.outputs[0].text.strip() for o in want]  # (lm_eval strips the leading space)
    with pytest.raises(ValueError, match="model_args lora_local_path lora_request 'lora_local_path'.*folder not found"):
        PagedGenLM(pretrained=LLM(stories_path, enable_lora=True), lora_local_path=adapter + "-missing")


def test_ray_predictor_lora_request(stories_path, adapter):
    pytest.importorskip("ray", reason="ray is not installed")
    from pagedgen.integrations.ray import LLMPredictor

    lora = dict(lora_name="a", lora_int_id=1, lora_path=adapter)
    predictor = LLMPredictor(stories_path, dict(temperature=0, max_tokens=8), lora_request=lora, max_lora_rank=32)
    out = predictor({"prompt": np.array(CONTEXTS, dtype=object)})
    llm = LLM(stories_path, enable_lora=True, max_lora_rank=32)
    want = llm.generate(CONTEXTS, SamplingParams(temperature=0, max_tokens=8), lora_request=LoRARequest(**lora), use_tqdm=False)
    assert list(out["generated_text"]) == [o.outputs[0].text for o in want]
    with pytest.raises(ValueError, match="rank r=32 is over max_lora_rank=16"):
        LLMPredictor(stories_path, lora_request=lora)
