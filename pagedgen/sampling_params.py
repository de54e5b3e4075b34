"""Sampling parameters of one request, with vLLM's names, defaults and meanings.

Source: vLLM ``vllm.SamplingParams`` (offline API) and Hugging Face ``GenerationConfig``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

_GREEDY_EPS = 1e-5  # temperature below this means greedy, as in vLLM


def _check(cond: bool, field_name: str, allowed: str, value) -> None:
    if not cond:
        raise ValueError(f"SamplingParams.{field_name} must be {allowed}, got {value!r}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """How to sample the completion of one prompt.

    Attributes:
        temperature: softmax temperature; 0 means greedy (argmax). Range [0, inf). Default 1.0.
        top_p: keep the smallest set of most likely tokens whose probability sums to at least top_p.
            Range (0, 1]. Default 1.0 (off).
        top_k: keep the k most likely tokens; 0 or -1 means all. Default 0 (off).
        seed: seed of this request's own random generator; the same seed gives the same completion
            whatever else shares the batch. None: the engine's generator (seeded by ``LLM(seed=...)``).
        max_tokens: most tokens to generate (>= 1). Default 16, as in vLLM.
        stop_token_ids: token ids that end the completion (kept in ``token_ids``), besides EOS.
        ignore_eos: keep generating after the EOS token.

    Raises:
        ValueError: a field outside its range (the message names the field and the range).
        TypeError: a field of the wrong type.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16
    stop_token_ids: Optional[list[int]] = field(default=None)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"SamplingParams.{name} must be a number, got {type(value).__name__}")
            setattr(self, name, float(value))
        for name in ("top_k", "seed", "max_tokens"):
            value = getattr(self, name)
            if value is not None and not _is_int(value):
                raise TypeError(f"SamplingParams.{name} must be an int, got {type(value).__name__}")
        _check(self.temperature >= 0.0 and self.temperature != float("inf"), "temperature", "in [0, inf)", self.temperature)
        _check(0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]", self.top_p)
        _check(self.top_k >= -1, "top_k", "-1, 0 (all tokens) or a positive int", self.top_k)
        if self.top_k == -1:
            self.top_k = 0
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "at least 1 (or None)", self.max_tokens)
        if self.seed is not None:
            _check(-(2**63) <= self.seed < 2**64, "seed", "a 64-bit integer", self.seed)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(_is_int(t) for t in self.stop_token_ids):
            raise TypeError("SamplingParams.stop_token_ids must be a list of int")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "non-negative token ids", self.stop_token_ids)
        self.stop_token_ids = list(self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            raise TypeError("SamplingParams.ignore_eos must be a bool")

    @property
    def greedy(self) -> bool:
        """True when this request takes the argmax token at every step."""
        return self.temperature < _GREEDY_EPS

    def clone(self, **changes) -> "SamplingParams":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)
