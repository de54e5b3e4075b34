"""The driver's side of speculative decoding: propose drafts for the step's decode sequences,
reserve their lookahead slots, and after the step commit the kept tokens one by one through the
engine's normal per-token path (stop checks after each) and give back the rejected slots.

N-gram drafts are proposed here. A draft model lives with the target in the worker (spec_decode/
draft_model.py): here a speculating sequence gets k ``PLACEHOLDER`` drafts, whose lookahead slots
are reserved like any drafts', and the worker replaces them with the draft model's proposals (in
``batch.drafts`` and the plan's token ids) before the target's pass.

Which sequences speculate: decode sequences (one token to compute, the prompt done), not beams,
not a step with a structured-output bitmask, not a sliding-window model, not a sequence with completions still to fork; none in
a step with ``disable_by_batch_size`` or more running sequences. k is capped so that the k + 1
tokens a step can keep do not pass the sequence's length limit (max_tokens, max_model_len).

Back-off (n-gram drafts): a sequence counts its full misses (steps whose drafts were all rejected, not even the
first kept); from ``miss_limit`` on, each full miss pauses its proposals for 1 step, then 2, 4, ...
up to ``max_pause`` steps, and a step that keeps a draft halves the count (so one lucky hit in a long
run of misses does not bring back speculation at every step; a sequence that keeps hitting soon
counts zero and never pauses). A miss costs the
k draft rows, their lookahead slots and the proposal itself for no token; where lookup keeps
missing, a paused sequence decodes as without speculation, and the periodic retry finds the places
where it starts to copy again. Which steps speculate never changes a token (every kept token is the
one speculation off would produce), so outputs stay equal; only steps that verified drafts count in
the statistics.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from pagedgen.spec_decode.config import SpeculativeConfig
from pagedgen.spec_decode.ngram import INDEX_MAX_N, NgramIndex, propose

#: a draft token the worker's draft model has still to propose (never fed to a model)
PLACEHOLDER = -1


@dataclass
class SpecStats:
    """Draft tokens proposed and accepted since the engine was made, in total and by position."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    proposed_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        for counts, n in ((self.proposed_per_position, num_drafts), (self.accepted_per_position, num_accepted)):
            if len(counts) < n:
                counts.extend([0] * (n - len(counts)))
            for p in range(n):
                counts[p] += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted

    def acceptance_rate_per_position(self) -> list[float]:
        """Accepted / proposed at each draft position proposed at least once (0.0 where none was
        accepted)."""
        accepted = self.accepted_per_position + [0] * (len(self.proposed_per_position) - len(self.accepted_per_position))
        return [a / p for a, p in zip(accepted, self.proposed_per_position)]


MISS_LIMIT = 2  # full misses in a row before a sequence pauses its proposals
MAX_PAUSE = 16  # steps: the longest pause, so a sequence retries at least this often


class Speculator:
    """Speculation for one engine: n-gram drafts, or placeholders for a draft model's.

    ``miss_limit``, ``max_pause``: the n-gram back-off (module docstring); ``miss_limit=None``
    turns it off. A draft model's sequences do not back off.
    """

    def __init__(self, config: SpeculativeConfig, miss_limit: Optional[int] = MISS_LIMIT, max_pause: int = MAX_PAUSE) -> None:
        self.config = config
        self.stats = SpecStats()
        self.miss_limit, self.max_pause = miss_limit, max_pause
        self._backoff: dict[int, list[int]] = {}  # seq_id -> [full misses in a row, steps left paused]
        self._indexes: dict[int, NgramIndex] = {}  # seq_id -> its n-gram index (lookups up to INDEX_MAX_N)

    def plan(self, batch, scheduler) -> dict[int, list[int]]:
        """Drafts for the decode sequences of ``batch`` (just scheduled), their lookahead slots
        reserved in the plan; returns {seq_id: drafts}."""
        cfg = self.config
        if batch.grammar_bitmask is not None or scheduler.block_manager.sliding_window:
            return {}  # structured outputs, sliding-window models: not speculated (untested there)
        if cfg.disable_by_batch_size is not None and len(scheduler.running) >= cfg.disable_by_batch_size:
            return {}
        backoff, live = self._backoff, scheduler.seqs
        if len(backoff) + len(self._indexes) > 2 * len(live) + 64:  # forget finished sequences now and then
            self._backoff = backoff = {s: v for s, v in backoff.items() if s in live}
            self._indexes = {s: v for s, v in self._indexes.items() if s in live}
        wanted: dict[int, list[int]] = {}
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.plan.num_new_tokens)):
            c = seq.num_computed_tokens
            if n != 1 or c + 1 != len(seq.token_ids) or c < seq.num_prompt_tokens or seq.beam_group is not None or seq.pending_forks:
                continue
            state = backoff.get(seq.seq_id)
            if state is not None and state[1]:  # paused after full misses
                state[1] -= 1
                continue
            k = min(cfg.num_speculative_tokens, seq._max_len - len(seq.token_ids) - 1)
            if k < 1:
                continue
            draft = [PLACEHOLDER] * k if cfg.method == "draft_model" else self._propose(seq, k)
            if draft:
                wanted[i] = draft
        if not wanted:
            return {}
        kept = scheduler.add_lookahead(batch.plan, wanted)
        return {batch.seqs[i].seq_id: draft for i, draft in kept.items()}

    def _propose(self, seq, k: int) -> list[int]:
        """Up to ``k`` n-gram drafts for ``seq``: from its NgramIndex (a sequence's token ids only
        grow), or by ``propose`` over all its tokens for lookups longer than ``INDEX_MAX_N``."""
        cfg = self.config
        if cfg.prompt_lookup_max > INDEX_MAX_N:
            return propose(seq.token_ids, k, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        index = self._indexes.get(seq.seq_id)
        if index is None:
            index = self._indexes[seq.seq_id] = NgramIndex(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        return index.propose(seq.token_ids, k)

    def commit(self, spec, finished: list, scheduler) -> int:
        """Append each verified sequence's kept tokens after its first (already appended), stopping
        at the first that ends it (added to ``finished``); roll back the slots of what was not
        kept. Returns the tokens appended."""
        done = set(finished)
        appended = 0
        for seq, more, entries, draft in spec:
            self.stats.record(len(draft), len(more))
            self._back_off(seq.seq_id, len(more))
            if seq in done:
                continue
            ended = False
            for tok, entry in zip(more, entries):
                if entry is not None:
                    seq.add_logprobs(entry, tok)
                appended += 1
                if seq.append_token(tok):
                    ended = True
                    finished.append(seq)
                    break
            if not ended:
                keep = len(seq.token_ids) - 1  # the last kept token is computed next step
                scheduler.rollback(seq, keep)
                seq.num_computed_tokens = keep
        return appended

    def _back_off(self, seq_id: int, num_accepted: int) -> None:
        """Update a verified sequence's back-off (module docstring) with its accepted drafts."""
        if self.miss_limit is None or self.config.method != "ngram":
            return
        state = self._backoff.get(seq_id)
        if num_accepted:
            if state is not None:
                state[0] //= 2  # a kept draft halves the misses: a rare hit does not undo a long streak
                if not state[0]:
                    del self._backoff[seq_id]
            return
        if state is None:
            state = self._backoff[seq_id] = [0, 0]
        state[0] += 1
        if state[0] >= self.miss_limit:
            state[1] = min(self.max_pause, 1 << min(state[0] - self.miss_limit, 30))
