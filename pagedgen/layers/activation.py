"""Activation functions by their Hugging Face config names (``hidden_act``, ``activation_function``),
computed exactly as transformers' ``ACT2FN`` computes them, and the gated form ``act(gate) * up``.

SwiGLU (``silu`` gated, Shazeer 2020) runs as ``ops.silu_and_mul`` (one pass over the rows); the
other activations are the PyTorch functions transformers calls.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedgen import ops
from pagedgen.layers.module import Module


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    # transformers' NewGELUActivation (GPT-2's tanh approximation, written out: not bitwise
    # F.gelu(approximate="tanh"))
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


#: config name -> function, as transformers' ACT2FN maps them.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "relu": F.relu,
    "gelu": F.gelu,  # exact (erf)
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_new": _gelu_new,
}


def get_act_fn(name: str, field: str = "hidden_act") -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation called ``name`` in config.json's ``field``. Raises ValueError naming the field
    and the supported names."""
    if name not in ACTIVATIONS:
        raise ValueError(f"config.json {field}={name!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class ActAndMul(Module):
    """Gated activation of a fused [gate | up] projection: ``[T, 2d] -> [T, d] = act(gate) * up``.

    ``silu`` (SwiGLU, Llama) runs as ``ops.silu_and_mul``; others (GeGLU with ``gelu_pytorch_tanh``,
    Gemma) as transformers' ``act_fn(gate_proj(x)) * up_proj(x)``.
    """

    def __init__(self, act: str, field: str = "hidden_act") -> None:
        super().__init__()
        self.fn = get_act_fn(act, field)
        self.fused = self.fn is F.silu

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        d = gate_up.shape[-1] // 2
        if self.fused:
            out = torch.empty(gate_up.shape[0], d, dtype=gate_up.dtype, device=gate_up.device)  # [T, d]
            ops.silu_and_mul(out, gate_up)
            return out
        # the gate half made contiguous: F.gelu takes oneDNN's kernel on contiguous float32 input and
        # ATen's on strided, whose bits differ, so a strided gate would make a row's bits depend on the
        # batch (one row of a slice is contiguous); transformers' gate_proj output is contiguous too
        return self.fn(gate_up[:, :d].contiguous()) * gate_up[:, d:]
