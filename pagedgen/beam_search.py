"""Beam search parameters and outputs, with vLLM's names (``vllm.sampling_params.BeamSearchParams``,
``vllm.beam_search.BeamSearchOutput``)."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Union


@dataclass(frozen=True)
class BeamSearchParams:
    """How to run beam search for each prompt.

    Attributes:
        beam_width: beams kept per prompt (>= 1).
        max_tokens: most tokens generated per beam (>= 1).
        ignore_eos: EOS does not end a beam (beams then end at max_tokens).
        length_penalty: a finished beam scores ``sum of log-probabilities / length ** length_penalty``,
            length counting generated tokens (EOS included), as in transformers.
        early_stopping: transformers' ``early_stopping``: True stops once ``beam_width`` beams have
            finished; False (the default) stops when no running beam can beat the worst finished one
            at its current length; "never" only when none could at its best possible length.
        structured_outputs: must stay None: beam search with a grammar constraint is refused
            (vLLM does not offer it either; sample with ``SamplingParams(n=..., structured_outputs=...)``).

    Raises:
        ValueError / TypeError: a field outside its range or of the wrong type (naming the field).
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    early_stopping: Union[bool, str] = False
    structured_outputs: None = None

    def __post_init__(self) -> None:
        if self.structured_outputs is not None:
            raise ValueError("BeamSearchParams.structured_outputs: beam search with a structured-output constraint is not "
                             "supported (vLLM does not offer it either); use SamplingParams(n=..., structured_outputs=...)")
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"BeamSearchParams.{name} must be an int, got {type(value).__name__}")
            value = int(value)  # numpy's ints too (a value read from an array)
            object.__setattr__(self, name, value)  # frozen
            if value < 1:
                raise ValueError(f"BeamSearchParams.{name} must be at least 1, got {value}")
        if isinstance(self.length_penalty, bool) or not isinstance(self.length_penalty, (int, float)):
            raise TypeError("BeamSearchParams.length_penalty must be a number")
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"BeamSearchParams.length_penalty must be a finite number, got {self.length_penalty}")
        if not isinstance(self.ignore_eos, bool):
            raise TypeError("BeamSearchParams.ignore_eos must be a bool")
        if not (self.early_stopping is True or self.early_stopping is False or self.early_stopping == "never"):
            raise ValueError(f"BeamSearchParams.early_stopping must be True, False or 'never', got {self.early_stopping!r}")


@dataclass
class BeamSearchSequence:
    """One finished beam.

    Attributes:
        tokens: prompt token ids followed by the generated ones (vLLM's convention).
        output_token_ids: the generated token ids only.
        text: the generated text.
        cum_logprob: sum of the log-probabilities of the generated tokens.
        score: ``cum_logprob / len(output_token_ids) ** length_penalty``; beams are ranked by it.
        finish_reason: "stop" (EOS) or "length" (max_tokens or max_model_len).
    """

    tokens: list[int]
    output_token_ids: list[int]
    text: str
    cum_logprob: float
    score: float
    finish_reason: str


@dataclass
class BeamSearchOutput:
    """The beams of one prompt, best first (at most ``beam_width``)."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)
