"""The LoRA delta of one adapted projection, for a step's rows grouped by adapter.

A projection ``y = x W^T`` (``LinearBase``, layers/linear.py) with ``P`` parts along its output
features (q/k/v: 3, gate/up: 2, o/down: 1) gets, for the rows of adapter slot s:

    y[rows] += (x[rows] @ A[s]^T) @ B[s]^T          shrink, then expand (punica's SGMV, per group)
    A[s]: [P * R, in_features]                      part p's lora_A in rows [p R, p R + r)
    B[s]: [out_features, P * R]                     part p's lora_B * scale in its output rows and
                                                    columns [p R, p R + r): block-diagonal, zeros elsewhere

R = ``max_lora_rank``; the zero rows and columns of a smaller rank or an untargeted part add exact
zeros. Rows of the base model (no adapter) get nothing. Both matmuls go through
``layers.matmul.linear`` with the projection's ``MatmulConfig``, so in batch-invariant mode each
row's delta has the same bits whatever the other rows of its group (docs/determinism.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from pagedgen.layers.matmul import linear, pack_pairs, pack_panels


@dataclass
class LoRABatch:
    """The step's rows grouped by adapter slot, shared by every adapted layer (set by ``LoRAManager.prepare``).

    ``groups``: (slot, its rows: indices [Tg] int64 on the model's device, a ``slice`` when they
    are one run, or None for every row of the step).
    Empty: no row has an adapter, and the layers add nothing.
    """

    groups: list = field(default_factory=list)


class LoRALayer:
    """The adapter slots of one projection (``layer.lora``; ``LinearBase.forward`` calls ``add_delta``).

    Args:
        base: the projection (its ``input_size``, ``output_shards`` / ``output_size``, ``matmul``
            config, and the device of its weight), after ``prepare_matmuls``. Under tensor
            parallelism A and B are sharded like the weight they adapt: a column-parallel
            projection keeps A whole and its rows of each part's B; a row-parallel one its columns
            of A and B whole, its partial delta added before the all-reduce (which sums the shrink).
        num_parts: its parts along the output features (1, 2 or 3).
        max_loras, max_rank: the slots and their width.
        batch: the step's row groups (shared).

    A slot's A and B are kept as the base weights are (``pack``: the config's dtype, in panels or
    bf16 pairs where the base's are), so the delta's matmuls are batch-invariant the same way.
    """

    def __init__(self, base, num_parts: int, max_loras: int, max_rank: int, batch: LoRABatch) -> None:
        self.base, self.batch, self.rank, self.num_parts = base, batch, max_rank, num_parts
        sizes = list(base.output_shards.values()) or [base.output_size]
        assert len(sizes) == num_parts, (sizes, num_parts)
        self.part_offsets = [sum(sizes[:p]) for p in range(num_parts)]
        self.part_sizes = sizes
        self.a: list = [None] * max_loras  # per slot: A [P R, in], packed as the base weight
        self.b: list = [None] * max_loras  # per slot: B * scale [out, P R], block-diagonal, packed

    def set_slot(self, slot: int, parts: dict, scale: float) -> None:
        """Load one adapter into ``slot``: ``parts`` {part index: (A [r, in], B [out_part, r]) float32}; none: it adapts nothing here."""
        if not parts:
            self.clear_slot(slot)
            return
        R, device, base = self.rank, self.base.weight.device, self.base
        a = torch.zeros(self.num_parts * R, base.input_size)  # [P R, in] float32 (per rank)
        b = torch.zeros(base.output_size, self.num_parts * R)  # [out, P R]
        for p, (pa, pb) in parts.items():
            r = pa.shape[0]
            if base.tp is not None and base.tp_split == "in":  # row-parallel: this rank's input columns of A
                pa = pa.narrow(1, base.tp.rank * base.input_size, base.input_size)
            elif base.tp is not None:  # column-parallel: this rank's rows of the part's B, as of its weight
                pb = pb.narrow(0, base.tp.rank * self.part_sizes[p], self.part_sizes[p])
            a[p * R : p * R + r] = pa
            off = self.part_offsets[p]
            b[off : off + self.part_sizes[p], p * R : p * R + r] = pb * scale  # scale folded in float32, rounded once
        config, w = self.base.matmul, self.base.weight
        dtype = w.dtype if w.is_floating_point() and w.element_size() > 1 else torch.float32  # int8 / FP8 weights: A and B stay float
        self.a[slot], self.b[slot] = pack(a.to(device), config, dtype), pack(b.to(device), config, dtype)

    def clear_slot(self, slot: int) -> None:
        self.a[slot] = self.b[slot] = None

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y [T, out] += each row's delta; x [T, in] (the projection's input)."""
        config, pr, out = self.base.matmul, self.num_parts * self.rank, self.base.output_size
        for slot, rows in self.batch.groups:
            a = self.a[slot]
            if a is None:  # the slot's adapter does not adapt this projection
                continue
            gather = isinstance(rows, torch.Tensor)
            xs = x.index_select(0, rows) if gather else x if rows is None else x[rows]  # [Tg, in]
            d = linear(linear(xs, a, None, config, pr), self.b[slot], None, config, out)  # [Tg, P R] -> [Tg, out]
            if gather:
                y.index_add_(0, rows, d)
            else:
                (y if rows is None else y[rows]).add_(d)


def pack(w: torch.Tensor, config, dtype: torch.dtype) -> torch.Tensor:
    """``w`` [N, K] float32 as ``prepare_matmuls`` keeps a weight under ``config``: its weight dtype,
    in panels or bf16 pairs when the config packs them; dense otherwise (no oneDNN prepack: the GEMM
    then runs in the config's row blocks). Without a config: ``dtype``, dense."""
    if config is None:
        return w.to(dtype)
    w = w.to(config.weight_dtype)
    if config.pairs:
        return pack_pairs(w)
    return pack_panels(w) if config.panels else w


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
