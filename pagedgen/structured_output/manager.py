"""The engine's grammars by seq id (``StructuredOutputManager``): ``add`` when a request is queued,
``bitmask(batch)`` when the step is scheduled (the rows are filled serially, or on one helper
thread while the forward runs where that pays: ``overlaps``; the sampler's read waits for them),
``accept`` after sampling, ``forced_tokens`` for jump-forward decoding, ``clear`` on rollback. The
grammars themselves: grammar.py."""
from __future__ import annotations

import concurrent.futures
import logging
import os
import time
from typing import Optional

import numpy as np
import torch

from pagedgen.structured_output import closing
from pagedgen.structured_output.grammar import GrammarCompiler, _int32, _message, _only_eos, fill_bitmask_rows
from pagedgen.structured_output.token_bitmask import GrammarBitmask

logger = logging.getLogger("pagedgen")

#: fill each step's bitmask on one helper thread while the model runs the step: PAGEDGEN_MASK_OVERLAP=1 always,
#: 0 never (before the forward, serially), unset: where it pays (``StructuredOutputManager.overlaps``)
MASK_OVERLAP = {"1": True, "0": False}.get(os.environ.get("PAGEDGEN_MASK_OVERLAP", ""), None)
#: the mean fill of a step below which a hand-off to the helper thread costs more than it hides
OVERLAP_MIN_FILL_SECONDS = 0.5e-3
#: masks of rows x vocabulary_size >= this are filled on llguidance's thread pool (fewer: one by one is
#: faster): 16 rows of a 32k vocabulary; stories260K's 512 tokens cost 1-4 us a row, less than the pool's hand-off
PARALLEL_WORK = 16 * 32768
#: jump-forward decoding: tokens a grammar forces are appended without a decode step each (PAGEDGEN_JUMP_FORWARD=0: off)
JUMP_FORWARD = os.environ.get("PAGEDGEN_JUMP_FORWARD", "1") != "0"
MAX_JUMP_TOKENS = 32  # forced tokens appended after one sampled token at most (the next step's chunk)


