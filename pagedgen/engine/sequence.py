"""The state of one sequence (one completion of one request) as it moves through the engine.

Lifecycle: WAITING -> RUNNING -> FINISHED, with RUNNING -> SWAPPED -> RUNNING on swap preemption
and RUNNING -> WAITING on recompute preemption (its blocks are freed, ``num_computed_tokens`` goes
back to 0 and prompt + output so far are prefilled again when it is readmitted). Tensor-free: the scheduler and block manager only read ids and counts.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional

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
        request_index: index of the request in the caller's prompt list.
        token_ids: prompt tokens followed by the generated ones.
        num_prompt_tokens: length of the prompt inside ``token_ids``.
        num_computed_tokens: tokens whose keys and values are in the KV cache.
        sampling_params: how to sample; ``eos_token_ids``: ids that end it unless ignore_eos.
        generator: this sequence's own torch.Generator when its request has a seed (else None).
    """

    seq_id: int
    request_index: int
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    max_model_len: int
    generator: Optional[Any] = None
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    finish_reason: Optional[str] = None
    stop_reason: Optional[int] = None
    num_preemptions: int = 0
    num_cached_tokens: Optional[int] = None  # prompt tokens found in the prefix cache at admission
    extra: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

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
        self.token_ids.append(token_id)
        params = self.sampling_params
        if not params.ignore_eos and token_id in self.eos_token_ids:
            self.finish_reason = "stop"
        elif token_id in params.stop_token_ids:
            self.finish_reason, self.stop_reason = "stop", token_id
        elif params.max_tokens is not None and self.num_output_tokens >= params.max_tokens:
            self.finish_reason = "length"
        elif self.num_tokens >= self.max_model_len:
            self.finish_reason = "length"
        return self.finish_reason is not None
