"""What ``LLM.encode``, ``embed``, ``classify``, ``score`` and ``reward`` return, with vLLM's class
and field names (``vllm.outputs``): a ``PoolingRequestOutput`` per prompt holding a
``PoolingOutput`` (the raw tensor), and the task views built from it (``EmbeddingRequestOutput``,
``ClassificationRequestOutput``, ``ScoringRequestOutput``) holding Python lists and floats."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, Optional, TypeVar

_O = TypeVar("_O")


@dataclass
class PoolingOutput:
    """``data``: a float32 CPU tensor: [hidden] (or [dimensions]) for an embedding, [num_labels]
    for a classification, [num_tokens, ...] for the token tasks (``LLM.reward``, ALL / STEP)."""

    data: Any

    def __repr__(self) -> str:
        return f"PoolingOutput(data=tensor(shape={list(self.data.shape)}))"


class PoolingRequestOutput(Generic[_O]):
    """One prompt's pooled result (vLLM's ``PoolingRequestOutput``).

    Attributes:
        request_id: its index in the call's input, as a str.
        outputs: a ``PoolingOutput`` (or a task's view of it).
        prompt_token_ids: the prompt as fed to the model.
        num_cached_tokens: prompt tokens found in the prefix cache (LAST pooling only; else 0).
        finished: always True.
        index: the prompt's position in the call's input (pagedgen's addition, as ``RequestOutput.index``).
    """

    def __init__(self, request_id: str, outputs: _O, prompt_token_ids: list[int], num_cached_tokens: int = 0,
                 finished: bool = True, index: Optional[int] = None) -> None:
        self.request_id = request_id
        self.outputs = outputs
        self.prompt_token_ids = prompt_token_ids
        self.num_cached_tokens = num_cached_tokens
        self.finished = finished
        self.index = index

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(request_id={self.request_id!r}, outputs={self.outputs!r}, "
                f"prompt_token_ids=[{len(self.prompt_token_ids)} ids], num_cached_tokens={self.num_cached_tokens}, finished={self.finished})")

    @classmethod
    def from_base(cls, request_output: "PoolingRequestOutput"):
        """The task view of a ``PoolingRequestOutput`` (subclasses convert ``outputs``)."""
        return cls(request_output.request_id, cls._convert(request_output.outputs), request_output.prompt_token_ids,
                   request_output.num_cached_tokens, request_output.finished, request_output.index)

    @staticmethod
    def _convert(output: PoolingOutput):
        return output


@dataclass
class EmbeddingOutput:
    """``embedding``: the vector, list of float (length hidden_size, or ``dimensions``)."""

    embedding: list[float]

    @staticmethod
    def from_base(pooling_output: PoolingOutput) -> "EmbeddingOutput":
        if pooling_output.data.ndim != 1:
            raise ValueError("pooled data is not a 1-D embedding")
        return EmbeddingOutput(pooling_output.data.tolist())

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)

    def __repr__(self) -> str:
        return f"EmbeddingOutput(hidden_size={self.hidden_size}, embedding=[{', '.join(f'{x:.4g}' for x in self.embedding[:4])}, ...])"


class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    _convert = staticmethod(EmbeddingOutput.from_base)


@dataclass
class ClassificationOutput:
    """``probs``: one value per label (softmax, or sigmoid for one label; the raw logits with
    ``use_activation=False``), list of float. ``label``: pagedgen's addition, the name of the top
    label from config.json ``id2label`` (set by ``LLM.classify``)."""

    probs: list[float]
    label: Optional[str] = None

    @staticmethod
    def from_base(pooling_output: PoolingOutput) -> "ClassificationOutput":
        if pooling_output.data.ndim != 1:
            raise ValueError("pooled data is not a 1-D vector of class probabilities")
        return ClassificationOutput(pooling_output.data.tolist())

    @property
    def num_classes(self) -> int:
        return len(self.probs)


class ClassificationRequestOutput(PoolingRequestOutput[ClassificationOutput]):
    _convert = staticmethod(ClassificationOutput.from_base)


@dataclass
class ScoringOutput:
    """``score``: one float (a cross-encoder's sigmoid(logit), or the cosine similarity of two
    embeddings)."""

    score: float

    @staticmethod
    def from_base(pooling_output: PoolingOutput) -> "ScoringOutput":
        if pooling_output.data.numel() != 1:
            raise ValueError("pooled data is not a single score")
        return ScoringOutput(float(pooling_output.data.reshape(-1)[0]))


class ScoringRequestOutput(PoolingRequestOutput[ScoringOutput]):
    _convert = staticmethod(ScoringOutput.from_base)
