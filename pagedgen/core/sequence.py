"""The state of one sequence (one completion of one request) as it moves through the engine.

Lifecycle: WAITING -> RUNNING -> FINISHED, with RUNNING -> SWAPPED -> RUNNING on swap preemption
and RUNNING -> WAITING on recompute preemption (its blocks are freed, ``num_computed_tokens`` goes
back to 0 and prompt + output so far are prefilled again when it is readmitted).
Tensor-free: the scheduler and block manager only read ids and counts.

Finishing follows vLLM's stop checker, in this order: EOS (unless ignore_eos), a stop token id, a
stop string in the text, then length (max_tokens, max_model_len). No stop of the first three kinds
happens before ``min_tokens`` tokens are generated (the sampler also bans EOS and stop tokens then).
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from pagedgen.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted by swap: its KV blocks wait in CPU swap space
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One sequence.

    Attributes:
        seq_id: unique id in the engine (also the block manager's key).
        request_id: the id of the request this sequence is a completion (or a beam) of.
        token_ids: prompt tokens followed by the generated ones.
        num_prompt_tokens: length of the prompt inside ``token_ids``.
        num_computed_tokens: tokens whose keys and values are in the KV cache.
        sampling_params: how to sample; ``eos_token_ids``: ids that end it unless ignore_eos.
        seed: its request's seed as a signed 64-bit int, the key of its random draws (None: the
            request has none and draws with the engine's key; see sample/sampler.py).
        index: which of its request's ``n`` completions this is.
        detokenizer: an ``IncrementalDetokenizer`` when the request has stop strings (else None:
            the text is decoded once at the end).
        logprobs, cumulative_logprob: per generated token {token id: Logprob}, and the sum of the
            sampled tokens' logprobs; None unless the request asks for logprobs.
        prompt_logprobs: per prompt token {token id: Logprob}, the first None (and those before
            ``prompt_logprob_start``: ``first_prompt_logprobs``); filled as prefill chunks are
            computed. None unless the request asks (and for completions other than 0).
        stop_reason: the stop token id or stop string that ended it.
    """

    seq_id: int
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    max_model_len: int
    seed: Optional[int] = None
    index: int = 0
    detokenizer: Optional[Any] = None
    logprobs: Optional[list] = None
    cumulative_logprob: Optional[float] = None
    prompt_logprobs: Optional[list] = None
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    num_preemptions: int = 0
    num_cached_tokens: Optional[int] = None  # prompt tokens found in the prefix cache at admission
    # parallel sampling: (index, detokenizer) of the n - 1 completions that fork from this
    # one when its prompt is done, sharing its blocks (copy-on-write)
    pending_forks: list = field(default_factory=list)
    beam_group: Optional[Any] = None  # the BeamGroup of a beam-search sequence
    beam_cum_logprob: float = 0.0
    # a pooling model's request (LLM.embed / classify ...): its PoolingSpec (pooling_params.py; plain
    # data), and once its prompt is computed, the worker's result (an opaque CPU tensor)
    pooling: Optional[Any] = None
    pooled: Optional[Any] = None
    # the request's LoRARequest (pagedgen/lora/request.py; plain data), None for the base model
    lora_request: Optional[Any] = None
    # what append_token checks at every token, computed once from the fields above: the token ids
    # that may end the sequence (stop tokens, EOS unless ignore_eos) and the length it ends at
    _stop_ids: frozenset = field(init=False, repr=False)
    _max_len: int = field(init=False, repr=False)
    # the sampler's fast path (one argmax): greedy, no logprobs, nothing that changes the logits
    plain_greedy: bool = field(init=False, repr=False)
    # the prefix cache's key of its blocks (core/blocks.py hash_block's root): None for the base
    # model, one per adapter, so no block computed under one adapter is reused under another
    cache_salt: Optional[bytes] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        params = self.sampling_params
        self._stop_ids = frozenset(params.stop_token_ids or ()) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        limit = self.max_model_len
        self._max_len = limit if params.max_tokens is None else min(limit, self.num_prompt_tokens + params.max_tokens)
        self.plain_greedy = params.greedy and params.logprobs is None and not params.changes_logits
        self.cache_salt = None if self.lora_request is None else b"lora:%d" % self.lora_request.lora_int_id

    @property
    def lora_int_id(self) -> int:
        """Its adapter's id (0: the base model)."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    def fork(self, seq_id: int, index: int, detokenizer=None) -> "Sequence":
        """A copy of this sequence's state under a new id (the block manager forks its blocks)."""
        child = dataclasses.replace(
            self,
            seq_id=seq_id,
            token_ids=list(self.token_ids),
            index=index,
            detokenizer=detokenizer,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            prompt_logprobs=None,
            pending_forks=[],
        )
        return child

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def max_len(self) -> int:
        """The length (prompt and output tokens) it ends at: max_tokens or max_model_len."""
        return self._max_len

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> bool:
        """Add a sampled token and decide whether the sequence ends here. Returns True if it does."""
        token_ids = self.token_ids
        token_ids.append(token_id)
        if token_id in self._stop_ids and len(token_ids) - self.num_prompt_tokens >= self.sampling_params.min_tokens:
            if not self.sampling_params.ignore_eos and token_id in self.eos_token_ids:
                return self._finish("stop", None, token_id)
            return self._finish("stop", token_id, token_id)
        detok = self.detokenizer
        if detok is not None and detok.append(token_id) is not None:
            return self._finish("stop", detok.stop_reason)
        if len(token_ids) >= self._max_len:  # max_tokens or max_model_len
            return self._finish("length", None)
        return False

    def _finish(self, reason: str, stop_reason: Union[int, str, None], stop_token: Optional[int] = None) -> bool:
        self.finish_reason, self.stop_reason = reason, stop_reason
        detok = self.detokenizer
        if detok is not None:
            if stop_token is not None and self.sampling_params.include_stop_str_in_output:
                detok.append(stop_token)
            detok.finish()  # decodes what was held back; a stop string found there wins
            if detok.stop_reason is not None:
                self.finish_reason, self.stop_reason = "stop", detok.stop_reason
        return True

    def add_logprobs(self, entry: dict, token_id: int) -> None:
        """Record the logprobs of the token sampled this step (before ``append_token``)."""
        self.logprobs.append(entry)
        self.cumulative_logprob += entry[token_id].logprob

    def add_prompt_logprobs(self, position: int, entries: list) -> None:
        """Record the logprobs of prompt tokens ``position + 1 ..`` (predicted from ``position ..``).
        Positions skipped are left None."""
        missing = position + 1 - len(self.prompt_logprobs)
        if missing > 0:
            self.prompt_logprobs.extend([None] * missing)
        self.prompt_logprobs.extend(entries)


def first_prompt_logprobs(params, num_prompt_tokens: int) -> list:
    """A new sequence's ``prompt_logprobs`` before any is computed: a None for each prompt position
    before ``params.prompt_logprob_start`` (at least the first token's, which has no logprob; at
    most one per prompt token). Its length - 1 is the first position whose logits are needed: the
    scheduler takes prefix-cache hits only before it, and the model runner computes logprob rows
    from it on."""
    return [None] * max(1, min(params.prompt_logprob_start or 0, num_prompt_tokens))
