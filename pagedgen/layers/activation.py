"""Activation functions by their Hugging Face config names (``hidden_act``, ``activation_function``),
computed exactly as transformers' ``ACT2FN`` computes them, and the gated form ``act(gate) * up``.

SwiGLU (``silu`` gated, Shazeer 2020) runs as ``ops.silu_and_mul`` (one pass over the rows) and the
exact GELU (``gelu``) as ``ops.gelu`` where their CPU kernels run; the other activations are the
PyTorch functions transformers calls.
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


def _gelu_kernel_runs(x: torch.Tensor) -> bool:
    return ops.has_kernel("gelu", x.device.type) and x.is_contiguous() and x.dtype in (torch.float32, torch.bfloat16, torch.float16)


def gelu(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``"gelu"`` (exact, erf form): ``ops.gelu``'s CPU kernel (one vectorized pass,
    within a few float32 ulps of F.gelu) on contiguous float rows, else F.gelu. Returns a new tensor."""
    if not _gelu_kernel_runs(x):
        return F.gelu(x)
    out = torch.empty_like(x)
    ops.gelu(out, x)
    return out


def gelu_(x: torch.Tensor) -> torch.Tensor:
    """``gelu`` written over ``x`` itself where the kernel runs (no new tensor; for a layer's own
    fresh output, e.g. BERT's intermediate), else a new tensor. Returns the result; ``x`` is not to
    be read again."""
    if not _gelu_kernel_runs(x):
        return F.gelu(x)
    ops.gelu(x, x)
    return x


#: config name -> function, as transformers' ACT2FN maps them.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "relu": F.relu,
    "gelu": gelu,  # exact (erf)
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_new": _gelu_new,
}


#: the activations with a version that overwrites its input (``get_act_fn(..., inplace=True)``)
IN_PLACE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"gelu": gelu_}


def get_act_fn(name: str, field: str = "hidden_act", inplace: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation called ``name`` in config.json's ``field``. ``inplace``: the caller hands the
    function a tensor it will not read again, which it may overwrite (``IN_PLACE``). Raises ValueError
    naming the field and the supported names."""
    if name not in ACTIVATIONS:
        raise ValueError(f"config.json {field}={name!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    return IN_PLACE.get(name, ACTIVATIONS[name]) if inplace else ACTIVATIONS[name]


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
