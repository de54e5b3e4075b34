"""Normalisation layers: RMSNorm (Llama's and Gemma's forms) and LayerNorm.

Each takes an optional residual, as in nano-vllm and vLLM: ``norm(x)`` returns the normalised rows;
``norm(x, residual)`` first adds ``x`` to the residual stream and returns ``(norm(residual + x),
residual + x)``. Llama's form runs as the fused ops (``ops.rms_norm``, ``ops.fused_add_rms_norm``:
one pass over the rows, in place), LayerNorm with a residual as ``ops.fused_add_layer_norm`` where
its CPU kernel runs (in place too); Gemma's form and LayerNorm without a residual are transformers'
own PyTorch ops.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from pagedgen import ops
from pagedgen.layers.module import Module

NormOut = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]


class RMSNorm(Module):
    """Root-mean-square norm (Zhang & Sennrich 2019) over the last dimension.

    Args:
        hidden_size: features per row.
        eps: added to the mean of squares.
        gemma: Gemma's form, ``x / rms(x) * (1 + weight)`` computed in float32 and rounded once
            (transformers' ``GemmaRMSNorm``); otherwise Llama's, ``weight * round(x / rms(x))`` with
            the statistics in float32 and the weight applied in the model dtype (``LlamaRMSNorm``).

    ``forward(x [T, hidden], residual [T, hidden] | None)``: with a residual, the Llama form updates
    both tensors in place (``residual += x``, ``x = norm(residual)``) and returns them.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, gemma: bool = False) -> None:
        super().__init__()
        self.eps, self.gemma = eps, gemma
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)  # [hidden]

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> NormOut:
        if self.gemma:
            if residual is not None:
                residual = residual + x
                return self._gemma_norm(residual), residual
            return self._gemma_norm(x)
        if residual is not None:
            ops.fused_add_rms_norm(x, residual, self.weight, self.eps)  # residual += x; x = norm(residual)
            return x, residual
        out = torch.empty_like(x)
        ops.rms_norm(out, x, self.weight, self.eps)
        return out

    def _gemma_norm(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class LayerNorm(Module):
    """Layer norm (Ba et al. 2016) as ``torch.nn.LayerNorm``: ``(x - mean) / sqrt(var + eps) * weight
    + bias`` over the last dimension, in the model dtype.

    Args:
        hidden_size: features per row.
        eps: added to the variance.
        elementwise_affine: has weight and bias (OPT's ``layer_norm_elementwise_affine=False``: none).

    ``forward(x [T, hidden], residual [T, hidden] | None)``: with a residual, returns
    ``(norm(x + residual), x + residual)``, the sum rounded to the model dtype as torch's add. Where
    the CPU kernel runs (``ops.fused_add_layer_norm``: float32/bf16/fp16 rows with contiguous
    elements, weight and bias in the rows' dtype) both tensors are updated in place and returned (``residual
    = x + residual``, ``x = norm(residual)``, one pass over the rows); elsewhere new tensors are
    returned. Either way the caller uses the returned tensors and not its own ``x`` and ``residual``.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, elementwise_affine: bool = True) -> None:
        super().__init__()
        self.hidden_size, self.eps = hidden_size, eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False) if elementwise_affine else None
        self.bias = nn.Parameter(torch.empty(hidden_size), requires_grad=False) if elementwise_affine else None

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> NormOut:
        if residual is not None:
            if self._fused(x, residual):
                ops.fused_add_layer_norm(x, residual, self.weight, self.bias, self.eps)  # residual += x; x = norm
                return x, residual
            residual = x + residual
            return F.layer_norm(residual, (self.hidden_size,), self.weight, self.bias, self.eps), residual
        return F.layer_norm(x, (self.hidden_size,), self.weight, self.bias, self.eps)

    def _fused(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        """Whether ``ops.fused_add_layer_norm``'s kernel takes these rows (else torch's ops run)."""
        return (
            ops.has_kernel("fused_add_layer_norm", x.device.type)
            and x.dim() == 2
            and x.shape == residual.shape
            and x.stride(-1) == 1
            and residual.stride(-1) == 1
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and residual.dtype == x.dtype
            and (self.weight is None or self.weight.dtype == x.dtype)
        )
