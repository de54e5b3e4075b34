"""``SpeculativeConfig``: ``LLM(speculative_config={...})``, vLLM's names, checked once.

    {"method": "ngram" | "draft_model",        required
     "num_speculative_tokens": k,              required, 1 <= k <= MAX_SPECULATIVE_TOKENS
     "model": path,                            draft_model only (required there): a checkpoint folder
     "prompt_lookup_min": n, "prompt_lookup_max": m,   ngram only, 1 <= n <= m <= MAX_LOOKUP;
                                               one given: the other equals it; none: both 5 (vLLM's rule)
     "disable_by_batch_size": B}               None, or >= 2: no proposals in a step with >= B running
                                               sequences (speculation costs at full batches)

Every field is checked before any work starts: TypeError for a wrong type, ValueError naming the
field and its allowed range (unknown keys list the allowed ones).
"""
from __future__ import annotations

import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Optional

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 32
MAX_LOOKUP = 1024
DEFAULT_LOOKUP = 5  # vLLM's default when neither prompt_lookup_min nor prompt_lookup_max is given


@dataclass(frozen=True)
class SpeculativeConfig:
    """A checked speculative-decoding configuration (build it with ``from_dict``)."""

    method: str
    num_speculative_tokens: int
    model: Optional[str] = None
    prompt_lookup_min: Optional[int] = None
    prompt_lookup_max: Optional[int] = None
    disable_by_batch_size: Optional[int] = None

    @classmethod
    def from_dict(cls, values) -> "SpeculativeConfig":
        """The config of ``LLM(speculative_config=values)`` (a dict or any mapping, or a
        SpeculativeConfig, returned after the same checks). Raises TypeError / ValueError naming the
        field; FileNotFoundError for a draft folder that does not exist."""
        if isinstance(values, SpeculativeConfig):
            values = {f.name: getattr(values, f.name) for f in fields(values)}
        if not isinstance(values, Mapping):
            raise TypeError(f"LLM speculative_config must be a dict, got {type(values).__name__}")
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(str(k) for k in values if k not in allowed)
        if unknown:
            raise ValueError(f"LLM speculative_config has unknown keys {unknown}; allowed: {allowed}")
        for name in ("method", "num_speculative_tokens"):
            if values.get(name) is None:
                raise ValueError(f"LLM speculative_config needs {name!r}")
        method = values["method"]
        if not isinstance(method, str):
            raise TypeError(f"LLM speculative_config['method'] must be a str, one of {METHODS}; got {type(method).__name__}")
        if method not in METHODS:
            raise ValueError(f"LLM speculative_config['method'] must be one of {METHODS}, got {method!r}")
        k = _int(values, "num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
        batch = values.get("disable_by_batch_size")
        if batch is not None:
            batch = _int(values, "disable_by_batch_size", 2, None)
        model = values.get("model")
        lo, hi = values.get("prompt_lookup_min"), values.get("prompt_lookup_max")
        if method == "ngram":
            if model is not None:
                raise ValueError(f"LLM speculative_config['model'] is for method 'draft_model' only; method 'ngram' takes none, got {model!r}")
            if lo is not None:
                lo = _int(values, "prompt_lookup_min", 1, MAX_LOOKUP)
            if hi is not None:
                hi = _int(values, "prompt_lookup_max", 1, MAX_LOOKUP)
            lo, hi = (DEFAULT_LOOKUP, DEFAULT_LOOKUP) if lo is None and hi is None else (lo or hi, hi or lo)
            if lo > hi:
                raise ValueError(f"LLM speculative_config['prompt_lookup_min'] must be <= prompt_lookup_max ({hi}), got {lo}")
        else:
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if values.get(name) is not None:
                    raise ValueError(f"LLM speculative_config[{name!r}] is for method 'ngram' only, not 'draft_model'")
            if model is None:
                raise ValueError("LLM speculative_config needs 'model' (the draft checkpoint folder) for method 'draft_model'")
            if not isinstance(model, (str, os.PathLike)):
                raise TypeError(f"LLM speculative_config['model'] must be a folder path, got {type(model).__name__}")
            model = os.fspath(model)
            if not model:
                raise ValueError("LLM speculative_config['model'] must be the draft checkpoint folder, got an empty path")
            if os.path.exists(model) and not os.path.isdir(model):
                raise ValueError(f"LLM speculative_config['model'] must be the draft checkpoint folder, got a file: {model!r}")
            if not os.path.isdir(model):
                raise FileNotFoundError(f"LLM speculative_config['model']: draft model folder not found: {model!r}")
        return cls(method, k, model, lo, hi, batch)


def _int(values: dict, name: str, low: int, high: Optional[int]) -> int:
    value = values[name]
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):  # numpy ints are ints; True is not
        raise TypeError(f"LLM speculative_config[{name!r}] must be an int, got {type(value).__name__}")
    value = int(value)
    if value < low or (high is not None and value > high):
        allowed = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"LLM speculative_config[{name!r}] must be {allowed}, got {value}")
    return value


def check_draft_vocab(draft_vocab_size: int, target_vocab_size: int, draft_path: str) -> None:
    """A draft must share the target's vocabulary (its token ids are the target's proposals)."""
    if draft_vocab_size != target_vocab_size:
        raise ValueError(
            f"LLM speculative_config['model'] {draft_path!r} has vocab_size {draft_vocab_size}, the target "
            f"has {target_vocab_size}: a draft model must share the target's tokenizer and vocabulary"
        )
