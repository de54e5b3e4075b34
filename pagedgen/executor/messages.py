"""The messages between the driver and its workers: a small closed set of frozen dataclasses.

Down (driver -> worker):
    StepRecord    one step: the scheduler's plain-data plan plus the sequences new to the worker
    RunOnWorker   run a function on every worker (``collective_rpc``: tests, debugging)
    Shutdown      end the worker process
Up (worker -> driver):
    WorkerReady   the worker has loaded its model and built its KV cache
    StepReply     the step's sampled tokens, requested logprobs, prompt logprobs, beam rows
    RpcReply      what a ``RunOnWorker`` function returned
    WorkerError   the worker raised (its rank, the exception and its traceback, as text)

A step record carries each sequence once (``NewSequence``: its prompt and token ids, sampling
settings with the seed, logprob settings), then only the plan's deltas (first position, the tokens
computed in the step, block-table deltas), freed sequence ids, block moves and forks. Randomness
travels as a key, not a state: the draws are a function of (seed, completion index, position)
(sample/sampler.py), so a worker needs no generator from the driver.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from pagedgen.core.scheduler_output import SchedulerOutput
from pagedgen.core.sequence import Sequence
from pagedgen.outputs import Logprob
from pagedgen.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewSequence:
    """A sequence the worker does not hold yet (first scheduled, back after its table was freed,
    or a parallel sample forked in this step).

    ``token_ids``: all its tokens as the driver knows them (prompt, then outputs); ``seed``: its
    draw key (None: the engine's); ``num_prompt_logprobs``: prompt logprob entries already
    recorded (None: it does not ask for them); ``is_beam``: a beam-search sequence (its logits row
    goes back whole; it is not sampled).
    """

    seq_id: int
    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    seed: Optional[int]
    index: int
    num_prompt_logprobs: Optional[int]
    is_beam: bool
    lora_request: Optional[Any] = None  # its LoRARequest (plain data), None for the base model

    @classmethod
    def of(cls, seq: Sequence) -> "NewSequence":
        return cls(
            seq_id=seq.seq_id,
            token_ids=tuple(seq.token_ids),
            num_prompt_tokens=seq.num_prompt_tokens,
            sampling_params=seq.sampling_params,
            eos_token_ids=seq.eos_token_ids,
            seed=seq.seed,
            index=seq.index,
            num_prompt_logprobs=None if seq.prompt_logprobs is None else len(seq.prompt_logprobs),
            is_beam=seq.beam_group is not None,
            lora_request=seq.lora_request,
        )

    def mirror(self, max_model_len: int) -> Sequence:
        """The worker's copy: a Sequence with what the model runner and the sampler read (prompt
        logprob entries are placeholders: only their count matters there)."""
        return Sequence(
            seq_id=self.seq_id,
            request_id="",
            token_ids=list(self.token_ids),
            num_prompt_tokens=self.num_prompt_tokens,
            sampling_params=self.sampling_params,
            eos_token_ids=self.eos_token_ids,
            max_model_len=max_model_len,
            seed=self.seed,
            index=self.index,
            prompt_logprobs=None if self.num_prompt_logprobs is None else [None] * self.num_prompt_logprobs,
            beam_group=True if self.is_beam else None,
            lora_request=self.lora_request,
        )


@dataclass(frozen=True)
class StepRecord:
    """One step for the workers.

    ``plan``: the scheduler's output (``SchedulerOutput``: ids, first positions, the step's token
    ids, block-table deltas, freed ids, block moves, parallel-sample forks); ``new_seqs``: the
    scheduled sequences the worker does not hold yet; ``forked``: the children of ``plan.forked``
    (they sample from their parent's row in this step only; the worker forgets them after it and
    gets them as new sequences when they are first scheduled); ``grammar_bitmask``: the
    structured-output rows of the step's constrained sequences (structured_output/manager.py's
    ``GrammarBitmask``: seq ids and a [rows, ceil(vocab / 32)] int32 tensor), None when none is.
    """

    step_id: int
    plan: SchedulerOutput
    new_seqs: tuple[NewSequence, ...]
    forked: tuple[NewSequence, ...] = ()
    grammar_bitmask: Any = None


@dataclass(frozen=True)
class StepReply:
    """What one step produced, for the driver (a pipeline stage other than the last answers an
    empty one: only the last samples).

    ``seq_ids[i]`` sampled ``token_ids[i]``; ``logprobs``: None when no sequence asked, else per
    sampled sequence {token id: Logprob} or None; ``prompt_logprobs``: (seq id, first position,
    entries); ``beam_seq_ids[i]``'s log-softmax row is ``beam_logprobs[i]`` ([B, vocab] float32,
    CPU; None without beams).
    """

    step_id: int
    seq_ids: list[int]
    token_ids: list[int]
    logprobs: Optional[list[Optional[dict[int, Logprob]]]] = None
    prompt_logprobs: list[tuple[int, int, list[dict[int, Logprob]]]] = field(default_factory=list)
    beam_seq_ids: list[int] = field(default_factory=list)
    beam_logprobs: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class RunOnWorker:
    """Call ``fn(worker, *args)`` on every worker; the reply is its return value."""

    call_id: int
    fn: Callable
    args: tuple = ()


@dataclass(frozen=True)
class RpcReply:
    call_id: int
    value: Any


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class WorkerReady:
    rank: int
    pid: int
    communicator: str = ""  # the tensor-parallel all-reduce ("shm", "gloo"; "" with one rank)
    transfer: str = ""  # the pipeline stages' activations channel ("shm", "gloo"; "" with one stage)


@dataclass(frozen=True)
class WorkerError:
    """The worker of ``rank`` raised while answering message ``call_id`` (-1: while starting)."""

    rank: int
    call_id: int
    exc_type: str
    message: str
    traceback: str
