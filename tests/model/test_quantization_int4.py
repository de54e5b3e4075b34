"""int4 W4A16 checkpoints (issue 46), end to end on stories260K and the tiny families:

- GPTQ (v1 and v2 zero points, symmetric and not), AWQ (gemm) and compressed-tensors
  ``pack-quantized`` (group and channel, symmetric and not) checkpoints written from stories260K in
  each format's documented layout (tests/support/int4_checkpoints.py), detected from config.json;
  greedy requests (fp32 activations) follow transformers' model holding the real (fake-quantized)
  weights: every token its argmax for >= 99% of 64 requests, logprobs within 1e-2;
- the layers hold 4-bit codes (half a byte a weight) with per-group scales and zeros: the linear
  layers' resident bytes <= 35% of bf16's; the lm_head stays float;
- batch invariance bit for bit; perplexity on held-out TinyStories within 5% of float;
- (every family of the registry: tests/model/test_quantization_int4_families.py);
- bad input (act-order, other bits, group sizes or versions, input activations, a method that is not
  the checkpoint's, a missing / misshapen / mistyped tensor, a g_idx that is not k // g, a
  weight_shape that is not the layer's, a scale that is not finite) is a ValueError naming the field
  or the tensor before any weight is used;
- ``get_stats().quantization``, the CLI flag and the closing summary.
"""
import json
import math
import os
import shutil

import pytest
import torch

import int4_checkpoints as ic
from conftest import TINYSTORIES, story_openings
from pagedgen import LLM, SamplingParams

KW = dict(dtype="float32", num_kv_blocks=256, max_num_seqs=64)
GREEDY = SamplingParams(temperature=0, max_tokens=12, logprobs=0)
#: (format, group size, symmetric, GPTQ checkpoint format) of the stories260K checkpoints; the first is
#: quantized by GPTQ on calibration stories, the others by round-to-nearest (faster to write)
VARIANTS = {
    "awq-g32": ("awq", 32, False, "gptq"),
    "gptq-g32-sym": ("gptq", 32, True, "gptq"),
    "gptq-g64-asym-v2": ("gptq", 64, False, "gptq_v2"),
    "pack-quantized-channel-asym": ("pack-quantized", -1, False, "gptq"),
    "pack-quantized-g128-sym": ("pack-quantized", 128, True, "gptq"),  # 128 > K = 64 or 172: one partial group
}


@pytest.fixture(scope="module")
def prompts():
    return story_openings(64, seed=46)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, hf_model, hf_tokenizer, stories_path):
    """name -> (folder, {module: real weight}). Calibration: TinyStories validation stories 100-199
    (the perplexity test reads stories 0-31)."""
    with open(TINYSTORIES) as f:
        stories = [json.loads(line)["text"] for _, line in zip(range(200), f)][100:]
    calibration = [torch.tensor(hf_tokenizer(" ".join(t.split()[:150]))["input_ids"]) for t in stories]
    out = {}
    for i, (name, (fmt, group, sym, gptq_format)) in enumerate(VARIANTS.items()):
        dst = str(tmp_path_factory.mktemp(name))
        out[name] = dst, ic.write_int4(hf_model, stories_path, dst, fmt, group, sym, gptq_format, calibration if i == 0 else None)
    return out


@pytest.fixture(scope="module")
def awq(ckpts):
    return LLM(ckpts["awq-g32"][0], **KW)


@pytest.fixture(scope="module")
def awq_outs(awq, prompts):
    return awq.generate(prompts, GREEDY, use_tqdm=False)


def _oracle(stories_path, real):
    from transformers import AutoModelForCausalLM

    return ic.fake_quantize(AutoModelForCausalLM.from_pretrained(stories_path, dtype=torch.float32), real)


def _oracle_logprobs(oracle, outs) -> list:
    """Teacher-forced log-probabilities [completion tokens, vocab] of each output (right-padded, causal)."""
    seqs = [o.prompt_token_ids + list(o.outputs[0].token_ids) for o in outs]
    ids = torch.tensor([s + [0] * (max(map(len, seqs)) - len(s)) for s in seqs])
    with torch.no_grad():
        logp = torch.log_softmax(oracle(ids).logits.double(), -1)
    return [logp[i, len(o.prompt_token_ids) - 1:len(seqs[i]) - 1] for i, o in enumerate(outs)]


def _check_against_oracle(outs, oracle, exact_share=0.99):
    exact, worst = 0, 0.0
    for o, logp in zip(outs, _oracle_logprobs(oracle, outs)):
        c = o.outputs[0]
        exact += logp.argmax(-1).tolist() == list(c.token_ids)
        worst = max(worst, max(abs(c.logprobs[pos][t].logprob - float(logp[pos, t])) for pos, t in enumerate(c.token_ids)))
    assert exact >= exact_share * len(outs), f"{exact}/{len(outs)} requests follow the fake-quantized oracle"
    assert worst < 1e-2, worst


