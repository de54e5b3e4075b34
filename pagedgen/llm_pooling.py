"""``LLM``'s pooling calls (vLLM's ``LLM.encode``, ``embed``, ``classify``, ``score``, ``reward``),
for a pooling model: ``LLM(model, runner="pooling")`` / ``convert="embed"`` on a ``*ForCausalLM``,
or a ``*ForSequenceClassification`` checkpoint (docs/pooling.md). A mixin of ``LLM`` (llm.py):
each call holds the LLM's lock and runs through engine/pooling.py."""
from __future__ import annotations

from typing import Optional, Sequence, Union

from pagedgen.engine import pooling
from pagedgen.llm_args import check_use_tqdm
from pagedgen.pooling_outputs import ClassificationRequestOutput, EmbeddingRequestOutput, PoolingRequestOutput, ScoringRequestOutput
from pagedgen.pooling_params import PoolingParams

PoolingParamsArg = Union[PoolingParams, Sequence[PoolingParams], None]


class PoolingCalls:
    """The pooling calls of ``LLM``. Prompts are taken as ``generate`` takes them (a str, a list of
    str or of token-id lists, ``{"prompt": ...}`` / ``{"prompt_token_ids": ...}``); results come
    in input order. Errors (TypeError / ValueError naming the index and the field, before any
    work starts): a generation model (load it with ``runner="pooling"`` / ``convert="embed"``), a
    task the model lacks (``classify`` without a classification head), ``dimensions`` on a model
    without matryoshka embeddings or above the hidden size. Interrupts and errors leave the LLM as
    ``generate``'s do."""

    def encode(self, prompts, pooling_params: PoolingParamsArg = None, *, pooling_task: str = "embed",
               use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """The raw pooled tensors: one ``PoolingRequestOutput`` per prompt whose
        ``outputs.data`` is a float32 CPU tensor ([hidden] for "embed", [num_labels] for
        "classify"/"score", [num_tokens, ...] for "token_embed"/"token_classify").

        Args:
            pooling_params: one PoolingParams for all prompts or one per prompt (None: defaults).
            pooling_task: "embed", "classify", "score", "token_embed" or "token_classify".
        """
        check_use_tqdm(use_tqdm)
        with self._lock.held("encode"):
            return pooling.encode(self.llm_engine, prompts, pooling_params, pooling_task, use_tqdm)

    def embed(self, prompts, pooling_params: PoolingParamsArg = None, *, use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """Embeddings: ``outputs.embedding`` a list of float of length hidden_size (or
        ``pooling_params.dimensions``), L2-normalised unless ``normalize=False``; pooled as the
        model's ``PoolerConfig`` says (LAST by default for decoders)."""
        check_use_tqdm(use_tqdm)
        with self._lock.held("embed"):
            return pooling.embed(self.llm_engine, prompts, pooling_params, use_tqdm)

    def classify(self, prompts, pooling_params: PoolingParamsArg = None, *, use_tqdm: bool = True) -> list[ClassificationRequestOutput]:
        """Class probabilities of a ``*ForSequenceClassification`` model: ``outputs.probs`` (softmax,
        sigmoid for one label; logits with ``use_activation=False``), ``outputs.label`` the top
        label's name from config.json ``id2label``."""
        check_use_tqdm(use_tqdm)
        with self._lock.held("classify"):
            return pooling.classify(self.llm_engine, prompts, pooling_params, use_tqdm)

    def score(self, text_1: Union[str, Sequence[str]], text_2: Union[str, Sequence[str]], pooling_params: Optional[PoolingParams] = None, *,
              use_tqdm: bool = True) -> list[ScoringRequestOutput]:
        """Scores of text pairs (text_1[i], text_2[i]); one text_1 is paired with every text_2. A
        cross-encoder (a classification head with one label) reads each pair as one prompt and gives
        sigmoid(logit); an embedding model gives the cosine similarity of the two embeddings.
        ValueError: lists of different lengths."""
        check_use_tqdm(use_tqdm)
        with self._lock.held("score"):
            return pooling.score(self.llm_engine, text_1, text_2, pooling_params, use_tqdm)

    def reward(self, prompts, pooling_params: PoolingParamsArg = None, *, use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """Per-token scores of a reward model: ``outputs.data`` [num_tokens, num_labels] (STEP
        pooling: the rows of the ``step_tag_id`` tokens), raw unless ``use_activation=True``."""
        check_use_tqdm(use_tqdm)
        with self._lock.held("reward"):
            return pooling.reward(self.llm_engine, prompts, pooling_params, use_tqdm)
