"""int4 W4A16 test data without gptqmodel / AutoAWQ / llm-compressor: GPTQ, AWQ and compressed-tensors
``pack-quantized`` checkpoints written from a float checkpoint in each format's documented layout
(pagedgen/layers/quant_int4.py's table; round-to-nearest per group, as those tools do without
calibration data), and the fake-quantized float weights they stand for (the oracle's).

Quantization of one [N, K] weight, per output row and group of g input features (the last group
may be partial), in float32:
- asymmetric: ``s = (max - min) / 15`` over the group with 0 included in [min, max], ``z =
  clamp(round(-min / s), 0, 15)``;
- symmetric: ``s = 2 max |w| / 15``, ``z = 8``;
- ``q = clamp(round(w / s) + z, 0, 15)``; s is stored in float16 (as the formats do), and the real
  weight is ``float32(q - z) * float32(s16)``;
- each group's range [min, max] shrunk by the ratio (1, 0.97, ... 0.52) whose real weights have the
  least squared error (AWQ's clip search and llm-compressor's MSE observer, without activations).
"""
from __future__ import annotations

import copy
import os
import re

import torch
from torch import nn

from pagedgen.layers.quant_int4 import AWQ_ORDER, pack_int32
from quant_checkpoints import write_folder


def _rtn(wp: torch.Tensor, symmetric: bool, ratio: float):
    """Round-to-nearest of groups wp [N, G, g] with their range shrunk by ``ratio``: (q, s16, z)."""
    if symmetric:
        s = 2 * ratio * wp.abs().amax(-1) / 15
        z = torch.full_like(s, 8)
    else:
        lo, hi = ratio * wp.amin(-1).clamp(max=0), ratio * wp.amax(-1).clamp(min=0)
        s = (hi - lo) / 15
        s = torch.where(s > 0, s, torch.ones_like(s))
        z = torch.round(-lo / s).clamp(0, 15)
    s16 = torch.where(s > 0, s, torch.ones_like(s)).half()
    q = (torch.round(wp / s16.float()[..., None]) + z[..., None]).clamp(0, 15)
    return q, s16, z


