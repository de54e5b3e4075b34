"""The LoRA delta of one adapted projection, for every row of a step whatever its adapter slot.

A projection ``y = x W^T`` (``LinearBase``, layers/linear.py) with ``P`` parts along its output
features (q/k/v: 3, gate/up: 2, o/down: 1) gets, for each row whose sequence has the adapter in slot s:

    y[row] += (x[row] @ A[s]) @ B[s]                 shrink, then expand (punica's SGMV)
    A[s]: [in_features, P * R]                       part p's lora_A^T in columns [p R, p R + r)
    B[s]: [R, out_features]                          part p's (lora_B * scale)^T in rows [0, r) of
                                                     its output columns (the part's h[p R : p R + R])

R = ``max_lora_rank``; the zero rows and columns of a smaller rank or an untargeted part add exact
zeros. Rows of the base model (slot -1) get nothing. One op per projection and step,
``ops.add_lora_linear`` (csrc/cpu/lora.cpp: the rows tiled by slot, each slot's A and B read once per
tile, the shrink kept in float32, each row's sums in a fixed order: a row's delta has the same bits
whatever the other rows; docs/lora.md, docs/determinism.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from pagedgen import ops


@dataclass
class LoRABatch:
    """The step's adapter slot of each row, shared by every adapted layer (set by ``LoRAManager.prepare``).

    ``slots``: [T] int32 on the model's device, each row's slot (-1: the base model), or None when no
    row has an adapter (the layers then add nothing). ``used``: the slots the step's rows use.
    """

    slots: Optional[torch.Tensor] = None
    used: frozenset = field(default_factory=frozenset)


class LoRALayer:
    """The adapter slots of one projection (``layer.lora``; ``LinearBase.forward`` calls ``add_delta``).

    Args:
        base: the projection (its ``input_size``, ``output_shards`` / ``output_size``, and its weight's
            dtype and device), after ``prepare_matmuls``. Under tensor parallelism A and B are sharded
            like the weight they adapt: a column-parallel projection keeps A whole and its rows of each
            part's B; a row-parallel one its columns of A and B whole, its partial delta added before
            the all-reduce (which sums the shrink).
        num_parts: its parts along the output features (1, 2 or 3).
        max_loras, max_rank: the slots and their width.
        batch: the step's row slots (shared).

    ``a`` [max_loras, in, P R] and ``b`` [max_loras, R, out] are allocated once (vLLM's stacked
    ``lora_a_stacked`` / ``lora_b_stacked``), in the base weight's dtype (float32 over int8 / FP8
    weights); an empty slot is zeros.
    """

    def __init__(self, base, num_parts: int, max_loras: int, max_rank: int, batch: LoRABatch) -> None:
        self.base, self.batch, self.rank, self.num_parts = base, batch, max_rank, num_parts
        sizes = list(base.output_shards.values()) or [base.output_size]
        assert len(sizes) == num_parts, (sizes, num_parts)
        self.part_offsets = [sum(sizes[:p]) for p in range(num_parts)]
        self.part_sizes = sizes
        w = base.weight
        dtype = w.dtype if w.is_floating_point() and w.element_size() > 1 else torch.float32  # int8 / FP8 weights: A and B stay float
        self.a = torch.zeros(max_loras, base.input_size, num_parts * max_rank, dtype=dtype, device=w.device)  # [S, in, P R]
        self.b = torch.zeros(max_loras, max_rank, base.output_size, dtype=dtype, device=w.device)  # [S, R, out]
        self.loaded = [False] * max_loras  # whether the slot's adapter adapts this projection

    def set_slot(self, slot: int, parts: dict, scale: float) -> None:
        """Load one adapter into ``slot``: ``parts`` {part index: (A [r, in], B [out_part, r]) float32}; none: it adapts nothing here."""
        self.clear_slot(slot)
        if not parts:
            return
        R, base = self.rank, self.base
        a = torch.zeros(base.input_size, self.num_parts * R)  # [in, P R] float32 (per rank)
        b = torch.zeros(R, base.output_size)  # [R, out]
        for p, (pa, pb) in parts.items():
            r = pa.shape[0]
            if base.tp is not None and base.tp_split == "in":  # row-parallel: this rank's input columns of A
                pa = pa.narrow(1, base.tp.rank * base.input_size, base.input_size)
            elif base.tp is not None:  # column-parallel: this rank's rows of the part's B, as of its weight
                pb = pb.narrow(0, base.tp.rank * self.part_sizes[p], self.part_sizes[p])
            a[:, p * R : p * R + r] = pa.t()
            off = self.part_offsets[p]
            b[:r, off : off + self.part_sizes[p]] = (pb * scale).t()  # scale folded in float32, rounded once
        self.a[slot].copy_(a)
        self.b[slot].copy_(b)
        self.loaded[slot] = True

    def clear_slot(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.loaded[slot] = False

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y [T, out] += each row's delta (in place); x [T, in] (the projection's input)."""
        slots = self.batch.slots
        if slots is None or not any(self.loaded[s] for s in self.batch.used):  # no row's adapter adapts this projection
            return
        ops.add_lora_linear(y, x if x.stride(-1) == 1 else x.contiguous(), self.a, self.b, slots, self.part_sizes)


def lora_layers(model) -> list[tuple[int, str, object]]:
    """(layer index, attribute path, projection) of each projection LoRA can adapt in ``model``'s
    decoder layers (the Llama family's ``self_attn.qkv_proj``, ``o_proj``, ``mlp.gate_up_proj``,
    ``down_proj``); ValueError when the model has none of that shape."""
    out = []
    layers = getattr(getattr(model, "model", None), "layers", None)
    for i, layer in enumerate(layers or ()):
        for path in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            obj: Optional[object] = layer
            for name in path.split("."):
                obj = getattr(obj, name, None)
            if obj is None:
                raise ValueError(f"LLM enable_lora: {type(model).__name__} has no {path} in decoder layer {i}: "
                                 "LoRA runs on the Llama family (Llama, Mistral, Qwen2/3, Gemma)")
            out.append((i, path, obj))
    if not out:
        raise ValueError(f"LLM enable_lora: {type(model).__name__} has no decoder layers LoRA can adapt")
    return out
