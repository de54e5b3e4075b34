"""FP8 weights, W8A16 (issue 46), end to end on stories260K and the tiny families:

- online ``quantization="fp8"``: float8_e4m3fn weights per output channel, 1 byte each, the lm_head
  float; 64 greedy requests (fp32 activations) follow transformers' model with its linear layers
  fake-quantized (every token its argmax for >= 99%, logprobs within 1e-2), and equal pagedgen's
  float model loading the fake-quantized weights bit for bit where that model runs pagedgen's panel
  GEMM (AVX2 CPUs: the FP8 kernel's sums are the same multiply-adds);
- compressed-tensors ``float-quantized`` checkpoints (per channel: online fp8's bits; per tensor;
  a config asking for dynamic FP8 activations runs W8A16) and vLLM's ``fp8`` format (per tensor, and
  block-wise ``weight_scale_inv`` with ``weight_block_size``), detected from config.json
  (tests/support/fp8_checkpoints.py writes them);
- batch invariance bit for bit; every family of the registry; perplexity within 2% of float;
- bad input (blocks that straddle fused parts or a malformed ``weight_block_size``, static activations, a float tensor where FP8 is
  declared, a missing / misshapen / non-positive scale, fp8 on an int8 checkpoint) is a ValueError
  naming the field before any weight is read or used.
"""
import json
import math
import os
import shutil

import pytest
import torch

import fp8_checkpoints as fc
import tiny_checkpoints
from conftest import TINYSTORIES, story_openings
from pagedgen import LLM, SamplingParams, ops

KW = dict(dtype="float32", num_kv_blocks=256, max_num_seqs=64)
GREEDY = SamplingParams(temperature=0, max_tokens=12, logprobs=0)


@pytest.fixture(scope="module")
def prompts():
    return story_openings(64, seed=46)


@pytest.fixture(scope="module")
def online(stories_path):
    return LLM(stories_path, quantization="fp8", **KW)


@pytest.fixture(scope="module")
def online_outs(online, prompts):
    return online.generate(prompts, GREEDY, use_tqdm=False)


@pytest.fixture(scope="module")
def channel_ckpt(tmp_path_factory, hf_model, stories_path):
    dst = str(tmp_path_factory.mktemp("fp8-channel"))
    fc.write_fp8(stories_path, dst, model=hf_model)
    return dst


def _logprobs(out) -> list:
    c = out.outputs[0]
    return [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]


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
        toks = list(o.outputs[0].token_ids)
        exact += logp.argmax(-1).tolist() == toks
        worst = max(worst, max(abs(a - float(logp[pos, t])) for pos, (t, a) in enumerate(zip(toks, _logprobs(o)))))
    assert exact >= exact_share * len(outs), f"{exact}/{len(outs)} requests follow the fake-quantized oracle"
    assert worst < 1e-2, worst


def test_online_fp8_follows_the_fake_quantized_oracle(online_outs, stories_path):
    from transformers import AutoModelForCausalLM

    oracle = fc.fake_quantize_fp8(AutoModelForCausalLM.from_pretrained(stories_path, dtype="float32").eval())
    _check_against_oracle(online_outs, oracle)


