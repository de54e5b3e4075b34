"""FP8 weights of the linear layers, W8A16 (issue 46): the per-layer half of ``LLM(quantization="fp8")``
and of FP8 checkpoints (``pagedgen.model.quantization`` decides which layers and reads the config).

A quantized ``LinearBase`` holds

- ``weight``: [out, in] ``torch.float8_e4m3fn`` (1 byte per weight), symmetric;
- ``weight_scale``: [out] float32, ``W[n, :] = float32(weight[n, :]) * weight_scale[n]`` (a
  checkpoint's per-tensor scale is repeated over the rows of its part: exact, and a fused q/k/v or
  gate/up layer keeps each part's own scale);
- ``input_scale``: None (activations stay in the model dtype: W8A16);

and its forward runs ``pagedgen.layers.matmul.fp8_linear``: the weight dequantized to the
activations' dtype, then the model's float GEMM (``linear``, in the row blocks of its
``MatmulConfig``: batch-invariant as the float model is). The bias stays in the model dtype.

Two ways in: ``make_fp8_params`` before loading a checkpoint that stores FP8 weights
(compressed-tensors ``float-quantized``: ``weight`` F8_E4M3 [out, in] and ``weight_scale`` [out, 1]
per channel or [1] / [] per tensor; vLLM's ``fp8`` format: ``weight`` F8_E4M3 and a per-tensor
``weight_scale``), and ``quantize_linear_fp8`` after loading a float checkpoint (online
``quantization="fp8"``, per output channel).
"""
from __future__ import annotations

import torch
from torch import nn

from pagedgen.layers.linear import LinearBase
from pagedgen.layers.loading import read
from pagedgen.layers.quant import _flat_scale, _param

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def quantize_weight_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel FP8 (e4m3) quantization of a [N, K] float weight (llm-compressor's
    FP8 "channel" strategy, minmax observer): in float32, ``scale[n] = max_k |W[n, k]| / 448`` (1 for
    an all-zero row), ``q = float8_e4m3fn(clamp(W / scale, -448, 448))`` (round to nearest even).
    Returns (q [N, K] float8_e4m3fn, scale [N] float32).

    Raises:
        ValueError: ``weight`` is not a 2-D floating-point tensor, or has a value that is not finite.
    """
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"quantize_weight_fp8 needs a 2-D floating-point weight, got {getattr(weight, 'dtype', type(weight))} "
                         f"{tuple(getattr(weight, 'shape', ()))}")
    w = weight.detach().float()
    if not bool(torch.isfinite(w).all()):
        raise ValueError("quantize_weight_fp8: the weight has a value that is not finite")
    scale = w.abs().amax(dim=1) / FP8_MAX if w.shape[1] else w.new_ones(w.shape[0])
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def _scale_loader(module: LinearBase, loader):
    """The loader of ``weight_scale``: a per-channel scale ([N, 1] or [N]) goes through the layer's own
    loader (fused parts, tensor-parallel shards); a per-tensor one ([1] or []) is repeated over the
    rows of its part first. Other shapes raise WeightShapeError naming them."""
    def load(param: nn.Parameter, loaded, shard_id=None) -> None:
        if tuple(loaded.shape) in ((), (1,)):
            rows = module.global_output_size if shard_id is None else module.global_output_shards.get(shard_id, 0)
            if shard_id is not None and shard_id not in module.global_output_shards:
                raise KeyError(f"unknown shard {shard_id!r} (this layer has {list(module.global_output_shards)})")
            if loaded.is_meta:  # the dry run: shapes only
                loaded = torch.empty(rows, dtype=torch.float32, device="meta")
            else:  # tiny: read whole and repeated (the tensor-parallel loader narrows it like a per-channel one)
                loaded = read(loaded).float().reshape(1).expand(rows).contiguous()
        loader(param, _flat_scale(loaded, module), shard_id)
    return load


def make_fp8_params(module: LinearBase) -> None:
    """Give ``module`` (built on the meta device, not loaded) the parameters of an FP8 checkpoint:
    ``weight`` float8_e4m3fn (loaded by the layer's own loader: fused parts, tensor-parallel shards)
    and ``weight_scale`` [out] float32 (per channel, or a part's per-tensor scale repeated over its
    rows; sharded with the rows, whole on a row-parallel layer)."""
    loader = module.weight_loader if module.tp is None else module.sharded_weight_loader
    old = module.weight
    module.weight = _param(tuple(old.shape), FP8_DTYPE, old)
    module.weight.weight_loader = loader
    scale = _param((module.output_size,), torch.float32, old)
    scale.weight_loader = _scale_loader(module, loader)
    module.weight_scale = scale


def finish_fp8(module: LinearBase) -> None:
    """After loading: ValueError for a ``weight_scale`` that is not finite and > 0, or an FP8 weight
    that holds a NaN (e4m3fn has no infinities)."""
    s = module.weight_scale
    if not bool(torch.isfinite(s).all() and (s > 0).all()):
        raise ValueError(f"a weight_scale of the checkpoint is not finite and > 0 (min {float(s.min())}, max {float(s.max())})")
    if bool(torch.isnan(module.weight.float()).any()):
        raise ValueError("the FP8 weight of the checkpoint holds a NaN")


def quantize_linear_fp8(module: LinearBase) -> int:
    """Online quantization of a loaded float ``module`` (``quantize_weight_fp8``). Returns the bytes
    the weights took in addition (negative: saved)."""
    q, scale = quantize_weight_fp8(module.weight)
    before = module.weight.numel() * module.weight.element_size()
    module.weight = nn.Parameter(q, requires_grad=False)
    module.weight_scale = nn.Parameter(scale, requires_grad=False)
    module.input_scale = None
    return q.numel() + scale.numel() * 4 - before
