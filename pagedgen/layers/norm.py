"""Normalisation layers: RMSNorm (Llama's and Gemma's forms) and LayerNorm.

Each takes an optional residual, as in nano-vllm and vLLM: ``norm(x)`` returns the normalised rows;
``norm(x, residual)`` first adds ``x`` to the residual stream and returns ``(norm(residual + x),
residual + x)``. Llama's form runs as the fused ops (``ops.rms_norm``, ``ops.fused_add_rms_norm``:
one pass over the rows, in place); Gemma's form and LayerNorm are transformers' own PyTorch ops.
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

    ``forward(x, residual)``: with a residual, returns ``(norm(residual + x), residual + x)``.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, elementwise_affine: bool = True) -> None:
        super().__init__()
        self.hidden_size, self.eps = hidden_size, eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False) if elementwise_affine else None
        self.bias = nn.Parameter(torch.empty(hidden_size), requires_grad=False) if elementwise_affine else None

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> NormOut:
        if residual is not None:
            residual = residual + x
            return F.layer_norm(residual, (self.hidden_size,), self.weight, self.bias, self.eps), residual
        return F.layer_norm(x, (self.hidden_size,), self.weight, self.bias, self.eps)
