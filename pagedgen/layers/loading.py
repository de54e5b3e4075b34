"""How a checkpoint tensor is copied into a parameter: ``param.weight_loader(param, loaded,
shard_id)`` where a layer defines one (fused and re-laid-out weights, ``pagedgen.layers.linear``),
else ``default_weight_loader``. A loader given a ``meta`` tensor only checks the shape (the dry run
``pagedgen.model.weights`` makes before reading any data).
"""
from __future__ import annotations

import torch
from torch import nn


class WeightShapeError(ValueError):
    """A checkpoint tensor's shape is not the one the model's config implies.

    Attributes:
        shape: the checkpoint tensor's shape; expected: the shape config.json implies (both in the
            checkpoint's layout).
    """

    def __init__(self, shape: tuple, expected: tuple) -> None:
        super().__init__(f"has shape {shape}, but config.json implies {expected}")
        self.shape, self.expected = shape, expected


def check_shape(loaded: torch.Tensor, expected: tuple) -> bool:
    """Check ``loaded`` has the checkpoint-layout shape ``expected`` (WeightShapeError otherwise);
    True when there is data to copy (it is not a meta tensor)."""
    if tuple(loaded.shape) != tuple(expected):
        raise WeightShapeError(tuple(loaded.shape), tuple(expected))
    return not loaded.is_meta


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    """Copy ``loaded`` (same shape) into ``param``, converting to its dtype in the same pass."""
    if shard_id is not None:
        raise ValueError(f"parameter of shape {tuple(param.shape)} has no shard {shard_id!r}")
    if check_shape(loaded, tuple(param.shape)):
        with torch.no_grad():
            param.copy_(read(loaded))


def weight_loader(param: nn.Parameter):
    """The loader of ``param``: its own ``weight_loader`` or ``default_weight_loader``."""
    return getattr(param, "weight_loader", default_weight_loader)


class CheckpointSlice:
    """A checkpoint tensor not read yet (safetensors' ``get_slice``): ``narrow`` composes index
    ranges and ``load()`` reads only them, so a tensor-parallel rank reads only its shard."""

    def __init__(self, sl, ranges: tuple = None) -> None:
        self._sl = sl
        self._ranges = ranges if ranges is not None else tuple((0, n) for n in sl.get_shape())
        self.shape = torch.Size(n for _, n in self._ranges)
        self.is_meta = False

    def narrow(self, dim: int, start: int, length: int) -> "CheckpointSlice":
        r = list(self._ranges)
        off, n = r[dim]
        if start < 0 or start + length > n:
            raise IndexError(f"narrow({dim}, {start}, {length}) outside {n}")
        r[dim] = (off + start, length)
        return CheckpointSlice(self._sl, tuple(r))

    def load(self) -> torch.Tensor:
        return self._sl[tuple(slice(o, o + n) for o, n in self._ranges)]


def read(loaded) -> torch.Tensor:
    """The data of ``loaded``: a tensor as it is, a ``CheckpointSlice`` read."""
    return loaded.load() if isinstance(loaded, CheckpointSlice) else loaded
