"""int8 W8A8 weights of the linear layers (issue 46): the per-layer half of ``LLM(quantization=...)``.

A quantized ``LinearBase`` holds

- ``weight``: [out, in] int8, symmetric (no zero point), one scale per output feature;
- ``weight_scale``: [out] float32, ``W[n, :] = weight[n, :] * weight_scale[n]``;
- ``input_scale``: None (dynamic: each activation row gets its own scale, max |x| / 127, in the
  GEMM's prologue) or [1] float32 (a static per-tensor activation scale read from the checkpoint);

and its forward runs ``pagedgen.layers.matmul.int8_linear`` (``ops.int8_linear``: exact int32 sums,
one float32 scale at write-back, so batch-invariant by construction). The bias stays in the model dtype.

Two ways in: ``make_int8_params`` before loading a checkpoint that stores int8 weights
(compressed-tensors' ``int-quantized`` format: tensors ``weight`` I8 [out, in], ``weight_scale``
[out, 1], optionally ``input_scale`` [1] per checkpoint module), and ``quantize_linear_int8`` after
loading a float checkpoint (online quantization, ``quantization="int8"``). Which modules, and the
config behind it, is ``pagedgen.model.quantization``'s.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedgen.layers.loading import CheckpointSlice, check_shape, read
from pagedgen.layers.linear import LinearBase

INT8_MAX = 127


def quantize_weight_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 quantization of a [N, K] float weight (llm-compressor's
    "channel" strategy, minmax observer): in float32, ``scale[n] = max_k |W[n, k]| / 127`` (1 for an
    all-zero row), ``q = clamp(rint(W / scale), -127, 127)``. Returns (q [N, K] int8, scale [N]
    float32).

    Raises:
        ValueError: ``weight`` is not a 2-D floating-point tensor.
    """
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"quantize_weight_int8 needs a 2-D floating-point weight, got {getattr(weight, 'dtype', type(weight))} "
                         f"{tuple(getattr(weight, 'shape', ()))}")
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / INT8_MAX if w.shape[1] else w.new_ones(w.shape[0])
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


class _FlatSlice(CheckpointSlice):
    """A [N, 1] checkpoint slice seen as [N] (a per-channel scale), for the tensor-parallel loader."""

    def __init__(self, inner: CheckpointSlice) -> None:  # noqa: super().__init__ not called: a view of inner
        self._inner, self.shape, self.is_meta = inner, torch.Size([inner.shape[0]]), False

    def narrow(self, dim: int, start: int, length: int) -> "_FlatSlice":
        return _FlatSlice(self._inner.narrow(dim, start, length))

    def load(self) -> torch.Tensor:
        return self._inner.load().reshape(-1)


def _flat_scale(loaded, module: LinearBase):
    """A checkpoint's per-channel scale, [N, 1] (compressed-tensors) or [N], as [N]; other shapes
    raise WeightShapeError through the layer's own shape check."""
    if len(loaded.shape) == 2 and loaded.shape[1] == 1:
        return _FlatSlice(loaded) if isinstance(loaded, CheckpointSlice) else loaded.reshape(-1)
    if len(loaded.shape) == 1:
        return loaded
    check_shape(loaded, (loaded.shape[0], 1))  # WeightShapeError naming the shape
    return loaded


def _param(shape: tuple, dtype: torch.dtype, like: nn.Parameter) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype, device=like.device), requires_grad=False)
    p.load_dtype = dtype  # kept by pagedgen.model.weights.materialize (not the model dtype)
    p.shard_ids = getattr(like, "shard_ids", ())
    return p


def make_int8_params(module: LinearBase, static_input: bool) -> None:
    """Give ``module`` (built on the meta device, not loaded) the parameters of an int8 checkpoint:
    ``weight`` int8 (loaded by the layer's own loader: fused parts, tensor-parallel shards),
    ``weight_scale`` [out] float32 (the checkpoint's [out, 1] per part, concatenated like the
    weight's rows and sharded with them; whole on a row-parallel layer), and with ``static_input``
    ``input_scale`` (one per checkpoint part; the GEMM uses their maximum, vLLM's rule for fused
    layers)."""
    loader = module.weight_loader if module.tp is None else module.sharded_weight_loader
    old = module.weight
    module.weight = _param(tuple(old.shape), torch.int8, old)
    module.weight.weight_loader = loader
    scale = _param((module.output_size,), torch.float32, old)
    scale.weight_loader = lambda param, loaded, shard_id=None: loader(param, _flat_scale(loaded, module), shard_id)
    module.weight_scale = scale
    if static_input:
        parts = list(module.output_shards) or [None]
        module.input_scale = _param((len(parts),), torch.float32, old)
        module.input_scale.weight_loader = lambda param, loaded, shard_id=None: _load_input_scale(param, loaded, shard_id, parts)


def _load_input_scale(param: nn.Parameter, loaded, shard_id, parts: list) -> None:
    """One part's static activation scale ([1] or a scalar) into its place; a whole-layer one into every place."""
    if tuple(loaded.shape) not in ((), (1,)):
        check_shape(loaded, (1,))  # WeightShapeError
    if shard_id is not None and shard_id not in parts:
        raise KeyError(f"unknown shard {shard_id!r} (this layer has {parts})")
    if loaded.is_meta:
        return
    value = read(loaded).reshape(1).float()
    with torch.no_grad():
        if shard_id is None:
            param.copy_(value.expand(len(parts)))
        else:
            param[parts.index(shard_id)] = value[0]


def finish_int8(module: LinearBase) -> None:
    """After loading: a static ``input_scale`` reduced to one [1] scale (the largest of the parts';
    a fused layer quantizes its one input once). ValueError for a scale that is not finite and > 0."""
    for name in ("weight_scale", "input_scale"):
        s = getattr(module, name)
        if s is not None and not bool(torch.isfinite(s).all() and (s > 0).all()):
            raise ValueError(f"a {name} of the checkpoint is not finite and > 0 (min {float(s.min())}, max {float(s.max())})")
    if module.input_scale is not None and module.input_scale.numel() > 1:
        module.input_scale = nn.Parameter(module.input_scale.detach().amax().reshape(1), requires_grad=False)


def quantize_linear_int8(module: LinearBase, quantize=None) -> int:
    """Online quantization of a loaded float ``module`` (``quantize``, default ``quantize_weight_int8``:
    (weight [out, in], per-output scale [out, 1] float32); dynamic per-row activation scales).
    Returns the bytes the weights took in addition (negative: saved)."""
    q, scale = (quantize or quantize_weight_int8)(module.weight)
    before = module.weight.numel() * module.weight.element_size()
    module.weight = nn.Parameter(q, requires_grad=False)
    module.weight_scale = nn.Parameter(scale, requires_grad=False)
    module.input_scale = None
    return q.numel() + scale.numel() * 4 - before

