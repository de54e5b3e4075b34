"""Pipeline stages of a model family: which modules a stage builds, and placeholders for the rest.

A family builds, for pipeline stage ``pp`` (``PPGroup``: layers ``[start, end)``), only

    the embedding(s)                       on the first stage
    decoder layers start .. end - 1        each stage (the others are ``PPMissingLayer``)
    the final norm (and projections) and the head   on the last stage

so a stage allocates and loads only its own weights (the loader skips the checkpoint tensors of
placeholders) and its model runner allocates the KV cache of its own layers only. Module names
keep the checkpoint's numbering (``model.layers.3....`` on the second of two stages of a 5-layer
model). vLLM's ``PPMissingLayer`` / ``make_layers`` pattern.

A stage's forward pass: the first stage embeds the tokens, every other stage starts from the
activations the previous one sent (``intermediate``: the hidden states, and the residual where the
family carries it apart, each ``[T, hidden]``); every stage but the last returns its activations
for the next one, the last the normalised rows at ``logits_indices``.
"""
from __future__ import annotations

from typing import Callable, Optional

from torch import nn

from pagedgen.distributed.group import PPGroup
from pagedgen.layers.module import Module


class PPMissingLayer(Module):
    """A module held by another pipeline stage: no parameters, never called."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this module belongs to another pipeline stage")


def make_layers(num_layers: int, build: Callable[[int], nn.Module], pp: Optional[PPGroup]) -> nn.ModuleList:
    """``[build(i) for i in range(num_layers)]`` with ``PPMissingLayer`` outside the stage's layers."""
    start, end = (0, num_layers) if pp is None else (pp.start, pp.end)
    return nn.ModuleList([build(i) if start <= i < end else PPMissingLayer() for i in range(num_layers)])


def stage_layers(layers: nn.ModuleList, pp: Optional[PPGroup]) -> tuple:
    """The stage's own layers of ``layers`` (a tuple: iterated every step)."""
    return tuple(layers) if pp is None else tuple(layers[pp.start : pp.end])


def is_first(pp: Optional[PPGroup]) -> bool:
    return pp is None or pp.is_first


def is_last(pp: Optional[PPGroup]) -> bool:
    return pp is None or pp.is_last


def on_first(pp: Optional[PPGroup], build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` on the first stage (or without stages), else a placeholder."""
    return build() if is_first(pp) else PPMissingLayer()


def on_last(pp: Optional[PPGroup], build: Callable[[], Optional[nn.Module]]):
    """``build()`` on the last stage (or without stages), else a placeholder."""
    return build() if is_last(pp) else PPMissingLayer()
