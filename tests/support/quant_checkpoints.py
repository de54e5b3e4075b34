"""int8 W8A8 test data without llm-compressor: compressed-tensors ``int-quantized`` checkpoints written
from a float checkpoint in the documented layout, and the fake-quantized transformers oracle.

The layout (compressed-tensors' ``int-quantized`` format, as llm-compressor's W8A8 recipes save it):
every ``nn.Linear`` not in ``ignore`` stores ``<module>.weight`` int8 [out, in] and
``<module>.weight_scale`` [out, 1] (the checkpoint's float dtype), with a static scheme also
``<module>.input_scale`` [1]; config.json gets a ``quantization_config`` with ``quant_method:
compressed-tensors``, ``format: int-quantized`` and one config group (weights: 8-bit int, symmetric,
channel; input_activations: dynamic token, or static tensor).
"""
from __future__ import annotations

import json
import os
import shutil

import torch
from torch import nn


def quantize_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8 (minmax): (q [N, K] int8, scale [N] float32)."""
    scale = w.float().abs().amax(dim=1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(w.float() / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def fake_quant_rows(x: torch.Tensor, static_scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (or static per-tensor) symmetric int8 activations: (q as float64, scale [M, 1] float64)."""
    x = x.float()
    if static_scale is None:
        s = x.abs().amax(dim=-1, keepdim=True) / 127
        s = torch.where(s > 0, s, torch.ones_like(s))
    else:
        s = torch.full_like(x[..., :1], float(static_scale))
    return torch.round(x / s).clamp(-128, 127).double(), s.double()


def linear_names(model: nn.Module, ignore=("lm_head",)) -> list[str]:
    """The ``nn.Linear`` modules of a transformers model that a W8A8 recipe quantizes."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not any(n == i or n.endswith("." + i) for i in ignore)]


def calibrate(model: nn.Module, names: list[str], batches: list[torch.Tensor]) -> dict[str, float]:
    """Static per-tensor input scales: max |input| / 127 of each module over ``batches`` of token ids."""
    amax: dict[str, float] = {}
    mods = dict(model.named_modules())
    hooks = [mods[n].register_forward_pre_hook(lambda m, a, n=n: amax.__setitem__(n, max(amax.get(n, 0.0), float(a[0].abs().max()))))
             for n in names]
    with torch.no_grad():
        for ids in batches:
            model(ids[None])
    for h in hooks:
        h.remove()
    return {n: v / 127 for n, v in amax.items()}


def write_folder(src: str, dst: str, state: dict, quantization_config: dict) -> None:
    """The quantized checkpoint folder ``dst``: ``src``'s files but its weights (config, tokenizer),
    ``state`` as model.safetensors, and config.json's ``quantization_config`` set."""
    from safetensors.torch import save_file

    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if not f.endswith(".safetensors") and f != "model.safetensors.index.json" and os.path.isfile(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), dst)
    save_file(state, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=1)


def write_w8a8(model: nn.Module, src: str, dst: str, static_batches=None, ignore=("lm_head",)) -> dict:
    """Save transformers ``model`` (loaded from ``src``) in ``dst`` as a compressed-tensors W8A8
    checkpoint (the module docstring's layout), copying ``src``'s other files (tokenizer...).
    ``static_batches``: token-id tensors to calibrate static input scales on (None: dynamic).
    Returns {module name: input scale} (empty when dynamic)."""
    from safetensors.torch import load_file

    names = linear_names(model, ignore)
    scales = calibrate(model, names, static_batches) if static_batches is not None else {}
    state = load_file(os.path.join(src, "model.safetensors"))  # the file's names (GPT-NeoX's head is embed_out there)
    for n in names:
        q, s = quantize_channel(state[n + ".weight"])
        dtype = state[n + ".weight"].dtype
        state[n + ".weight"], state[n + ".weight_scale"] = q, s[:, None].to(dtype)
        if n in scales:
            state[n + ".input_scale"] = torch.tensor([scales[n]], dtype=dtype)
    act = dict(num_bits=8, type="int", symmetric=True, dynamic=not scales, strategy="tensor" if scales else "token")
    write_folder(src, dst, state, {
        "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
        "ignore": list(ignore), "kv_cache_scheme": None,
        "config_groups": {"group_0": {"targets": ["Linear"], "output_activations": None, "input_activations": act,
                                      "weights": dict(num_bits=8, type="int", symmetric=True, dynamic=False, strategy="channel")}},
    })
    return scales


class FakeQuantLinear(nn.Module):
    """The oracle of one W8A8 ``nn.Linear``: rows fake-quantized, int8 weights, exact float64 sums."""

    def __init__(self, linear: nn.Linear, static_scale=None) -> None:
        super().__init__()
        self.q, self.scale = quantize_channel(linear.weight.detach())
        self.bias, self.static_scale = linear.bias, static_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, s = fake_quant_rows(x, self.static_scale)
        y = (q @ self.q.double().t()) * s * self.scale.double()
        if self.bias is not None:
            y = y + self.bias.double()
        return y.to(x.dtype)


def fake_quantize(model: nn.Module, ignore=("lm_head",), static_scales=None) -> nn.Module:
    """``model`` with every W8A8-quantized ``nn.Linear`` replaced by its ``FakeQuantLinear`` (in place)."""
    for n in linear_names(model, ignore):
        parent, _, child = n.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, child, FakeQuantLinear(getattr(owner, child), (static_scales or {}).get(n)))
    return model


def _dense(lin) -> torch.Tensor:
    """The [N, K] float weight of a pagedgen linear layer, unpacked from its panels if packed."""
    w = lin.weight
    if w.dim() == 3:  # panels [P, K, 16]
        w = w.transpose(1, 2).reshape(-1, w.shape[1])
    if w.dim() == 4:  # bf16 pairs [P, Q, 16, 2]
        w = w.permute(0, 2, 1, 3).reshape(w.shape[0] * w.shape[2], -1)[:, : lin.input_size]
    return w[: lin.output_size].float()


def fake_quantize_pagedgen(model: nn.Module) -> nn.Module:
    """A float pagedgen model whose linear layers (not the lm_head) compute W8A8 as the spec says,
    written here without pagedgen's quantization code: rows quantized in float32, exact float64 sums,
    then float32 ``acc * x_scale * w_scale + bias``. Everything else runs pagedgen's float kernels, so
    the int8 model must give its tokens and logprobs bit for bit."""
    from pagedgen.layers.linear import LinearBase

    for m in model.modules():
        if not isinstance(m, LinearBase):
            continue
        q, ws = quantize_channel(_dense(m))
        bias = None if m.bias is None else m.bias.float()

        def run(x, b, q=q, ws=ws):
            xq, _ = fake_quant_rows(x)
            s = x.float().abs().amax(-1, keepdim=True) / 127
            s = torch.where(s > 0, s, torch.ones_like(s))
            y = (xq @ q.double().t()).float() * s * ws
            return (y if b is None else y + b).to(x.dtype)

        m._matmul = lambda x, b, run=run, bias=bias: run(x, None if b is None else bias)
    return model
