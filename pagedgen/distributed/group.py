"""``TPGroup``: one tensor-parallel rank's view of its group, handed to the sharded layers.

``comm`` is the object that moves data between the ranks (communicator.py: gloo through
torch.distributed, or the shared-memory all-reduce); None in a model built only to check its
shapes (the driver builds one on the meta device before any process starts).
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