def test_online_fp8_equals_pagedgen_float_on_the_fake_quantized_weights_bitwise(tmp_path, stories_path, online_outs, prompts):
    from transformers import AutoModelForCausalLM

    fake = fc.fake_quantize_fp8(AutoModelForCausalLM.from_pretrained(stories_path, dtype="float32"))
    fake.save_pretrained(str(tmp_path))
    for f in os.listdir(stories_path):
        if f.startswith("tokenizer") or f == "special_tokens_map.json":
            shutil.copy(os.path.join(stories_path, f), tmp_path)
    float_llm = LLM(str(tmp_path), **KW)
    ref = float_llm.generate(prompts, GREEDY, use_tqdm=False)
    # the FP8 kernel's sums are those of pagedgen's float32 panel GEMM; without the kernel FP8 runs the float model's GEMM
    bitwise = float_llm.model.model.layers[0].mlp.down_proj.matmul.panels or not ops.has_kernel("fp8_linear")
    if not bitwise:  # another float GEMM (oneDNN): the same weights, float32 rounding apart
        assert sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(ref, online_outs)) >= 62
        return
    for a, b in zip(ref, online_outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and _logprobs(a) == _logprobs(b)


def test_fp8_layers_hold_one_byte_weights_and_the_head_stays_float(online, llm):
    layer = online.model.model.layers[0]
    for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert lin.weight.dtype == torch.float8_e4m3fn  # packed in panels of 16 outputs for the kernel, where it is built
        assert lin.weight.shape == ((-(-lin.output_size // 16), lin.input_size, 16) if ops.has_kernel("fp8_linear")
                                    else (lin.output_size, lin.input_size))
        assert lin.weight_scale.dtype == torch.float32 and lin.weight_scale.shape == (lin.output_size,)
    assert online.model.lm_head.weight.dtype == torch.float32
    assert online.model_config.quantization == "fp8"

    def linear_bytes(m):
        return sum(p.numel() * p.element_size() for n, p in m.named_parameters() if "layers." in n and "norm" not in n)
    assert linear_bytes(online.model) <= 0.3 * linear_bytes(llm.model)  # 1 byte + scales vs float32


@pytest.mark.parametrize("fmt, strategy, activations", [
    ("compressed-tensors", "channel", False), ("compressed-tensors", "channel", True),
    ("compressed-tensors", "tensor", False), ("fp8", "tensor", False)])
def test_fp8_checkpoints_are_detected_and_follow_their_oracle(fmt, strategy, activations, tmp_path, stories_path, hf_model,
                                                             online_outs, prompts):
    from transformers import AutoModelForCausalLM

    fc.write_fp8(stories_path, str(tmp_path), fmt=fmt, strategy=strategy, activations=activations, model=hf_model)
    llm = LLM(str(tmp_path), **KW)  # quantization=None: config.json's quantization_config
    assert llm.model_config.quantization == fmt
    qkv = llm.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.weight_scale.shape == (128,)
    outs = llm.generate(prompts[:32], GREEDY, use_tqdm=False)
    if strategy == "channel":  # the same quantizer as online fp8: the same bits
        for a, b in zip(outs, online_outs):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids and _logprobs(a) == _logprobs(b)
    else:  # per tensor: each part of the fused q/k/v keeps its own scale
        scales = qkv.weight_scale
        assert len(set(scales[:64].tolist())) == 1 and len(set(scales[64:96].tolist())) == 1
        oracle = fc.fake_quantize_fp8(AutoModelForCausalLM.from_pretrained(stories_path, dtype="float32").eval(), "tensor")
        _check_against_oracle(outs, oracle)


@pytest.mark.parametrize("fmt", ["fp8", "compressed-tensors"])
def test_block_wise_fp8_checkpoint_follows_its_oracle(fmt, tmp_path, stories_path, hf_model, prompts):
    """DeepSeek-V3 / Qwen3-FP8's layout (fp8's ``weight_scale_inv``) and llm-compressor's FP8_BLOCK
    (compressed-tensors ``strategy: block``, with FP8_BLOCK's dynamic per-group activations run as
    W8A16) at a block size stories260K's shapes allow: [4, 8] (the last block column of down_proj's
    172 inputs is partial)."""
    from transformers import AutoModelForCausalLM

    fc.write_fp8(stories_path, str(tmp_path), fmt=fmt, block=(4, 8), activations=True, model=hf_model)
    llm = LLM(str(tmp_path), quantization=fmt, **KW)
    qkv, down = llm.model.model.layers[0].self_attn.qkv_proj, llm.model.model.layers[0].mlp.down_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.weight_scale.shape == (128, 8) and qkv.weight_block_k == 8
    assert down.weight_scale.shape == (64, 22) and not hasattr(down, "weight_scale_inv")
    oracle = fc.fake_quantize_fp8(AutoModelForCausalLM.from_pretrained(stories_path, dtype="float32").eval(), (4, 8))
    _check_against_oracle(llm.generate(prompts[:32], GREEDY, use_tqdm=False), oracle)


def test_batch_invariance_bit_for_bit(online, online_outs, prompts):
    for i in (0, 17, 63):
        alone = online.generate([prompts[i]], GREEDY, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == online_outs[i].outputs[0].token_ids
        assert _logprobs(alone) == _logprobs(online_outs[i])


def test_bf16_activations_run(stories_path, prompts):
    """bf16 activations: the FP8 kernel (float32 weights, bf16 rows and outputs; without the kernel the
    weight dequantized to bf16 and the bf16 GEMM); tokens of a few requests follow the bf16 float model
    for most requests."""
    llm = LLM(stories_path, quantization="fp8", **dict(KW, dtype="bfloat16"))
    assert llm.model.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    outs = llm.generate(prompts[:8], GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    ref = LLM(stories_path, **dict(KW, dtype="bfloat16")).generate(prompts[:8], GREEDY, use_tqdm=False)
    assert sum(a.outputs[0].token_ids[:4] == b.outputs[0].token_ids[:4] for a, b in zip(outs, ref)) >= 6


@pytest.mark.parametrize("family", sorted(tiny_checkpoints.FAMILIES))
def test_every_family_runs_fp8(family, tmp_path):
    src, dst = str(tmp_path / "float"), str(tmp_path / "fp8")
    model = tiny_checkpoints.build(family, src)
    prompts = [[int(t) for t in torch.randint(1, 4096, (n,), generator=torch.Generator().manual_seed(n))] for n in (5, 11, 20)]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    if family != "gpt2":  # GPT-2's Conv1D layers are not nn.Linear: a recipe leaves them float; online fp8 quantizes them
        fc.write_fp8(src, dst, model=model)
    llm = LLM(src if family == "gpt2" else dst, quantization="fp8" if family == "gpt2" else None, dtype="float32",
              num_kv_blocks=32, max_num_seqs=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    quantized = [m for m in llm.model.modules() if getattr(m, "weight_scale", None) is not None]
    assert quantized and all(m.weight.dtype == torch.float8_e4m3fn for m in quantized)
    if family != "gpt2":
        for o, logp in zip(outs, _oracle_logprobs(fc.fake_quantize_fp8(model), outs)):
            assert logp.argmax(-1).tolist() == list(o.outputs[0].token_ids)


def _edit_config(folder: str, edit) -> None:
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    edit(config["quantization_config"])
    with open(path, "w") as f:
        json.dump(config, f)


@pytest.mark.parametrize("fmt, edit, match", [
    ("fp8", lambda c: c.update(weight_block_size=[128, 128]), r"qkv_proj: weight_block_size rows 128 do not divide the fused parts \[64, 32, 32\]"),
    ("fp8", lambda c: c.update(weight_block_size=[128]), r"weight_block_size must be two positive ints"),
    ("fp8", lambda c: c.update(activation_scheme="static"), r"activation_scheme='static' is not supported"),
    ("compressed-tensors", lambda c: c["config_groups"]["group_0"]["weights"].update(type="int"), r"weights.type='int'"),
    ("compressed-tensors", lambda c: c["config_groups"]["group_0"]["weights"].update(strategy="group"), r"weights.strategy='group'"),
    ("compressed-tensors", lambda c: c["config_groups"]["group_0"]["weights"].update(strategy="block"),
     r"weights.block_structure must be two positive ints"),
    ("compressed-tensors", lambda c: c["config_groups"]["group_0"].update(
        input_activations=dict(num_bits=8, type="float", symmetric=True, dynamic=False, strategy="tensor")),
     r"input_activations.strategy='tensor' is not supported"),
])
def test_unsupported_fp8_configs_are_refused_naming_the_field(fmt, edit, match, tmp_path, stories_path, hf_model):
    fc.write_fp8(stories_path, str(tmp_path), fmt=fmt, model=hf_model)
    _edit_config(str(tmp_path), edit)
    with pytest.raises(ValueError, match=match):
        LLM(str(tmp_path), **KW)


def _rewrite(folder: str, change) -> None:
    from safetensors.torch import load_file, save_file

    path = os.path.join(folder, "model.safetensors")
    state = load_file(path)
    change(state)
    save_file(state, path, metadata={"format": "pt"})


@pytest.mark.parametrize("change, match", [
    (lambda s: s.pop("model.layers.2.mlp.up_proj.weight_scale"), r"weight 'model.layers.2.mlp.up_proj.weight_scale' is missing"),
    (lambda s: s.__setitem__("model.layers.1.self_attn.o_proj.weight_scale", torch.ones(64, 2)), r"o_proj.weight_scale' has shape \(64, 2\)"),
    (lambda s: s.__setitem__("model.layers.1.self_attn.k_proj.weight_scale", torch.ones(3)), r"k_proj.weight_scale' has shape \(3,\)"),
    (lambda s: s.__setitem__("model.layers.0.mlp.down_proj.weight", s["model.layers.0.mlp.down_proj.weight"].float()),
     r"down_proj.weight' has dtype F32, but .* makes it an FP8 e4m3 \(F8_E4M3\) weight"),
    (lambda s: s.__setitem__("model.layers.0.mlp.down_proj.weight_scale", -s["model.layers.0.mlp.down_proj.weight_scale"]),
     r"down_proj: a weight_scale of the checkpoint is not finite and > 0"),
])
def test_missing_or_misshapen_scales_are_refused(channel_ckpt, tmp_path, change, match):
    shutil.copytree(channel_ckpt, tmp_path / "ckpt")
    _rewrite(str(tmp_path / "ckpt"), change)
    with pytest.raises(ValueError, match=match):
        LLM(str(tmp_path / "ckpt"), **KW)


def test_missing_or_misshapen_block_scales_are_refused(tmp_path, stories_path, hf_model):
    fc.write_fp8(stories_path, str(tmp_path / "src"), fmt="fp8", block=(4, 8), model=hf_model)
    for i, (change, match) in enumerate([
        (lambda s: s.pop("model.layers.1.mlp.up_proj.weight_scale_inv"), r"weight 'model.layers.1.mlp.up_proj.weight_scale_inv' is missing"),
        (lambda s: s.__setitem__("model.layers.0.self_attn.o_proj.weight_scale_inv", torch.ones(16, 7)),
         r"o_proj.weight_scale_inv' has shape \(16, 7\)"),
    ]):
        shutil.copytree(tmp_path / "src", tmp_path / str(i))
        _rewrite(str(tmp_path / str(i)), change)
        with pytest.raises(ValueError, match=match):
            LLM(str(tmp_path / str(i)), **KW)


def test_fp8_on_a_quantized_checkpoint_and_int8_on_an_fp8_one_are_refused(channel_ckpt, tmp_path, stories_path, hf_model):
    with pytest.raises(ValueError, match=r"quantization='fp8' does not fit the checkpoint.*quant_method='compressed-tensors'"):
        LLM(channel_ckpt, quantization="fp8", **KW)
    fc.write_fp8(stories_path, str(tmp_path), fmt="fp8", model=hf_model)
    with pytest.raises(ValueError, match=r"quantization='int8' does not fit the checkpoint.*quant_method='fp8'"):
        LLM(str(tmp_path), quantization="int8", **KW)


def test_the_cli_flag_and_the_summary_name_fp8(online, online_outs):
    from argparse import ArgumentParser

    from pagedgen.cli.progress import RunStats, summary
    from pagedgen.engine_args import EngineArgs

    args = EngineArgs.add_cli_args(ArgumentParser()).parse_args(["--model", "m", "--quantization", "fp8"])
    assert EngineArgs.from_cli_args(args).quantization == "fp8"
    stats = online.get_stats()
    assert stats.quantization == "fp8" and "quantization='fp8'" in repr(stats)
    assert "FP8 W8A16 weights (quantization='fp8')" in summary(RunStats(generated=64, output_tokens=768), stats, "out.jsonl", None)


def test_perplexity_on_held_out_tinystories_within_2_percent_of_float(online, llm):
    with open(TINYSTORIES) as f:
        texts = [" ".join(json.loads(line)["text"].split()[:150]) for _, line in zip(range(32), f)]  # < 512 tokens
    sp = SamplingParams(max_tokens=1, prompt_logprobs=0)

    def perplexity(model):
        total, count = 0.0, 0
        for o in model.generate(texts, sp, use_tqdm=False):
            for tok, lp in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:]):
                total, count = total + lp[tok].logprob, count + 1
        return math.exp(-total / count)

    float_ppl, fp8_ppl = perplexity(llm), perplexity(online)
    assert fp8_ppl <= 1.02 * float_ppl, (fp8_ppl, float_ppl)