def test_awq_follows_the_fake_quantized_oracle(awq_outs, ckpts, stories_path):
    _check_against_oracle(awq_outs, _oracle(stories_path, ckpts["awq-g32"][1]))


@pytest.mark.parametrize("name", [n for n in VARIANTS if n != "awq-g32"])
def test_every_format_follows_its_oracle(name, ckpts, stories_path, prompts):
    folder, real = ckpts[name]
    llm = LLM(folder, **KW)
    assert llm.get_stats().quantization == {"gptq": "gptq", "awq": "awq"}.get(VARIANTS[name][0], "compressed-tensors")
    _check_against_oracle(llm.generate(prompts[:16], GREEDY, use_tqdm=False), _oracle(stories_path, real))


def test_layers_hold_4bit_codes_and_the_head_stays_float(awq):
    layer = awq.model.model.layers[0]
    down, qkv = layer.mlp.down_proj, layer.self_attn.qkv_proj
    assert down.weight.dtype == torch.uint8 and tuple(down.weight.shape) == (4, 172, 8)  # 64 outputs, K = 172
    assert tuple(down.weight_scale.shape) == (4, 6, 16) and down.weight_scale.dtype == torch.float32  # ceil(172 / 32) groups
    assert tuple(qkv.weight.shape) == (8, 64, 8) and qkv.int4_group == 32  # q 64 + k 32 + v 32 outputs
    assert not hasattr(down, "qweight") and not hasattr(down, "qzeros")  # the load-time tensors are freed
    head = awq.model.lm_head
    assert head.weight.is_floating_point()
    int4, bf16 = 0, 0
    for m in awq.model.modules():
        if getattr(m, "int4_group", 0):
            int4 += sum(t.numel() * t.element_size() for t in (m.weight, m.weight_scale, m.weight_zero))
            bf16 += 2 * m.output_size * m.input_size
    assert int4 <= 0.35 * bf16, int4 / bf16  # 0.5 + 5 / 32 bytes a weight at group 32, and the panels' padding


def test_batch_invariance_bit_for_bit(awq, awq_outs, prompts):
    for i in (0, 17, 63):
        alone = awq.generate([prompts[i]], GREEDY, use_tqdm=False)[0].outputs[0]
        batched = awq_outs[i].outputs[0]
        assert alone.token_ids == batched.token_ids
        assert [d[t].logprob for d, t in zip(alone.logprobs, alone.token_ids)] == \
               [d[t].logprob for d, t in zip(batched.logprobs, batched.token_ids)]


def test_perplexity_on_held_out_tinystories_within_5_percent_of_float(awq, llm):
    """Issue 46's accuracy target for int4: stories260K's perplexity on 32 TinyStories validation
    stories within 5% of the float model's (asymmetric, group 32, GPTQ-quantized layer after layer
    on 100 other stories: +4.6%; round-to-nearest gives +7.9%, a 64-wide model is sensitive)."""
    with open(TINYSTORIES) as f:
        texts = [" ".join(json.loads(line)["text"].split()[:150]) for _, line in zip(range(32), f)]
    sp = SamplingParams(max_tokens=1, prompt_logprobs=0)

    def perplexity(model):
        total, count = 0.0, 0
        for o in model.generate(texts, sp, use_tqdm=False):
            for tok, lp in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:]):
                total, count = total + lp[tok].logprob, count + 1
        return math.exp(-total / count)

    float_ppl, int4_ppl = perplexity(llm), perplexity(awq)
    assert int4_ppl <= 1.05 * float_ppl, (int4_ppl, float_ppl)


def _edit_config(folder: str, edit) -> None:
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    edit(config["quantization_config"])
    with open(path, "w") as f:
        json.dump(config, f)


def _weights(c: dict) -> dict:
    return c["config_groups"]["group_0"]["weights"]


