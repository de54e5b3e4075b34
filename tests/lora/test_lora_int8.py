"""LoRA over int8 W8A8 base weights (``quantization="int8"``, vLLM serves adapters on quantized
models too): the adapters' A and B stay in the model dtype (float), the delta is added to the int8
GEMM's output. Base-model rows equal the int8 model without LoRA bit for bit; adapter rows follow
the float model with the same adapter (the int8 base only moves a few greedy tokens) and differ
from the int8 base model. The same holds over FP8 W8A16 base weights (``quantization="fp8"``)."""
import pytest

import lora_adapters as la
from conftest import story_openings
from pagedgen import LLM, LoRARequest, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def adapter(stories_path, tmp_path_factory, one_torch_thread):
    folder = la.make_adapter(stories_path, str(tmp_path_factory.mktemp("lora_int8") / "all"), r=8, seed=7, std=0.05,
                             targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    return LoRARequest("all", 1, folder)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_lora_on_quantized_weights(stories_path, adapter, quantization):
    prompts = story_openings(16, seed=46)
    loras = [adapter if i % 2 else None for i in range(len(prompts))]
    int8 = LLM(stories_path, quantization=quantization, enable_lora=True)
    mixed = _tokens(int8.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False))
    plain_int8 = _tokens(LLM(stories_path, quantization=quantization).generate(prompts, GREEDY, use_tqdm=False))
    with_float = _tokens(LLM(stories_path, enable_lora=True).generate(prompts, GREEDY, lora_request=loras, use_tqdm=False))
    assert int8.get_stats().quantization == quantization
    layer = int8.model.model.layers[0].mlp.down_proj
    a = [t for t in layer.lora.a if t is not None]
    assert a and a[0].dtype.is_floating_point and a[0].element_size() > 1  # A and B stay float
    for i in range(0, len(prompts), 2):  # the base model's rows: the int8 model's bits
        assert mixed[i] == plain_int8[i], i
    odd = range(1, len(prompts), 2)
    assert sum(mixed[i] != plain_int8[i] for i in odd) >= 6  # the adapter acts
    agree = sum(a == b for i in odd for a, b in zip(mixed[i], with_float[i]))
    # quantized base + adapter ~ float base + adapter (measured 93 and 80 of 96 tokens): e4m3's 4 significant bits are a
    # coarser quantization of stories260K than int8 per channel (without the adapter, 93 and 63 of these 96 follow float)
    assert agree >= (0.85 if quantization == "int8" else 0.7) * 12 * len(odd), agree