class StructuredOutputManager:
    """The grammars of the engine's constrained sequences, by seq id.

    Nothing here runs for a step while no queued request is constrained: ``bitmask`` returns None
    at once and ``accept`` returns at once.
    """

    def __init__(self, compiler: GrammarCompiler, overlap: Optional[bool] = MASK_OVERLAP) -> None:
        self.compiler = compiler
        self.overlap = overlap  # fill masks on the helper thread during the forward: True, False, None: auto (``overlaps``)
        self.forward_on_host = True  # the model runs on this host's cores (engine/build.py: False on a GPU)
        self._fill_mean = 0.0  # the steps' fill seconds, an exponential mean (``overlaps``)
        self.jump_forward = JUMP_FORWARD  # append forced tokens without a decode step each (see ``forced_tokens``)
        self.num_jump_forward_tokens = 0  # tokens so appended
        self._grammars: dict[int, tuple] = {}  # seq_id -> (Sequence, Grammar)
        self._thread: Optional[concurrent.futures.ThreadPoolExecutor] = None  # one helper thread, made on first use
        self._pending: Optional[GrammarBitmask] = None  # the step's mask while its fill may still run
        self._dead: dict[int, str] = {}  # seq id -> why, given EOS alone in this step (dead ends: see _check_dead_ends)
        self.mask_seconds = 0.0  # time spent filling bitmasks (benchmarks/structured.py reports it)
        self.mask_wait_seconds = 0.0  # time the step waited for them (all of mask_seconds when serial)
        self.num_masks = 0
        self.num_closing_masks = 0  # rows steered to close their JSON near the token limit (closing.py)

    def __len__(self) -> int:
        return len(self._grammars)

    def add(self, seq) -> None:
        """Give a newly queued sequence its matcher if its request is constrained."""
        spec = seq.sampling_params.structured_outputs
        if spec is not None:
            grammar = self.compiler.grammar(spec, seq.eos_token_ids)
            start = grammar.start_closing_length
            if grammar.close and start is not None and seq.max_len - seq.num_tokens + closing.MARGIN < start:
                grammar.close = False  # no closing fits in max_tokens: never steered (structured_output/closing.py)
            self._grammars[seq.seq_id] = (seq, grammar)

    def clear(self) -> None:
        """Forget every matcher (the engine aborted every request), after any fill still running."""
        self._join(raise_errors=False)
        self._grammars.clear()
        self._dead.clear()

    def _join(self, raise_errors: bool = True) -> None:
        """Wait for the last step's fill (the sampler has waited for it already unless the step failed)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending.wait()
            except Exception:
                if raise_errors:
                    raise

    def bitmask(self, batch) -> Optional[GrammarBitmask]:
        """The bitmask rows of the constrained sequences that sample in ``batch`` (a ScheduledBatch
        whose parallel samples are forked already), or None when there are none. Matchers of
        finished or aborted sequences are dropped here; forked children get a copy of their parent's.

        Where ``overlaps()`` the rows are filled on the helper thread (llguidance drops the GIL) and
        the returned mask is pending: the sampler's read of ``bitmask`` waits for it, after the
        forward. No matcher changes until then: ``accept`` runs after the step's sampling."""
        self._join()
        grammars = self._grammars
        if not grammars:
            return None
        for seq_id in [i for i, (s, _) in grammars.items() if s.is_finished]:
            del grammars[seq_id]
        for child, parent in batch.forked:
            if parent.seq_id in grammars:
                grammars[child.seq_id] = (child, grammars[parent.seq_id][1].fork())
        sampling = [seq for seq, n in zip(batch.seqs, batch.num_new_tokens)
                    if seq.seq_id in grammars and seq.num_computed_tokens + n == seq.num_tokens and seq.beam_group is None]
        sampling += [child for child, _ in batch.forked if child.seq_id in grammars]
        if not sampling:
            return None
        bitmask = torch.empty(len(sampling), self.compiler.num_words, dtype=torch.int32)
        matchers = [grammars[seq.seq_id][1] for seq in sampling]
        seq_ids = [seq.seq_id for seq in sampling]
        if not self.overlaps():
            start = time.perf_counter()
            self._fill(sampling, matchers, bitmask)
            self.mask_wait_seconds += time.perf_counter() - start
            return GrammarBitmask(seq_ids, bitmask)
        if self._thread is None:
            self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedgen-mask")
        self._pending = GrammarBitmask(seq_ids, bitmask, _TimedFuture(self._thread.submit(self._fill, sampling, matchers, bitmask), self))
        return self._pending

    def overlaps(self) -> bool:
        """Whether this step's mask is filled on the helper thread while the model runs (``overlap``
        True or False decides; None, the default, decides by the measured work): only where the fill
        is worth a hand-off (a mean of ``OVERLAP_MIN_FILL_SECONDS`` a step or more; stories260K's
        512-token masks take a fraction of that at 128 rows) and a core is free for it: the forward
        runs on a GPU, or torch's intra-op threads leave one of this process's cores idle (on a
        2-core machine whose two threads run the forward, the helper took time from the forward
        and the overlapped runs were slower than the serial ones: docs/structured_outputs.md)."""
        if self.overlap is not None:
            return self.overlap
        if self._fill_mean < OVERLAP_MIN_FILL_SECONDS:
            return False
        return not self.forward_on_host or torch.get_num_threads() < _num_cores()

    def _fill(self, sampling: list, grammars: list, bitmask: torch.Tensor) -> None:
        """Rows of ``bitmask`` [R, W] int32: each grammar's mask, ANDed with its number guard's
        where the guard's may differ (``Grammar.needs_guard_mask``); then the dead ends."""
        start = time.perf_counter()
        executor = self.compiler.executor() if len(grammars) * self.compiler.vocab_size >= PARALLEL_WORK else None
        fill_bitmask_rows([(g.matcher, row) for row, g in enumerate(grammars)], bitmask, executor)
        guarded = [row for row, g in enumerate(grammars) if g.needs_guard_mask()]
        if guarded:
            guard = torch.empty(len(guarded), bitmask.shape[1], dtype=torch.int32)
            fill_bitmask_rows([(grammars[row].guard, i) for i, row in enumerate(guarded)], guard,
                              executor if len(guarded) * self.compiler.vocab_size >= PARALLEL_WORK else None)
            bitmask[guarded] &= guard
        self._check_dead_ends(sampling, grammars, bitmask)
        self._steer_closing(sampling, grammars, bitmask)
        seconds = time.perf_counter() - start
        self._fill_mean = 0.8 * self._fill_mean + 0.2 * seconds
        self.mask_seconds += seconds
        self.num_masks += len(sampling)

    def _steer_closing(self, sampling: list, grammars: list, bitmask: torch.Tensor) -> None:
        """JSON requests near their token limit: from the step where the remaining tokens come
        within ``closing.MARGIN`` of the closing's estimated length, their rows of ``bitmask`` are
        narrowed to the first class of closing tokens they allow (structured_output/closing.py)."""
        rows, inside, tables = [], [], None
        for row, (seq, grammar) in enumerate(zip(sampling, grammars)):
            if not grammar.close:
                continue
            state = None
            if not grammar.closing:
                remaining = seq.max_len - seq.num_tokens  # tokens left, this step's included
                if remaining > grammar.next_check or grammar.matcher.compute_ff_bytes():
                    continue  # not yet, or a forced state (decide where a step samples with or without jump-forward)
                tables = grammar.vocab.closing_tables()
                state = closing.text_state(grammar.text())
                length = closing.estimate(grammar.matcher, tables, state, remaining + closing.MARGIN)
                if length is None:  # no closing fits in what is left (max_tokens below the shortest JSON):
                    grammar.close = False  # steering would only empty the strings; the model is left alone
                    continue
                if remaining > length + closing.MARGIN:
                    grammar.next_check = remaining - max(1, (remaining - length - closing.MARGIN) // 2)
                    continue
                grammar.closing = True
            tables = grammar.vocab.closing_tables()
            rows.append(row)
            inside.append((state or closing.text_state(grammar.text()))[0])
        if rows:
            words = bitmask.numpy().view(np.uint32)  # [R, W], the same memory
            part = words[rows]
            closing.steer(part, np.array(inside, dtype=bool), tables)
            words[rows] = part
            self.num_closing_masks += len(rows)

    def _check_dead_ends(self, sampling: list, grammars: list, bitmask: torch.Tensor) -> None:
        """A sequence whose grammar is in error, or can only stop while incomplete, gets the mask of
        EOS alone and a warning: it finishes in this step (finish_reason "stop", as vLLM's llguidance
        backend ends it; "error" with the reason when its request asks: ``accept``'s return), the
        others run on."""
        eos = self.compiler._vocabulary(frozenset(sampling[0].eos_token_ids)).eos_token_id
        # only rows that allow EOS can be dead ends (llguidance allows EOS alone there, and errors end in EOS too),
        # and rows that allow nothing (the number guard and the schema agreeing on no token: a schema's bound
        # met by a number at the guard's digit limit, e.g. exclusiveMinimum 0.5 after "0.50000000000000000")
        words = bitmask.numpy().view(np.uint32)  # [R, W], the same memory (numpy: cheaper than torch ops on a small array)
        suspects = np.flatnonzero(((words[:, eos // 32] >> np.uint32(eos % 32)) & 1).astype(bool) | ~words.any(axis=1)).tolist()
        for row in suspects:
            seq, grammar = sampling[row], grammars[row]
            if grammar.is_error() or (not grammar.is_accepting() and _only_eos(bitmask[row], eos)):
                bitmask[row] = 0
                bitmask[row, eos // 32] = _int32(1 << (eos % 32))
                text = self.compiler.tokenizer.decode(seq.output_token_ids)
                why = (f"llguidance failed on its {seq.sampling_params.structured_outputs.kind} constraint ({grammar.error_message()})"
                       if grammar.is_error() else f"no token of the vocabulary continues its {seq.sampling_params.structured_outputs.kind} "
                       "constraint (it cannot be completed with this tokenizer)")
                self._dead[seq.seq_id] = f"{why} after {seq.num_output_tokens} generated tokens"
                logger.warning("request %r: %s after %d generated tokens (%r); the completion ends here, incomplete",
                               seq.request_id, why, seq.num_output_tokens, text[-60:])

    def forced_tokens(self, seq, limit: int = MAX_JUMP_TOKENS) -> list[int]:
        """Jump-forward decoding: the tokens ``seq``'s grammar forces next (at most ``limit``),
        accepted into it (``Grammar.forced_tokens``); none when nothing is forced, jump-forward is
        off, or ``seq`` is unconstrained, in a dead end, or asks for logprobs (a forced token's
        logprobs are those of a one-token mask, left to its step). The engine appends them as if
        sampled: the mask of each such state allows that token alone, so greedy and seeded sampling
        pick it too (draws are keyed by position), and the next step computes them with the next
        sampled position as a short prefill chunk. The caller counts the ones it appends
        (``num_jump_forward_tokens``)."""
        entry = self._grammars.get(seq.seq_id) if self.jump_forward else None
        if entry is None or seq.logprobs is not None or seq.beam_group is not None or seq.seq_id in self._dead:
            return []
        return entry[1].forced_tokens(limit)

    def accept(self, seqs: list, token_ids: list[int]) -> dict[int, str]:
        """Advance the matchers of the constrained ``seqs`` over their new tokens (before the
        engine appends them). Returns {seq id: why} of the sequences their grammar ends in this
        step (a dead end or a matcher in error: they sampled EOS, their only allowed token), for
        the engine to report (``LLMEngine``, a request's ``on_error``)."""
        self._join()
        grammars = self._grammars
        failed: dict[int, str] = {}
        if not grammars:
            return failed
        dead = self._dead
        for seq, token in zip(seqs, token_ids):
            entry = grammars.get(seq.seq_id)
            if entry is None:
                continue  # not constrained
            if dead:
                why = dead.pop(seq.seq_id, None)
                if why is not None:  # a dead end: it sampled EOS, its only allowed token, and ends
                    failed[seq.seq_id] = why
                    del grammars[seq.seq_id]
                    continue
            grammar = entry[1]
            if token in seq.eos_token_ids and grammar.is_terminated():
                continue  # EOS after a grammar that ended by itself (NoExtension)
            grammar.accept([token])  # refused (a parser limit such as max_items_in_row met mid-generation):
            # the matcher is in error, and the next mask (``_check_dead_ends``) ends the request with a warning
        return failed


class _TimedFuture:
    """A fill's future whose ``result`` adds the time the caller waited to ``manager.mask_wait_seconds``."""

    def __init__(self, future: concurrent.futures.Future, manager: StructuredOutputManager) -> None:
        self.future, self.manager = future, manager

    def result(self):
        start = time.perf_counter()
        try:
            return self.future.result()
        finally:
            self.manager.mask_wait_seconds += time.perf_counter() - start


def _num_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
