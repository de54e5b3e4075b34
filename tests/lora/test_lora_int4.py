"""LoRA over int4 W4A16 base weights (an AWQ checkpoint of stories260K, tests/support/int4_checkpoints.py):
the adapters' A and B stay float, each row's delta is added to the int4 GEMM's output. Base-model rows
equal the int4 model without LoRA bit for bit; adapter rows differ from them."""
import int4_checkpoints as ic
import lora_adapters as la
from conftest import story_openings
from pagedgen import LLM, LoRARequest, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_lora_on_int4_weights(stories_path, hf_model, tmp_path, one_torch_thread):
    ckpt = str(tmp_path / "awq")
    ic.write_int4(hf_model, stories_path, ckpt, "awq", 32)
    adapter = LoRARequest("all", 1, la.make_adapter(stories_path, str(tmp_path / "lora"), r=8, seed=7, std=0.05,
                                                    targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")))
    prompts = story_openings(16, seed=46)
    loras = [adapter if i % 2 else None for i in range(len(prompts))]
    int4 = LLM(ckpt, enable_lora=True)
    mixed = [o.outputs[0].token_ids for o in int4.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)]
    plain = [o.outputs[0].token_ids for o in LLM(ckpt).generate(prompts, GREEDY, use_tqdm=False)]
    layer = int4.model.model.layers[0].mlp.down_proj
    assert layer.int4_group == 32
    a = [t for t in layer.lora.a if t is not None]
    assert a and a[0].dtype.is_floating_point and a[0].element_size() > 1  # A and B stay float
    for i in range(0, len(prompts), 2):  # the base model's rows: the int4 model's bits
        assert mixed[i] == plain[i], i
    assert sum(mixed[i] != plain[i] for i in range(1, len(prompts), 2)) >= 6  # the adapter acts
