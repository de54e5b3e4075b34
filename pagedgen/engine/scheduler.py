"""Iteration-level (continuous) batching with first-come-first-served admission and preemption.

Every call to ``schedule`` plans one model step (Orca, OSDI 2022; PagedAttention paper, section 4.5):
finished sequences have already left, running sequences get their next token (or their next prefill
chunk), and waiting sequences join while the token budget, ``max_num_seqs`` and free blocks allow.
A prompt longer than what is left of the token budget is prefilled in chunks over several steps.

When the running sequences need more blocks than are free, the most recently admitted running
sequence is preempted, all or nothing: its blocks are freed and it goes back to the head of the
waiting queue, to be recomputed (its prompt and the tokens it had generated are prefilled again)
when blocks free up. Evicting the newest first keeps FCFS: the oldest requests, which hold the most
work already done, finish first, and a request is never starved by later ones. No tensors here.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedgen.config import SchedulerConfig
from pagedgen.engine.block_manager import BlockManager
from pagedgen.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    """The plan of one step: ``seqs[i]`` computes ``num_new_tokens[i]`` tokens starting at its
    ``num_computed_tokens``. A sequence samples a token when that reaches the end of its tokens."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


@dataclass
class SchedulerStats:
    """Counters since the scheduler was made."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_prefill_tokens: int = 0  # prompt (and recomputed) tokens computed
    num_decode_tokens: int = 0  # tokens computed one at a time after the prompt


class Scheduler:
    """Decides, step by step, which sequences run and how many tokens each computes.

    Args:
        config: limits of one step (``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``).
        block_manager: the KV block accounting this scheduler allocates from.

    A sequence must fit the cache when alone (prompt + 1 <= max_model_len <= cache slots); callers
    reject those that cannot, so a lone running sequence never needs to preempt itself.
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: running[-1] is the newest
        self.stats = SchedulerStats()

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Plan the next step. Allocates blocks for every planned token."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager

        # 1. Running sequences, oldest first: a decode token each, or the next prefill chunk.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not bm.can_allocate(seq.seq_id, seq.num_computed_tokens + n):
                victim = self.running.pop()  # the newest
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                bm.allocate(seq.seq_id, seq.num_computed_tokens + n)
                out.seqs.append(seq)
                out.num_new_tokens.append(n)
                budget -= n
                i += 1
                continue
            break  # seq itself was preempted: everything after it is gone too

        # 2. Waiting sequences, first come first served; none while preemption is under way.
        while (
            self.waiting
            and not out.preempted
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            seq = self.waiting[0]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not bm.can_allocate(seq.seq_id, seq.num_computed_tokens + n):
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            bm.allocate(seq.seq_id, seq.num_computed_tokens + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
            budget -= n

        self.stats.num_steps += 1
        for seq, n in zip(out.seqs, out.num_new_tokens):
            if n == 1 and seq.num_prompt_tokens <= seq.num_computed_tokens == seq.num_tokens - 1:
                self.stats.num_decode_tokens += 1
            else:
                self.stats.num_prefill_tokens += n
        return out

    def finish(self, seq: Sequence) -> None:
        """Remove a finished sequence from the running set and free its blocks."""
        seq.status = SequenceStatus.FINISHED
        self.running.remove(seq)
        self.block_manager.free(seq.seq_id)

    def finish_many(self, seqs: list[Sequence]) -> None:
        """``finish`` for several sequences at once (one pass over the running list)."""
        if not seqs:
            return
        done = set(id(s) for s in seqs)
        self.running = [s for s in self.running if id(s) not in done]
        for seq in seqs:
            seq.status = SequenceStatus.FINISHED
            self.block_manager.free(seq.seq_id)

    def abort_all(self) -> list[Sequence]:
        """Drop every waiting and running sequence and free their blocks (after an error)."""
        dropped = list(self.running) + list(self.waiting)
        for seq in dropped:
            self.block_manager.free(seq.seq_id)
            seq.status = SequenceStatus.FINISHED
        self.running.clear()
        self.waiting.clear()
        return dropped

    def _preempt(self, seq: Sequence) -> None:
        """Preempt by recompute: free all blocks, forget the cache, requeue at the head."""
        self.block_manager.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.stats.num_preemptions += 1
