"""FP8 weight test data without llm-compressor: checkpoints written from a float checkpoint in the
formats' documented layouts, and the fake-quantized transformers oracle.

The layouts (every ``nn.Linear`` not in the ignore list; the checkpoint's other tensors as they are):

- compressed-tensors ``float-quantized`` (llm-compressor's ``FP8`` / ``FP8_DYNAMIC`` schemes):
  ``<module>.weight`` F8_E4M3 [out, in] and ``<module>.weight_scale`` [out, 1] ("channel") or [1]
  ("tensor") in the checkpoint's float dtype; config.json's ``quantization_config`` has
  ``quant_method: compressed-tensors``, ``format: float-quantized`` and one config group (weights:
  8-bit float, symmetric, channel or tensor; input_activations: null, or dynamic per-token float).
- vLLM's / transformers' ``fp8`` (AutoFP8's output): ``<module>.weight`` F8_E4M3 and a scalar
  ``<module>.weight_scale`` [] float32 per tensor; ``quantization_config`` ``{quant_method: fp8,
  activation_scheme: dynamic, ignored_layers: [...]}``; block-wise (DeepSeek-V3, Qwen3-FP8):
  ``<module>.weight_scale_inv`` [ceil(out / bn), ceil(in / bk)] float32, one per bn x bk block (the
  weight is ``float32(q) * scale_inv`` despite the name), and ``weight_block_size: [bn, bk]``;
  compressed-tensors' block strategy (llm-compressor's ``FP8_BLOCK``) stores the same blocks as
  ``<module>.weight_scale`` with ``strategy: block, block_structure: [bn, bk]``.

The quantizer is minmax, symmetric: ``scale = max |W| / 448`` (per row or per tensor),
``q = float8_e4m3fn(clamp(W / scale, -448, 448))``; the real weight is ``float32(q) * scale``.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from quant_checkpoints import linear_names, write_folder

FP8_MAX = 448.0


def quantize_fp8(w: torch.Tensor, strategy="channel") -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, K] float8_e4m3fn, scale [N] float32 per "channel", [] per "tensor", [ceil(N / bn),
    ceil(K / bk)] for ``strategy`` a block (bn, bk))."""
    w = w.float()
    if isinstance(strategy, tuple):
        s = _expand(_block_amax(w, *strategy) / FP8_MAX, w.shape, *strategy)
        s = torch.where(s > 0, s, torch.ones_like(s))
        scale = _block_amax(s, *strategy)  # each block's (one) scale
        return (w / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale
    scale = w.abs().amax(dim=1) / FP8_MAX if strategy == "channel" else w.abs().amax() / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    s = scale[:, None] if strategy == "channel" else scale
    return (w / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def _block_amax(w: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    n, k = w.shape
    padded = torch.nn.functional.pad(w.abs(), (0, -k % bk, 0, -n % bn))
    return padded.reshape(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk).amax(dim=(1, 3))


def _expand(scale: torch.Tensor, shape, bn: int, bk: int) -> torch.Tensor:
    return scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[: shape[0], : shape[1]]


def dequantize(q: torch.Tensor, scale: torch.Tensor, block=None) -> torch.Tensor:
    """float32(q) * scale: the fake-quantized float weight (one float32 rounding, as pagedgen's fp8_linear does it)."""
    if block is not None:
        return q.float() * _expand(scale, q.shape, *block)
    return q.float() * (scale[:, None] if scale.dim() == 1 else scale)


def write_fp8(src: str, dst: str, fmt: str = "compressed-tensors", strategy: str = "channel", activations: bool = False,
              ignore=("lm_head",), model: nn.Module = None, block=None) -> None:
    """Save the float checkpoint ``src`` in ``dst`` as an FP8 checkpoint in ``fmt`` ("compressed-tensors"
    or "fp8", the module docstring's layouts; "fp8" is per tensor; either block-wise with ``block`` (bn, bk)),
    copying ``src``'s other files.
    ``activations``: compressed-tensors' config asks for dynamic per-token FP8 activations.
    ``model``: the transformers model of ``src`` (to find its ``nn.Linear`` modules; loaded if None)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = model if model is not None else AutoModelForCausalLM.from_pretrained(src, dtype="float32")
    strategy = tuple(block) if block else "tensor" if fmt == "fp8" else strategy
    state = load_file(os.path.join(src, "model.safetensors"))
    for n in linear_names(model, ignore):
        dtype = state[n + ".weight"].dtype
        q, s = quantize_fp8(state[n + ".weight"], strategy)
        state[n + ".weight"] = q
        if isinstance(strategy, tuple):
            state[n + (".weight_scale_inv" if fmt == "fp8" else ".weight_scale")] = s.float() if fmt == "fp8" else s.to(dtype)
            continue
        state[n + ".weight_scale"] = s.float() if fmt == "fp8" else (s[:, None] if strategy == "channel" else s.reshape(1)).to(dtype)
    if fmt == "fp8":
        quantization_config = {"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": list(ignore)}
        if block:
            quantization_config["weight_block_size"] = list(block)
    else:
        act = dict(num_bits=8, type="float", symmetric=True, dynamic=True, strategy="group" if block else "token") if activations else None
        weights = dict(num_bits=8, type="float", symmetric=True, dynamic=False, strategy="block" if block else strategy)
        if block:
            weights["block_structure"] = list(block)
        quantization_config = {
            "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "ignore": list(ignore), "kv_cache_scheme": None,
            "config_groups": {"group_0": {"targets": ["Linear"], "output_activations": None, "input_activations": act,
                                          "weights": weights}},
        }
    write_folder(src, dst, state, quantization_config)


def fake_quantize_fp8(model: nn.Module, strategy="channel", ignore=("lm_head",)) -> nn.Module:
    """``model`` (transformers, float32) with every ``nn.Linear`` but the ignored ones holding its
    fake-quantized weight ``dequantize(quantize_fp8(W))`` (in place): the W8A16 oracle."""
    for n in linear_names(model, ignore):
        lin = model.get_submodule(n)
        with torch.no_grad():
            lin.weight.copy_(dequantize(*quantize_fp8(lin.weight.detach(), strategy), strategy if isinstance(strategy, tuple) else None))
    return model