@pytest.mark.parametrize("name, edit, match", [
    ("gptq-g32-sym", lambda c: c.update(desc_act=True), r"quantization_config.desc_act=True \(act-order GPTQ\) is not supported"),
    ("gptq-g32-sym", lambda c: c.update(bits=8), r"quantization_config.bits=8 is not supported \(allowed: \[4\]\)"),
    ("gptq-g32-sym", lambda c: c.update(group_size=16), r"quantization_config.group_size=16 is not supported \(allowed: \[32, 64, 128, -1\]"),
    ("gptq-g32-sym", lambda c: c.update(checkpoint_format="marlin"), r"checkpoint_format='marlin' is not supported"),
    ("gptq-g32-sym", lambda c: c.update(lm_head=True), r"lm_head=True is not supported"),
    ("awq-g32", lambda c: c.update(version="gemv"), r"quantization_config.version='gemv' is not supported \(allowed: \['gemm'\]\)"),
    ("awq-g32", lambda c: c.update(zero_point=False), r"zero_point=False is not supported"),
    ("pack-quantized-g128-sym", lambda c: _weights(c).update(actorder="group"), r"weights.actorder='group' \(act-order\) is not supported"),
    ("pack-quantized-g128-sym", lambda c: _weights(c).update(num_bits=8), r"weights.num_bits=8 is not supported"),
    ("pack-quantized-g128-sym", lambda c: _weights(c).update(strategy="tensor"), r"weights.strategy='tensor' is not supported"),
    ("pack-quantized-g128-sym", lambda c: c["config_groups"]["group_0"].update(input_activations={"num_bits": 8}),
     r"input_activations is set: pack-quantized runs as W4A16"),
])
def test_unsupported_configs_are_refused_naming_the_field(ckpts, tmp_path, name, edit, match):
    shutil.copytree(ckpts[name][0], tmp_path / "ckpt")
    _edit_config(str(tmp_path / "ckpt"), edit)
    with pytest.raises(ValueError, match=match):
        LLM(str(tmp_path / "ckpt"), **KW)


def test_a_method_that_is_not_the_checkpoints_is_refused(ckpts):
    with pytest.raises(ValueError, match=r"quantization='awq' does not fit the checkpoint.*quant_method='gptq'"):
        LLM(ckpts["gptq-g32-sym"][0], quantization="awq", **KW)
    with pytest.raises(ValueError, match=r"quantization='int8' does not fit the checkpoint"):
        LLM(ckpts["awq-g32"][0], quantization="int8", **KW)


def _rewrite(folder: str, change) -> None:
    from safetensors.torch import load_file, save_file

    path = os.path.join(folder, "model.safetensors")
    state = load_file(path)
    change(state)
    save_file(state, path, metadata={"format": "pt"})


L0 = "model.layers.0."


@pytest.mark.parametrize("name, change, match", [
    ("gptq-g32-sym", lambda s: s.pop(L0 + "mlp.up_proj.qzeros"), r"weight 'model.layers.0.mlp.up_proj.qzeros' is missing"),
    ("gptq-g32-sym", lambda s: s.__setitem__(L0 + "self_attn.k_proj.scales", torch.ones(2, 31).half()),
     r"k_proj.scales' has shape \(2, 31\), but config.json implies \(2, 32\)"),
    ("gptq-g32-sym", lambda s: s.__setitem__(L0 + "mlp.down_proj.qweight", s[L0 + "mlp.down_proj.qweight"].float()),
     r"down_proj.qweight' has dtype F32, but .* makes it one of \['I32'\]"),
    ("gptq-g32-sym", lambda s: s.__setitem__(L0 + "mlp.gate_proj.g_idx", torch.arange(64, dtype=torch.int32).flip(0) // 32),
     r"model.layers.0.mlp.gate_up_proj: g_idx is not k // group_size"),
    ("awq-g32", lambda s: s.__setitem__(L0 + "self_attn.o_proj.scales", s[L0 + "self_attn.o_proj.scales"] * float("nan")),
     r"o_proj: a scale of the checkpoint is not finite"),
    ("pack-quantized-channel-asym", lambda s: s.__setitem__(L0 + "mlp.up_proj.weight_shape", torch.tensor([172, 65], dtype=torch.int32)),
     r"weight_shape is \[172, 65\], but config.json implies \[172, 64\]"),
    ("pack-quantized-channel-asym", lambda s: s.pop(L0 + "mlp.up_proj.weight_zero_point"), r"up_proj.weight_zero_point' is missing"),
])
def test_missing_misshapen_or_bad_tensors_are_refused(ckpts, tmp_path, name, change, match):
    shutil.copytree(ckpts[name][0], tmp_path / "ckpt")
    _rewrite(str(tmp_path / "ckpt"), change)
    with pytest.raises(ValueError, match=match):
        LLM(str(tmp_path / "ckpt"), **KW)


def test_the_cli_flag_and_the_summary(awq, awq_outs):
    import argparse

    from pagedgen.cli.progress import RunStats, summary
    from pagedgen.engine_args import EngineArgs

    args = EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(["--model", "m", "--quantization", "awq"])
    assert EngineArgs.from_cli_args(args).quantization == "awq"
    stats = awq.get_stats()
    assert stats.quantization == "awq" and "quantization='awq'" in repr(stats)
    assert "int4 AWQ W4A16 weights (quantization='awq')" in summary(RunStats(generated=64, output_tokens=768), stats, "out.jsonl", None)
