"""Rotary position embedding (RoPE, Su et al. 2021): full or partial, neox or GPT-J style, with the
RoPE scaling types of transformers computed by transformers' own initialisers.

- neox style (Llama, GPT-NeoX, Phi-3...): the rotated features are split into two halves, ``x * cos
  + rotate_half(x) * sin`` (transformers' ``apply_rotary_pos_emb``). Runs as ``ops.rotary_embedding``,
  in place on the q/k views, bitwise transformers'.
- GPT-J style: features rotated in adjacent pairs (2i, 2i + 1) (transformers' GPT-J
  ``rotate_every_two``); plain PyTorch.
- partial (``partial_rotary_factor`` < 1, GPT-NeoX's ``rotary_pct``): only the first ``rotary_dim``
  features of each head rotate, the rest pass through.

The inverse frequencies come from ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`` (linear,
llama3, yarn, ...) or the default ``1 / base^(2i / rotary_dim)``. Types whose frequencies change
with the running sequence length (``dynamic``, ``longrope``) cannot be one static table and are
refused with an error naming the config field.
"""
from __future__ import annotations

from typing import Optional

import torch

from pagedgen import ops
from pagedgen.layers.module import Module

#: Rope types transformers recomputes from the current sequence length in every forward pass.
_LENGTH_DEPENDENT = ("dynamic", "longrope")


def rope_parameters(hf_config) -> dict:
    """The config's RoPE parameters (``rope_parameters``, transformers 5; ``rope_scaling`` plus
    ``rope_theta`` in older configs), with ``rope_type`` always set."""
    rope = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    rope.setdefault("rope_type", rope.get("type", "default"))
    if "rope_theta" not in rope and getattr(hf_config, "rope_theta", None) is not None:
        rope["rope_theta"] = hf_config.rope_theta
    return rope


def supported_rope_types() -> list[str]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ["default"] + [t for t in ROPE_INIT_FUNCTIONS if not any(d in t for d in _LENGTH_DEPENDENT)]


def inverse_frequencies(hf_config, head_dim: int) -> tuple[torch.Tensor, float, int]:
    """(inv_freq [rotary_dim / 2] float32, attention scaling, rotary_dim) for ``hf_config``.

    Raises:
        ValueError: the rope type depends on the sequence length or is unknown (naming
            ``rope_parameters.rope_type`` and the supported types).
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = rope_parameters(hf_config)
    rope_type = rope["rope_type"]
    rotary_dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    if rope_type not in supported_rope_types():
        why = "its frequencies change with the sequence length" if rope_type in ROPE_INIT_FUNCTIONS else "unknown type"
        raise ValueError(
            f"config.json rope_parameters.rope_type={rope_type!r} is not supported ({why}); "
            f"supported: {', '.join(supported_rope_types())}"
        )
    with torch.device("cpu"):  # real tensors even while the model is built on the meta device
        if rope_type == "default":
            base = rope.get("rope_theta", 10000.0)
            inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
            return inv_freq, 1.0, rotary_dim
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    return inv_freq.float(), float(scaling), 2 * inv_freq.shape[0]


def cos_sin_tables(inv_freq: torch.Tensor, scaling: float, max_positions: int, neox_style: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_positions, rotary_dim] float32 as transformers computes them (position times
    inverse frequency in float32, times the attention scaling). neox: the frequencies repeated as two
    halves; GPT-J: each repeated for its pair of features."""
    with torch.device("cpu"):
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [P, rotary_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1) if neox_style else freqs.repeat_interleave(2, dim=-1)  # [P, rotary_dim]
        return emb.cos() * scaling, emb.sin() * scaling


def rope_cos_sin(hf_config, head_dim: int, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [max_positions, rotary_dim] float32 of ``hf_config``'s neox-style RoPE."""
    inv_freq, scaling, _ = inverse_frequencies(hf_config, head_dim)
    return cos_sin_tables(inv_freq, scaling, max_positions)


class RotaryEmbedding(Module):
    """Rotates the first ``rotary_dim`` features of every query and key head by its position.

    Args:
        head_dim: features per head.
        rotary_dim: features that rotate (even, <= head_dim).
        max_positions: table length (positions 0 .. max_positions - 1).
        inv_freq: [rotary_dim / 2] float32 inverse frequencies; scaling: cos/sin multiplier.
        neox_style: rotate halves (True) or adjacent pairs (False, GPT-J).

    The tables are buffers (float32 [max_positions, rotary_dim]), not checkpoint weights. One
    instance is shared by all layers of a model.
    """

    def __init__(self, head_dim: int, rotary_dim: int, max_positions: int, inv_freq: torch.Tensor, scaling: float = 1.0, neox_style: bool = True) -> None:
        super().__init__()
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim must be even and in (0, head_dim={head_dim}], got {rotary_dim}")
        self.head_dim, self.rotary_dim, self.neox_style = head_dim, rotary_dim, neox_style
        cos, sin = cos_sin_tables(inv_freq, scaling, max_positions, neox_style)
        self.register_buffer("cos", cos, persistent=False)  # [max_positions, rotary_dim] float32
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        """Rotate q [T, H, head_dim] and k [T, Hkv, head_dim] in place; positions [T] int64."""
        if self.rotary_dim < self.head_dim:
            q, k = q[..., : self.rotary_dim], k[..., : self.rotary_dim]  # views: the rest passes through
        if self.neox_style:
            ops.rotary_embedding(positions, q, k, self.cos, self.sin)
            return
        cos = self.cos[positions].to(q.dtype).unsqueeze(1)  # [T, 1, rotary_dim]
        sin = self.sin[positions].to(q.dtype).unsqueeze(1)
        for x in (q, k):
            pairs = x.unflatten(-1, (-1, 2))  # [T, heads, rotary_dim / 2, 2]
            rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
            x.copy_(x * cos + rotated * sin)


def get_rope(hf_config, head_dim: int, max_positions: Optional[int] = None, neox_style: bool = True) -> RotaryEmbedding:
    """The RotaryEmbedding ``hf_config`` describes (rope type, theta, partial factor, scaling);
    ``max_positions`` defaults to ``max_position_embeddings``. Raises ValueError for a rope type
    it cannot honour."""
    inv_freq, scaling, rotary_dim = inverse_frequencies(hf_config, head_dim)
    return RotaryEmbedding(head_dim, rotary_dim, max_positions or hf_config.max_position_embeddings, inv_freq, scaling, neox_style)
