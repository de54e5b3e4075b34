"""The request-level engine: ``add_request``, ``step``, ``abort_request`` (vLLM's ``LLMEngine``
API; nano-vllm's ``llm_engine.py`` has the same shape).

Each ``step`` schedules (``Scheduler.schedule`` returns a plain-data ``SchedulerOutput``), runs the
model over the batch, appends the sampled tokens, advances beam searches, retires what finished
and returns the ``RequestOutput`` of every request that finished in it. ``LLM.generate``,
``LLM.chat``, ``LLM.beam_search`` and ``LLM.generate_stream`` are loops over these calls
(``engine/offline.py``); ``engine/build.py`` builds the engine.

Commit or roll back. A step that raises (any exception, KeyboardInterrupt included, at any point:
scheduling, forks, the forward pass, sampling, the detokenizer) cannot be completed for some
sequences and not others, and the random draws of seeded requests could not be replayed, so the
engine rolls everything back to the empty state: every unfinished request is aborted, the block
pools are repaired (``BlockManager.repair``: the prefix cache emptied, every block free exactly
once), and the error propagates; the next request runs exactly as on a fresh engine. The
same happens at the next call if an interrupt landed inside ``add_request``, ``abort_request`` or
that rollback itself (``_clean`` is False from the first change of such a call to its end).

Not thread-safe: one thread at a time (``LLM`` serialises its calls with a lock). Tensor-free apart
from the executor it drives (``pagedgen.executor``: the model runner in this process, or worker
processes that see only plain-data step records) and the beam-search step.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Iterable, Optional, Union

import torch

from pagedgen.config import CacheConfig, SchedulerConfig
from pagedgen.core.block_manager import BlockManager
from pagedgen.core.scheduler import Scheduler
from pagedgen.core.scheduler_output import ScheduledBatch
from pagedgen.core.sequence import Sequence, SequenceStatus, first_prompt_logprobs
from pagedgen.engine.beam_group import BeamGroup
from pagedgen.engine.processor import Params, Request, RequestProcessor
from pagedgen.engine.stats import EngineStats
from pagedgen.engine.step_log import StepLog
from pagedgen.outputs import RequestOutput
from pagedgen.sampling_params import SamplingParams, as_int64
from pagedgen.spec_decode.speculator import Speculator
from pagedgen.structured_output.manager import MAX_JUMP_TOKENS, StructuredOutputManager

logger = logging.getLogger("pagedgen")


class LLMEngine:
    """Runs requests over the paged KV cache, one step at a time.

    Args:
        cache_config, scheduler_config: frozen limits (validated by ``engine/build.py``).
        executor: runs each step's model work (``pagedgen.executor``): the model runner in this
            process, or worker processes fed plain-data step records; shares ``cache_config``.
        processor: checks and tokenizes requests (with their detokenizers), builds their outputs.
        eos_token_ids: tokens that end a sequence (or a beam) unless its request sets ignore_eos.

    ``LLM(...).llm_engine`` is the engine of an LLM.
    """

    def __init__(
        self,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        executor,
        processor: RequestProcessor,
        eos_token_ids: frozenset[int],
        speculative_config=None,
    ) -> None:
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.block_manager = BlockManager(cache_config.num_blocks, cache_config.block_size, cache_config.enable_prefix_caching, cache_config.sliding_window)
        cpu_blocks = BlockManager(cache_config.num_cpu_blocks, cache_config.block_size) if cache_config.num_cpu_blocks else None
        self.scheduler = Scheduler(scheduler_config, self.block_manager, cpu_blocks)
        self.executor = executor
        # the in-process executor's ModelRunner, for tests and tools (None when the model lives in
        # worker processes); the engine itself reaches the model only through the executor
        self.model_runner = getattr(executor, "model_runner", None)
        self.processor = processor
        self.pooling = None  # a pooling model's PoolingModelInfo (engine/pooling_checks.py), set by engine/build.py
        self.quantization = ""  # the model's weights (ModelConfig.quantization: "int8"...), set by engine/build.py
        self.eos_token_ids = eos_token_ids
        self._requests: dict[str, Request] = {}  # unfinished requests, in arrival order
        self._clean = True  # False while a step or a change of the queues is under way
        self._seq_ids = itertools.count()
        self.num_generated_tokens = 0  # tokens sampled (or chosen by beam search) since creation
        self._util_sum = 0.0
        self._last_util = 1.0
        self._peak_blocks = 0
        self._savings_sum = 0.0
        self._peak_savings = 0.0
        self.step_log: Optional[StepLog] = None  # set by LLM.start_recording(): one record per step
        self.grammars = StructuredOutputManager(processor.grammars)  # structured outputs: one matcher per constrained sequence
        # speculative decoding (pagedgen/spec_decode/): drafts, lookahead slots, commit and rollback
        self.speculator = None if speculative_config is None else Speculator(speculative_config)

    # ----- the request API -----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt, sampling_params: Optional[Params] = None, *, on_error: Optional[str] = None,
                    lora_request=None) -> None:
        """Queue a request; it runs in the next ``step`` calls.

        Args:
            request_id: unique among the unfinished requests.
            prompt: a str, a list of int token ids, ``{"prompt": str}`` or ``{"prompt_token_ids":
                [...]}`` (vLLM's TextPrompt / TokensPrompt).
            sampling_params: a SamplingParams (default: vLLM's defaults), or a BeamSearchParams for
                beam search (its RequestOutput holds the finished beams, best first).
            on_error: None (vLLM's behaviour) or "return": a completion that fails alone
                mid-generation finishes "error", why in its output's ``error`` (see
                ``LLM.generate``; the engine itself never raises for it).
            lora_request: a LoRARequest (``LLM(enable_lora=True)``), or None for the base model.

        Raises:
            TypeError / ValueError: a bad id, prompt or parameter, naming the request id and the
                field; the engine is left exactly as it was.
            RuntimeError: the executor's workers are gone (``LLM.shutdown()``, a worker that died).
        """
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already queued and unfinished: request ids must be unique")
        if self.pooling is not None:
            raise ValueError(f"request {request_id!r}: this engine runs a pooling model; add_request generates (use LLM.embed / classify / encode)")
        if on_error not in (None, "return"):
            raise ValueError(f"request {request_id!r} on_error must be None (vLLM's behaviour) or 'return', got {on_error!r}")
        lora = self.processor.loras.check_one(lora_request, f"request {request_id!r}")  # ValueError naming the adapter
        request = self.processor.process(request_id, prompt, sampling_params)
        request.on_error, request.lora_request = on_error, lora
        self.enqueue(request)

    def add_pooling_request(self, request_id: str, prompt, pooling_params=None, task: str = "embed",
                            token_type_start: Optional[int] = None) -> None:
        """Queue a pooling model's request (``LLM(runner="pooling")``; the command line's ``--task``):
        ``prompt`` as ``add_request`` takes it, ``pooling_params`` a PoolingParams or None, ``task``
        one of ``pooling_params.POOLING_TASKS``; ``token_type_start``: where an encoder's token type 1
        begins (a cross-encoder's pair, ``pooling.pair_encoding``). Its ``step`` output is a ``PoolingRequestOutput``.
        TypeError / ValueError naming the request (a generation engine, a bad prompt or field),
        leaving the engine as it was."""
        from pagedgen.engine.pooling_checks import check_pooling_params, check_pooling_prompt

        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        if self.pooling is None:
            raise ValueError(f"request {request_id!r}: this engine generates; pooling needs LLM(model, runner='pooling') (docs/pooling.md)")
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already queued and unfinished: request ids must be unique")
        spec = check_pooling_params(pooling_params, task, self.pooling, f"request {request_id!r} pooling_params")
        request = self.processor.process(request_id, prompt, SamplingParams(max_tokens=1))
        check_pooling_prompt(request.prompt_token_ids, self.pooling, self.scheduler_config.max_num_batched_tokens, f"request {request_id!r} prompt")
        if token_type_start is not None and spec.whole_prompt:
            spec = dataclasses.replace(spec, token_type_start=token_type_start)
        request.pooling = spec
        self.enqueue(request)

    def enqueue(self, request: Request) -> None:
        """Queue a request already checked by ``processor`` (``add_request`` does both).
        RuntimeError, with nothing queued, once the executor refuses calls (shut down, a worker dead)."""
        self.executor.check_usable()
        self._recover_if_needed()
        if request.request_id in self._requests:
            raise ValueError(f"request {request.request_id!r} is already queued and unfinished: request ids must be unique")
        seq = self._new_sequence(request)
        self._clean = False
        try:
            self.grammars.add(seq)
            self._requests[request.request_id] = request
            request.seqs.append(seq)
            self.scheduler.add(seq)
        except BaseException:
            self._drop(request)
            raise
        self._clean = True

    def abort_request(self, request_id: Union[str, Iterable[str]]) -> None:
        """Drop unfinished requests (one id or several; unknown ids are ignored); their blocks
        return to the pool at once."""
        self._recover_if_needed()
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self._clean = False
        for rid in ids:
            request = self._requests.get(rid)
            if request is not None:
                self._drop(request)
        self._clean = True

    def has_unfinished_requests(self) -> bool:
        self._recover_if_needed()
        return bool(self._requests)

    def get_num_unfinished_requests(self) -> int:
        self._recover_if_needed()
        return len(self._requests)

    def step(self) -> list[RequestOutput]:
        """Run one model step. Returns the RequestOutputs of the requests that finished in it
        (all their completions done), in the order they finished; [] when nothing is queued.

        Raises whatever interrupted the step, after aborting every unfinished request and repairing
        the block pool (see the module docstring); RuntimeError if a request cannot fit the cache.
        """
        self._recover_if_needed()
        if not self._requests:
            return []
        self._clean = False
        try:
            outputs = self._step()
        except BaseException:
            self.abort_all()
            raise
        self._clean = True
        return outputs

    def abort_all(self) -> None:
        """Drop every request and make the block pools whole again: see ``BlockManager.repair``."""
        self._clean = False
        self.scheduler.abort_all()
        self._requests = {}
        self.grammars.clear()
        for bm in (self.block_manager, self.scheduler.cpu_block_manager):
            if bm is not None:
                problems = bm.repair()
                if problems:
                    logger.warning("KV block pool repaired after an aborted step: %s", "; ".join(problems[:5]))
        self._clean = True

    # ----- internals -----------------------------------------------------------------------------
    def _recover_if_needed(self) -> None:
        if not self._clean:  # an interrupt landed inside a change of the queues or a rollback
            self.abort_all()

    def _drop(self, request: Request) -> None:
        """Forget a request and free its sequences' blocks."""
        self.scheduler.finish_many(request.live_seqs())
        self._requests.pop(request.request_id, None)

    def _new_sequence(self, request: Request) -> Sequence:
        """Completion 0 of a request (or its first beam); the n - 1 other completions fork from it
        once its prompt is computed, sharing its blocks."""
        params = request.params
        if isinstance(params, SamplingParams):
            seed = None if params.seed is None else as_int64(params.seed)
            seq = self._sequence(request, params, seed, request.detokenizers[0])
            seq.pooling = request.pooling  # a pooling request: prefilled, pooled, never decoded
            # completions 1..n-1 fork from completion 0 once the prompt is computed, sharing its blocks
            seq.pending_forks = [(j, request.detokenizers[j]) for j in range(1, params.n)]
            return seq
        group = BeamGroup(params, len(request.prompt_token_ids), self.eos_token_ids, self.scheduler_config.max_model_len)
        seq = self._sequence(request, SamplingParams(temperature=0, max_tokens=None), None, None)
        seq.beam_group = group
        group.beams = [seq]
        request.beam_group = group
        return seq

    def _sequence(self, request: Request, params: SamplingParams, seed: Optional[int], detokenizer) -> Sequence:
        """A new sequence of ``request``. Prompt logprobs are collected by completion 0 only."""
        return Sequence(
            seq_id=next(self._seq_ids),
            request_id=request.request_id,
            token_ids=list(request.prompt_token_ids),
            num_prompt_tokens=len(request.prompt_token_ids),
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.scheduler_config.max_model_len,
            lora_request=request.lora_request,
            seed=seed,
            detokenizer=detokenizer,
            logprobs=[] if params.logprobs is not None else None,
            cumulative_logprob=0.0 if params.logprobs is not None else None,
            prompt_logprobs=None if params.prompt_logprobs is None else first_prompt_logprobs(params, len(request.prompt_token_ids)),
        )

    def _step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if not plan.seq_ids:
            raise RuntimeError("scheduler planned an empty step with work pending (a request cannot fit the KV cache)")
        bm = self.block_manager
        self._last_util = bm.utilization()
        self._util_sum += self._last_util
        self._peak_blocks = max(self._peak_blocks, bm.num_used_blocks)
        savings = bm.sharing_savings()
        self._savings_sum += savings
        self._peak_savings = max(self._peak_savings, savings)
        batch = ScheduledBatch(plan, self.scheduler.scheduled)  # the Sequences of plan.seq_ids
        self._fork_parallel_samples(batch)
        batch.grammar_bitmask = self.grammars.bitmask(batch)  # structured outputs: None unless a sequence sampling now is constrained
        if self.speculator is not None:
            batch.drafts = self.speculator.plan(batch, self.scheduler)
        out = self.executor.execute(batch, self.scheduler.seqs)
        for seq, n in zip(batch.seqs, plan.num_new_tokens):
            seq.num_computed_tokens += n
        for child, parent in batch.forked:
            child.num_computed_tokens = parent.num_computed_tokens
        finished_requests: list[Request] = []
        if out.beam_logprobs:
            self._advance_beams(out.beam_logprobs, finished_requests)
        for seq, position, entries in out.prompt_logprobs:
            seq.add_prompt_logprobs(position, entries)
        if out.logprobs is not None:
            for seq, tok, entry in zip(out.seqs, out.token_ids, out.logprobs):
                if entry is not None:
                    seq.add_logprobs(entry, tok)
        failed = self.grammars.accept(out.seqs, out.token_ids)  # {seq id: why}: ended by their grammar
        finished = [seq for seq, tok in zip(out.seqs, out.token_ids) if seq.append_token(tok)]
        if failed:
            self._record_failures(finished, failed)
        for seq, data in getattr(out, "pooled", ()):  # pooling requests end when their prompt is computed (in process only)
            seq.pooled, seq.finish_reason = data, "stop"
            finished.append(seq)
        self.num_generated_tokens += len(out.token_ids)
        if len(self.grammars) and self.speculator is None:
            self._jump_forward(out.seqs, finished)
        if getattr(out, "spec", None):  # the verified sequences' tokens after their first
            self.num_generated_tokens += self.speculator.commit(out.spec, finished, self.scheduler)
        if self.step_log is not None:
            self.step_log.record(self.num_generated_tokens, len(finished))
        self.scheduler.finish_many(finished)
        requests = self._requests
        for seq in finished:
            request = requests[seq.request_id]
            request.num_finished += 1
            if request.is_finished:
                finished_requests.append(request)
        outputs = [self.processor.make_output(r) for r in finished_requests]
        for r in finished_requests:
            del requests[r.request_id]
        return outputs

    def _jump_forward(self, seqs: list[Sequence], finished: list[Sequence]) -> None:
        """Structured outputs: append the tokens each constrained sequence's grammar forces after
        its sampled one (a JSON key, punctuation, the rest of an enum value), with the usual stop
        checks, instead of a decode step each; the scheduler computes them with the next position
        as one chunk (docs/structured_outputs.md, "Jump-forward decoding")."""
        done = {seq.seq_id for seq in finished}
        grammars = self.grammars
        forced_tokens = grammars.forced_tokens
        for seq in seqs:
            if seq.seq_id in done:
                continue
            room = seq.max_len - len(seq.token_ids)  # max_tokens or max_model_len: more would be accepted for nothing
            appended = 0
            for token in forced_tokens(seq, min(MAX_JUMP_TOKENS, room)):
                appended += 1
                if seq.append_token(token):  # a stop token or string ends it early: its grammar goes with it
                    finished.append(seq)
                    break
            self.num_generated_tokens += appended
            grammars.num_jump_forward_tokens += appended

    def _record_failures(self, finished: list[Sequence], failed: dict[int, str]) -> None:
        """Completions that failed alone (their grammar ended them: ``failed``, seq id -> why):
        kept in their request's ``errors`` when it asks (``Request.on_error``), so that its output
        says "error" and why; otherwise vLLM's behaviour stands (finish_reason "stop", the
        grammar manager's warning)."""
        for seq in finished:
            why = failed.get(seq.seq_id)
            request = self._requests[seq.request_id]
            if why is not None and request.on_error is not None:
                request.errors[seq.index] = f"completion {seq.index}: {why}" if getattr(request.params, "n", 1) > 1 else why

    def _fork(self, parent: Sequence, index: int = 0, detokenizer=None) -> Sequence:
        """A new sequence sharing ``parent``'s tokens and KV blocks (copy-on-write), queued beside it."""
        child = parent.fork(next(self._seq_ids), index, detokenizer)
        if parent.status is SequenceStatus.RUNNING:
            self.block_manager.fork(parent.seq_id, child.seq_id)
        else:  # waiting or swapped: the child recomputes its tokens when admitted
            child.num_computed_tokens = 0
        self.scheduler.add_fork(child, parent)
        return child

    def _fork_parallel_samples(self, batch: ScheduledBatch) -> None:
        """Parallel sampling (n > 1): when a request's prompt is done, its n - 1 other completions
        fork from it and sample from the same logits, sharing the prompt's blocks (paper 4.4)."""
        for seq, n in zip(batch.seqs, batch.plan.num_new_tokens):
            if seq.pending_forks and seq.num_computed_tokens + n == seq.num_tokens:
                request = self._requests[seq.request_id]
                for index, detokenizer in seq.pending_forks:
                    child = self._fork(seq, index, detokenizer)
                    request.seqs.append(child)
                    batch.forked.append((child, seq))
                    batch.plan.forked.append((child.seq_id, seq.seq_id))
                seq.pending_forks = []

    def _advance_beams(self, rows: list[tuple[Sequence, torch.Tensor]], finished_requests: list[Request]) -> None:
        """Store each beam's log-probabilities; a group whose running beams all have theirs takes
        a beam-search step: selected beams fork (sharing blocks), the others are freed. A group
        whose search is over adds its request to ``finished_requests``."""
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
            self.num_generated_tokens += len(new_beams)
            if group.done:
                finished_requests.append(self._requests[beams[0].request_id])

    def stats(self) -> EngineStats:
        s, bm = self.scheduler.stats, self.block_manager
        return EngineStats(
            **dataclasses.asdict(s),  # the scheduler's counters
            num_generated_tokens=self.num_generated_tokens,
            num_kv_blocks=bm.num_blocks,
            num_used_blocks=bm.num_used_blocks,
            num_free_blocks=bm.num_free_blocks,
            block_size=bm.block_size,
            kv_cache_dtype=self.cache_config.cache_dtype,
            kv_utilization=self._last_util,
            kv_utilization_mean=self._util_sum / s.num_steps if s.num_steps else 1.0,
            peak_used_blocks=self._peak_blocks,
            prefix_cache_hit_rate=bm.num_prefix_hits / bm.num_prefix_queries if bm.num_prefix_queries else 0.0,
            num_cached_tokens=bm.num_prefix_hits,
            sharing_savings_mean=self._savings_sum / s.num_steps if s.num_steps else 0.0,
            peak_sharing_savings=self._peak_savings,
            num_copy_on_write=bm.num_copies,
            num_jump_forward_tokens=self.grammars.num_jump_forward_tokens,
            quantization=self.quantization,
            **self._spec_stats(),
        )

    def _spec_stats(self) -> dict:
        if self.speculator is None:
            return {}
        st = self.speculator.stats
        return dict(num_draft_tokens=st.num_draft_tokens, num_accepted_tokens=st.num_accepted_tokens,
                    acceptance_rate_per_position=tuple(round(r, 4) for r in st.acceptance_rate_per_position()))
