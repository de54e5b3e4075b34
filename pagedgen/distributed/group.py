"""Groups of ranks handed to the layers and the model runner (never read from a global).

``TPGroup``: one tensor-parallel rank's view of its group (``comm``: the object that moves data
between the ranks, communicator.py: gloo through torch.distributed, or the shared-memory
all-reduce; None in a model built only to check its shapes, on the meta device).

``PPGroup``: one pipeline stage's view: its stage index, the number of stages, the decoder layers
``[start, end)`` it holds, and the channels to the previous and next stage (p2p.py). Rank layout
over ``tensor_parallel_size`` x ``pipeline_parallel_size`` ranks (vLLM's):

    rank = pp_rank * tensor_parallel_size + tp_rank

so the TP ranks of one stage are consecutive, and stage s's TP rank t sends its activations to
rank ``(s + 1) * tp + t``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class TPGroup:
    """Attributes: rank (0 .. size - 1), size (tensor_parallel_size), comm (all_reduce(t) in place,
    all_gather(t) -> [size * rows...] along the last dim)."""

    rank: int
    size: int
    comm: Any = None


def tp_size(tp: Optional[TPGroup]) -> int:
    return 1 if tp is None else tp.size


def tp_rank(tp: Optional[TPGroup]) -> int:
    return 0 if tp is None else tp.rank


def shard_size(total: int, tp: Optional[TPGroup], what: str) -> int:
    """``total / size``; ValueError naming ``what`` when it does not divide."""
    n = tp_size(tp)
    if total % n:
        raise ValueError(f"tensor_parallel_size={n} must divide {what} ({total})")
    return total // n


def stage_layers(num_layers: int, size: int, rank: int) -> tuple[int, int]:
    """The decoder layers ``[start, end)`` of pipeline stage ``rank`` of ``size``: vLLM's split
    (``vllm.distributed.utils.get_pp_indices``): ``num_layers // size`` each, the remainder one
    more each on the stages before the last (the last also runs the final norm and the head), e.g.
    5 layers over 2 stages: [0, 3) and [3, 5).

    Raises:
        ValueError: more stages than layers (a stage without a layer), naming both.
    """
    if size > num_layers:
        raise ValueError(f"LLM pipeline_parallel_size={size} must be <= num_hidden_layers ({num_layers}) of the model")
    counts = [num_layers // size] * size
    for i in range(2, num_layers % size + 2):
        counts[-i] += 1
    start = sum(counts[:rank])
    return start, start + counts[rank]


@dataclass(frozen=True)
class PPGroup:
    """One pipeline stage: ``rank`` (0 .. size - 1), ``size`` (pipeline_parallel_size), its
    decoder layers ``[start, end)``; ``prev`` / ``next``: the channels from the previous and to the
    next stage (``recv() -> tuple of tensors``, ``send(tensors)``; None at the ends, and in a model
    built only to check its shapes)."""

    rank: int
    size: int
    start: int
    end: int
    prev: Any = None
    next: Any = None

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    @property
    def num_layers(self) -> int:
        return self.end - self.start


def pp_size(pp: Optional[PPGroup]) -> int:
    return 1 if pp is None else pp.size
