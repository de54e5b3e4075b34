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
            param.copy_(loaded)


def weight_loader(param: nn.Parameter):
    """The loader of ``param``: its own ``weight_loader`` or ``default_weight_loader``."""
    return getattr(param, "weight_loader", default_weight_loader)
