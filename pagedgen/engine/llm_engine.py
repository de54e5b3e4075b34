"""The step loop: schedule, run the model, append tokens, retire finished sequences.

Tensor-free apart from the model runner it drives. One ``LLMEngine`` serves many ``generate`` calls;
after an error every unfinished sequence is aborted so that the next call starts from a clean pool.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from pagedgen import _repr
from pagedgen.config import CacheConfig, SchedulerConfig
from pagedgen.engine.beam_group import BeamGroup
from pagedgen.engine.block_manager import BlockManager
from pagedgen.engine.model_runner import ModelRunner
from pagedgen.engine.scheduler import Scheduler, SchedulerOutput
from pagedgen.engine.sequence import Sequence, SequenceStatus
from pagedgen.engine.step_log import StepLog
from pagedgen.sampling_params import SamplingParams


@dataclass
class EngineStats:
    """KV-cache and scheduling figures since the engine was made (``LLM.get_stats()``).

    ``kv_utilization_mean`` is the mean, over steps, of slots holding real tokens / slots allocated
    (the PagedAttention paper's figure 2 measure); ``kv_utilization`` is the last step's value.
    ``sharing_savings_*``: 1 - physical blocks used / blocks the same block tables would need
    unshared (paper section 6.3-6.4).
    """

    num_steps: int
    num_preemptions: int
    num_recomputes: int
    num_swaps_out: int
    num_swaps_in: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_generated_tokens: int
    num_kv_blocks: int
    num_used_blocks: int
    num_free_blocks: int
    block_size: int
    kv_utilization: float
    kv_utilization_mean: float
    peak_used_blocks: int
    prefix_cache_hit_rate: float  # prompt tokens found in the prefix cache / tokens looked up
    num_cached_tokens: int  # tokens not recomputed thanks to the prefix cache
    sharing_savings_mean: float  # mean over steps of 1 - physical blocks / blocks unshared tables need
    peak_sharing_savings: float
    num_copy_on_write: int  # blocks copied because a shared block was written

    def __repr__(self) -> str:
        return _repr.render("EngineStats", _repr.engine_stats(self))

    def _repr_pretty_(self, p, cycle: bool) -> None:
        _repr.pretty(p, "EngineStats", _repr.engine_stats(self), cycle)


class LLMEngine:
    """Drives scheduler, block manager and model runner over a set of sequences.

    Args:
        cache_config, scheduler_config: frozen limits (validated by ``LLM``).
        model_runner: tensors and the model; shares ``cache_config``.
        eos_token_ids: tokens that end a sequence unless its request sets ignore_eos.
    """

    def __init__(self, cache_config: CacheConfig, scheduler_config: SchedulerConfig, model_runner: ModelRunner, eos_token_ids: frozenset[int]) -> None:
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.block_manager = BlockManager(cache_config.num_blocks, cache_config.block_size, cache_config.enable_prefix_caching)
        cpu_blocks = BlockManager(cache_config.num_cpu_blocks, cache_config.block_size) if cache_config.num_cpu_blocks else None
        self.scheduler = Scheduler(scheduler_config, self.block_manager, cpu_blocks)
        self.model_runner = model_runner
        self.eos_token_ids = eos_token_ids
        self._seq_ids = itertools.count()
        self._num_generated = 0
        self._util_sum = 0.0
        self._last_util = 1.0
        self._peak_blocks = 0
        self._savings_sum = 0.0
        self._peak_savings = 0.0
        self.step_log: Optional[StepLog] = None  # set by LLM.start_recording(): one record per step

    def add_sequence(
        self,
        request_index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        generator=None,
        *,
        index: int = 0,
        detokenizer=None,
    ) -> Sequence:
        """Queue one sequence (inputs already validated): completion ``index`` of its request.

        ``detokenizer``: its ``IncrementalDetokenizer`` when the request has stop strings. Prompt
        logprobs are collected by completion 0 only (they are the same for all n).
        """
        seq = Sequence(
            seq_id=next(self._seq_ids),
            request_index=request_index,
            token_ids=list(prompt_token_ids),
            num_prompt_tokens=len(prompt_token_ids),
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.scheduler_config.max_model_len,
            generator=generator,
            index=index,
            detokenizer=detokenizer,
            logprobs=[] if params.logprobs is not None else None,
            cumulative_logprob=0.0 if params.logprobs is not None else None,
            prompt_logprobs=[None] if params.prompt_logprobs is not None and index == 0 else None,
        )
        self.scheduler.add(seq)
        return seq

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Sequence]:
        """Run one model step. Returns the sequences that finished in it."""
        batch = self.scheduler.schedule()
        if not batch.seqs:
            raise RuntimeError("scheduler planned an empty step with work pending (a request cannot fit the KV cache)")
        bm = self.block_manager
        self._last_util = bm.utilization()
        self._util_sum += self._last_util
        self._peak_blocks = max(self._peak_blocks, bm.num_used_blocks)
        savings = bm.sharing_savings()
        self._savings_sum += savings
        self._peak_savings = max(self._peak_savings, savings)
        self._fork_parallel_samples(batch)
        out = self.model_runner.execute(batch, bm)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
        for child, parent in batch.forked:
            child.num_computed_tokens = parent.num_computed_tokens
        if out.beam_logprobs:
            self._advance_beams(out.beam_logprobs)
        for seq, position, entries in out.prompt_logprobs:
            seq.add_prompt_logprobs(position, entries)
        if out.logprobs is not None:
            for seq, tok, entry in zip(out.seqs, out.token_ids, out.logprobs):
                if entry is not None:
                    seq.add_logprobs(entry, tok)
        finished = [seq for seq, tok in zip(out.seqs, out.token_ids) if seq.append_token(tok)]
        self._num_generated += len(out.token_ids)
        if self.step_log is not None:
            self.step_log.record(self._num_generated, len(finished))
        self.scheduler.finish_many(finished)
        return finished

    def add_beam_search(self, request_index: int, prompt_token_ids: list[int], group: BeamGroup) -> Sequence:
        """Queue the first beam of a beam search (the prompt); ``group`` decides every step after."""
        seq = self.add_sequence(request_index, prompt_token_ids, SamplingParams(temperature=0, max_tokens=None))
        seq.beam_group = group
        group.beams = [seq]
        return seq

    def _fork(self, parent: Sequence, index: int = 0, generator=None, detokenizer=None) -> Sequence:
        """A new sequence sharing ``parent``'s tokens and KV blocks (copy-on-write), queued beside it."""
        child = parent.fork(next(self._seq_ids), index, generator, detokenizer)
        if parent.status is SequenceStatus.RUNNING:
            self.block_manager.fork(parent.seq_id, child.seq_id)
        else:  # waiting or swapped: the child recomputes its tokens when admitted
            child.num_computed_tokens = 0
        self.scheduler.add_fork(child, parent)
        return child

    def _fork_parallel_samples(self, batch: SchedulerOutput) -> None:
        """Parallel sampling (n > 1): when a request's prompt is done, its n - 1 other completions
        fork from it and sample from the same logits, sharing the prompt's blocks (paper 4.4)."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq.pending_forks and seq.num_computed_tokens + n == seq.num_tokens:
                for index, generator, detokenizer in seq.pending_forks:
                    child = self._fork(seq, index, generator, detokenizer)
                    seq.forked.append(child)
                    batch.forked.append((child, seq))
                seq.pending_forks = []

    def _advance_beams(self, rows: list[tuple[Sequence, torch.Tensor]]) -> None:
        """Store each beam's log-probabilities; a group whose running beams all have theirs takes
        a beam-search step: selected beams fork (sharing blocks), the others are freed."""
        ready = []
        for seq, row in rows:
            group = seq.beam_group
            group.pending[seq.seq_id] = row
            if group not in ready and all(b.seq_id in group.pending for b in group.beams):
                ready.append(group)
        for group in ready:
            beams = group.beams
            logprobs = torch.stack([group.pending[b.seq_id] for b in beams])  # [num_beams, vocab]
            group.pending.clear()
            continuations = group.step(logprobs, [b.beam_cum_logprob for b in beams], [b.output_token_ids for b in beams])
            reused: set[int] = set()
            new_beams = []
            for c in continuations:  # fork before anything is freed or appended
                parent = beams[c.parent]
                beam = parent if c.parent not in reused else self._fork(parent)
                reused.add(c.parent)
                new_beams.append(beam)
            self.scheduler.finish_many([b for i, b in enumerate(beams) if i not in reused])
            for beam, c in zip(new_beams, continuations):
                beam.token_ids.append(c.token)
                beam.beam_cum_logprob = c.cum_logprob
            group.beams = new_beams
            self._num_generated += len(new_beams)

    def run(self, on_finished: Optional[Callable[[list[Sequence], int], None]] = None) -> None:
        """Step until every queued sequence has finished; after any error, abort them all.

        ``on_finished(finished_seqs, num_tokens_generated_in_step)`` is called after each step.
        """
        try:
            while self.has_unfinished():
                before = self._num_generated
                finished = self.step()
                if on_finished is not None:
                    on_finished(finished, self._num_generated - before)
        except BaseException:
            self.scheduler.abort_all()
            raise

    def stats(self) -> EngineStats:
        s, bm = self.scheduler.stats, self.block_manager
        return EngineStats(
            **dataclasses.asdict(s),  # the scheduler's counters
            num_generated_tokens=self._num_generated,
            num_kv_blocks=bm.num_blocks,
            num_used_blocks=bm.num_used_blocks,
            num_free_blocks=bm.num_free_blocks,
            block_size=bm.block_size,
            kv_utilization=self._last_util,
            kv_utilization_mean=self._util_sum / s.num_steps if s.num_steps else 1.0,
            peak_used_blocks=self._peak_blocks,
            prefix_cache_hit_rate=bm.num_prefix_hits / bm.num_prefix_queries if bm.num_prefix_queries else 0.0,
            num_cached_tokens=bm.num_prefix_hits,
            sharing_savings_mean=self._savings_sum / s.num_steps if s.num_steps else 0.0,
            peak_sharing_savings=self._peak_savings,
            num_copy_on_write=bm.num_copies,
        )