def quantize_rtn(w: torch.Tensor, group: int, symmetric: bool, clip_search: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float -> (codes uint8 [N, K], scales float16 [N, G], zeros uint8 [N, G]); group -1: per row.
    ``clip_search``: each group's range shrunk by the ratio in 1, 0.97, ... 0.52 that gives the least
    squared error (AWQ's clip search and llm-compressor's MSE observer, without activations)."""
    n, k = w.shape
    g = k if group == -1 else group
    groups = -(-k // g)
    wp = torch.nn.functional.pad(w.float(), (0, groups * g - k)).view(n, groups, g)
    q, s16, z = _rtn(wp, symmetric, 1.0)
    if clip_search:
        err = ((q - z[..., None]) * s16.float()[..., None] - wp).square().sum(-1)
        for i in range(1, 17):
            q2, s2, z2 = _rtn(wp, symmetric, 1 - 0.03 * i)
            e2 = ((q2 - z2[..., None]) * s2.float()[..., None] - wp).square().sum(-1)
            better = e2 < err
            q, s16, z = torch.where(better[..., None], q2, q), torch.where(better, s2, s16), torch.where(better, z2, z)
            err = torch.minimum(err, e2)
    return q.reshape(n, -1)[:, :k].to(torch.uint8), s16, z.to(torch.uint8)


class _Stop(Exception):
    """Raised after the last layer a calibration pass needs."""


def hessians(model: nn.Module, names: list, batches: list) -> dict:
    """GPTQ's calibration: {module: 2 X^T X / rows} [K, K] float64 of each module's inputs over
    ``batches`` of token ids (the float model's activations), concatenated and run in one forward as
    rows of 128 tokens."""
    from transformers.pytorch_utils import Conv1D

    mods = dict(model.named_modules())
    h, rows = {}, {}

    def hook(module, args, name):
        x = args[0].reshape(-1, args[0].shape[-1]).double()
        h[name] = h.get(name, 0) + 2 * x.t() @ x
        rows[name] = rows.get(name, 0) + x.shape[0]

    hooks = [mods[n].register_forward_pre_hook(lambda m, a, n=n: hook(m, a, n)) for n in names
             if isinstance(mods[n], (nn.Linear, Conv1D))]
    layer = {_layer(n) for n in names}
    if len(layer) == 1 and layer != {-1}:  # one decoder layer's modules: stop the forward after that layer
        last = layer.pop()
        blocks = [m for n, m in model.named_modules() if re.fullmatch(rf".*\.(layers|h)\.{last}", n)]

        def stop(*_):
            raise _Stop

        hooks += [b.register_forward_hook(stop) for b in blocks]
    stream = torch.cat(list(batches))
    with torch.no_grad():
        try:
            model(stream[: len(stream) // 128 * 128].view(-1, 128))
        except _Stop:
            pass
    for hk in hooks:
        hk.remove()
    return {n: h[n] / rows[n] for n in h}


def quantize_gptq(w: torch.Tensor, hessian: torch.Tensor, group: int, symmetric: bool, damp: float = 0.01):
    """GPTQ (Frantar et al., 2022) of one [N, K] weight: columns quantized in order, each one's
    rounding error spread over the columns not yet quantized through the inverse Hessian's Cholesky
    factor; a group's scale and zero taken (with the clip search) when its first column is reached.
    Returns ``quantize_rtn``'s (codes, scales, zeros)."""
    n, k = w.shape
    g = k if group == -1 else group
    W, H = w.double().clone(), hessian.clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    H += damp * torch.diag(H).mean() * torch.eye(k, dtype=H.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    codes = torch.zeros(n, k, dtype=torch.uint8)
    scales, zeros = [], []
    for i in range(k):
        if i % g == 0:
            _, s16, z = quantize_rtn(W[:, i:i + g].float(), -1, symmetric)
            scales.append(s16[:, 0])
            zeros.append(z[:, 0])
        s, z = scales[-1].double(), zeros[-1].double()
        q = (torch.round(W[:, i] / s) + z).clamp(0, 15)
        codes[:, i] = q.to(torch.uint8)
        err = (W[:, i] - (q - z) * s) / hinv[i, i]
        W[:, i:] -= err[:, None] * hinv[i, i:][None, :]
    return codes, torch.stack(scales, 1), torch.stack(zeros, 1)


def dequantize(codes, scales, zeros, group: int) -> torch.Tensor:
    """float32(q - z) * s, as pagedgen's kernel and the formats' dequantization compute it."""
    k = codes.shape[1]
    g = k if group == -1 else group
    s = scales.float().repeat_interleave(g, dim=1)[:, :k]
    z = zeros.to(torch.int32).repeat_interleave(g, dim=1)[:, :k]
    return (codes.to(torch.int32) - z).float() * s


def _pad(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Zero codes up to a multiple of 8 along ``dim`` (for packing)."""
    pad = -t.shape[dim] % 8
    return torch.nn.functional.pad(t, (0, pad) if dim == 1 else (0, 0, 0, pad))


def pack(fmt: str, codes, scales, zeros, group: int, symmetric: bool, gptq_format: str = "gptq") -> dict:
    """The checkpoint tensors of one layer (suffix -> tensor) in ``fmt``."""
    n, k = codes.shape
    if fmt == "gptq":
        stored = (zeros.to(torch.int32) - (1 if gptq_format == "gptq" else 0)) & 0xF
        return {"qweight": pack_int32(_pad(codes.t(), 0), 0), "qzeros": pack_int32(_pad(stored.t(), 1), 1),
                "scales": scales.t().contiguous(), "g_idx": (torch.arange(k) // (k if group == -1 else group)).to(torch.int32)}
    if fmt == "awq":
        return {"qweight": pack_int32(_pad(codes.t(), 1), 1, AWQ_ORDER), "qzeros": pack_int32(_pad(zeros.t(), 1), 1, AWQ_ORDER),
                "scales": scales.t().contiguous()}
    out = {"weight_packed": pack_int32(_pad(codes, 1), 1), "weight_scale": scales,
           "weight_shape": torch.tensor([n, k], dtype=torch.int32)}
    if not symmetric:
        out["weight_zero_point"] = pack_int32(_pad(zeros, 0), 0)
    return out


def quant_config(fmt: str, group: int, symmetric: bool, gptq_format: str = "gptq", ignore=("lm_head",)) -> dict:
    """config.json's ``quantization_config`` of ``fmt`` as the tools write it."""
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": symmetric,
                "checkpoint_format": gptq_format, "lm_head": False, "damp_percent": 0.01, "true_sequential": True}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": None}
    weights = dict(num_bits=4, type="int", symmetric=symmetric, dynamic=False, actorder=None,
                   strategy="channel" if group == -1 else "group", group_size=None if group == -1 else group)
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "ignore": list(ignore), "kv_cache_scheme": None,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None}}}


