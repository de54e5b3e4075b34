"""``PoolingParams`` (vLLM's ``vllm.pooling_params``), ``PoolerConfig`` and the checked per-request
``PoolingSpec`` that a pooling request carries through the engine. Plain data, no torch: the
scheduler's side (``pagedgen/core``) reads ``PoolingSpec.needs_all_rows``.

Tasks (vLLM's ``PoolingTask`` names):
    embed           the pooled final hidden state [hidden] (or its first ``dimensions``), L2-normalised
                    unless ``normalize=False``
    classify        the classification head over the pooled hidden state [num_labels], softmax
                    (sigmoid for one label) unless ``use_activation=False``
    score           ``classify`` of a cross-encoder with one label: sigmoid(logit) [1]
    token_embed     every prompt token's final hidden state [num_tokens, hidden], normalised
    token_classify  the head over every prompt token [num_tokens, num_labels] (``LLM.reward``), raw
                    unless ``use_activation=True``
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

POOLING_TASKS = ("embed", "classify", "score", "token_embed", "token_classify")
POOLING_TYPES = ("LAST", "MEAN", "CLS", "ALL", "STEP")


@dataclass
class PoolingParams:
    """Per-request pooling options, vLLM's fields.

    Attributes:
        dimensions: keep the first ``dimensions`` features of an embedding (matryoshka
            representation learning); only for models whose config.json declares
            ``is_matryoshka`` or ``matryoshka_dimensions``; 1 <= dimensions <= hidden_size.
        normalize: L2-normalise embeddings (default: the pooler config's, True for embeddings).
        use_activation: softmax / sigmoid over classification logits (default: True for
            ``classify`` and ``score``, False for ``token_classify``).
        task: the pooling task (set by ``LLM.embed`` / ``classify`` / ...; ``LLM.encode`` takes it
            as ``pooling_task``).
    """

    dimensions: Optional[int] = None
    normalize: Optional[bool] = None
    use_activation: Optional[bool] = None
    task: Optional[str] = None


@dataclass(frozen=True)
class PoolerConfig:
    """How the model pools (vLLM's ``PoolerConfig``; ``LLM(pooler_config=...)``).

    Attributes:
        pooling_type: LAST (the last prompt token), MEAN (the mean over the prompt), CLS (the first
            token), ALL (every token), STEP (every token whose id is ``step_tag_id``). Default: LAST
            for decoders.
        normalize: the default of ``PoolingParams.normalize`` for embeddings (True).
        step_tag_id: STEP's marker token (None: every token).
        returned_token_ids: STEP / token_classify: keep only these output columns (None: all).
    """

    pooling_type: str = "LAST"
    normalize: bool = True
    step_tag_id: Optional[int] = None
    returned_token_ids: Optional[tuple[int, ...]] = None

    @classmethod
    def from_arg(cls, value) -> "PoolerConfig":
        """A PoolerConfig from ``LLM(pooler_config=...)``: None, a PoolerConfig or a dict of its
        fields. TypeError / ValueError naming ``pooler_config`` and the field."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            cfg = value
        elif isinstance(value, dict):
            unknown = sorted(set(value) - {"pooling_type", "normalize", "step_tag_id", "returned_token_ids"})
            if unknown:
                raise ValueError(f"LLM pooler_config has unknown fields {unknown}; allowed: pooling_type, normalize, step_tag_id, returned_token_ids")
            ids = value.get("returned_token_ids")
            cfg = cls(**{**value, "returned_token_ids": tuple(ids) if isinstance(ids, (list, tuple)) else ids})
        else:
            raise TypeError(f"LLM pooler_config must be a dict or a PoolerConfig, got {type(value).__name__}")
        kind = cfg.pooling_type.upper() if isinstance(cfg.pooling_type, str) else cfg.pooling_type
        if kind not in POOLING_TYPES:
            raise ValueError(f"LLM pooler_config.pooling_type must be one of {POOLING_TYPES}, got {cfg.pooling_type!r}")
        if not isinstance(cfg.normalize, bool):
            raise TypeError(f"LLM pooler_config.normalize must be a bool, got {type(cfg.normalize).__name__}")
        if cfg.step_tag_id is not None and (isinstance(cfg.step_tag_id, bool) or not isinstance(cfg.step_tag_id, int) or cfg.step_tag_id < 0):
            raise ValueError(f"LLM pooler_config.step_tag_id must be a token id >= 0 or None, got {cfg.step_tag_id!r}")
        ids = cfg.returned_token_ids
        if ids is not None and (not ids or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids)):
            raise ValueError(f"LLM pooler_config.returned_token_ids must be a non-empty list of column ids >= 0, got {ids!r}")
        return cls(kind, cfg.normalize, cfg.step_tag_id, ids)


@dataclass(frozen=True)
class PoolingSpec:
    """One request's checked pooling: what the worker computes for it (``worker/pooler.py``).

    ``pooling_type`` is the model's (``PoolerConfig``), ALL for the token tasks; ``head``: apply
    the classification head; ``activation``: "softmax", "sigmoid" or None; ``dimensions``: None or
    the features kept; ``normalize``: L2 over the features kept; ``whole_prompt``: an encoder's
    request, whose prompt the scheduler computes in one step (no chunks, no prefix cache)."""

    task: str
    pooling_type: str
    head: bool
    activation: Optional[str]
    normalize: bool
    dimensions: Optional[int] = None
    step_tag_id: Optional[int] = None
    returned_token_ids: Optional[tuple[int, ...]] = None
    whole_prompt: bool = False  # an encoder's (bidirectional attention): computed in one step, never chunked
    token_type_start: Optional[int] = None  # an encoder cross-encoder's pair: token type 1 from this position on

    @property
    def needs_all_rows(self) -> bool:
        """Whether every prompt position's hidden state is needed (not only the last): such a
        request skips the prefix cache, whose hits are not computed."""
        return self.pooling_type != "LAST" or self.whole_prompt