def quantized_modules(model: nn.Module, fmt: str, ignore=("lm_head",)) -> list[str]:
    """The modules a tool quantizes: nn.Linear (and GPT-2's Conv1D for GPTQ / AWQ), not ``ignore``."""
    from transformers.pytorch_utils import Conv1D

    kinds = (nn.Linear, Conv1D) if fmt in ("gptq", "awq") else (nn.Linear,)
    return [n for n, m in model.named_modules() if isinstance(m, kinds) and not any(n == i or n.endswith("." + i) for i in ignore)]


def _layer(name: str) -> int:
    m = re.search(r"\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


def _float_weight(model: nn.Module, name: str) -> torch.Tensor:
    from transformers.pytorch_utils import Conv1D

    m = model.get_submodule(name)
    return m.weight.detach().t() if isinstance(m, Conv1D) else m.weight.detach()


def _set_weight(model: nn.Module, name: str, w: torch.Tensor) -> None:
    from transformers.pytorch_utils import Conv1D

    m = model.get_submodule(name)
    with torch.no_grad():
        m.weight.copy_(w.t() if isinstance(m, Conv1D) else w)


def _effective_zeros(fmt: str, gptq_format: str, zeros: torch.Tensor) -> torch.Tensor:
    """The zero points a loader reads back: GPTQ's v1 stores z - 1 in 4 bits, so z = 0 reads back as 16."""
    return ((zeros.to(torch.int32) - 1) & 0xF) + 1 if fmt == "gptq" and gptq_format == "gptq" else zeros


def write_int4(model: nn.Module, src: str, dst: str, fmt: str, group: int = 128, symmetric: bool = False,
               gptq_format: str = "gptq", calibration: list = None) -> dict:
    """Save the float checkpoint ``src`` (``model``: it loaded by transformers) in ``dst`` as an int4
    checkpoint of ``fmt`` ("gptq", "awq", "pack-quantized"), copying the other files; quantized by
    ``quantize_gptq`` on the Hessians of ``calibration`` (token-id tensors) when given, else by
    ``quantize_rtn``. Returns {module name: the real [out, in] float32 weight} (what transformers'
    model must hold to be the oracle)."""
    from safetensors.torch import load_file
    from transformers.pytorch_utils import Conv1D

    state = load_file(os.path.join(src, "model.safetensors"))
    mods = dict(model.named_modules())
    real = {}
    names = quantized_modules(model, fmt)
    if calibration:  # layer after layer (GPTQ's sequential mode): each layer calibrated on the quantized layers before it
        work, done = copy.deepcopy(model), {}
        for layer in sorted({_layer(n) for n in names}):
            todo = [n for n in names if _layer(n) == layer]
            hs = hessians(work, todo, calibration)
            for n in todo:
                done[n] = codes, scales, zeros = quantize_gptq(_float_weight(work, n), hs[n], group, symmetric)
                _set_weight(work, n, dequantize(codes, scales, _effective_zeros(fmt, gptq_format, zeros), group))
    for name in names:
        key = name + ".weight" if name + ".weight" in state else name.split(".", 1)[1] + ".weight"
        w = state.pop(key)
        w = w.t() if isinstance(mods[name], Conv1D) else w  # [out, in]
        codes, scales, zeros = done[name] if calibration else quantize_rtn(w, group, symmetric)
        real[name] = dequantize(codes, scales, _effective_zeros(fmt, gptq_format, zeros), group)
        prefix = key[: -len(".weight")]
        for suffix, t in pack(fmt, codes, scales.to(w.dtype) if fmt == "pack-quantized" else scales, zeros, group, symmetric,
                              gptq_format).items():
            state[f"{prefix}.{suffix}"] = t
    write_folder(src, dst, state, quant_config(fmt, group, symmetric, gptq_format))
    return real


def fake_quantize(model: nn.Module, real: dict) -> nn.Module:
    """transformers ``model`` with each quantized module's weight replaced by its real int4 weight
    (in place): the fake-quantized float oracle."""
    from transformers.pytorch_utils import Conv1D

    mods = dict(model.named_modules())
    with torch.no_grad():
        for name, w in real.items():
            m = mods[name]
            m.weight.copy_(w.t() if isinstance(m, Conv1D) else w)
    return model
