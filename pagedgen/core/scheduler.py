"""Iteration-level (continuous) batching with first-come-first-served admission and preemption.

Every call to ``schedule`` plans one model step (Orca, OSDI 2022; PagedAttention paper, section 4.5):
finished sequences have already left, running sequences get their next token (or their next prefill
chunk), swapped-out sequences come back, and waiting sequences join while the token budget,
``max_num_seqs`` and free blocks allow. A prompt longer than what is left of the token budget is
prefilled in chunks over several steps. A waiting sequence first takes whatever full blocks of its
tokens the prefix cache holds and computes only the rest.

When the running sequences need more blocks than are free, the most recently admitted running
sequence is preempted, all or nothing. *Recompute*: its blocks are freed and it goes back to the
head of the waiting queue; its prompt and the tokens it had generated are prefilled again when it
is readmitted. *Swap*: its blocks are copied to CPU swap space and freed; it comes back (copied
in again) before any waiting sequence is admitted. Evicting the newest first keeps FCFS: the oldest
requests, which hold the most work already done, finish first, and no request starves. No tensors.

The plan of a step is plain data (``SchedulerOutput``: ids, token ids, block-table deltas, block
moves), so that it can be sent to model workers in other processes; see ``scheduler_output``.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional

from pagedgen.config import SchedulerConfig
from pagedgen.core.block_manager import BlockManager
from pagedgen.core.scheduler_output import SchedulerOutput
from pagedgen.core.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerStats:
    """Counters since the scheduler was made."""

    num_steps: int = 0
    num_preemptions: int = 0  # all preemptions (recompute + swap)
    num_recomputes: int = 0
    num_swaps_out: int = 0
    num_swaps_in: int = 0
    num_prefill_tokens: int = 0  # prompt (and recomputed) tokens computed
    num_decode_tokens: int = 0  # tokens computed one at a time after the prompt


class Scheduler:
    """Decides, step by step, which sequences run and how many tokens each computes.

    Args:
        config: limits of one step and the preemption mode.
        block_manager: the device KV block accounting this scheduler allocates from.
        cpu_block_manager: the CPU swap space's blocks (needed for ``preemption_mode="swap"``).

    A sequence must fit the cache when alone (prompt <= max_model_len <= cache slots); callers
    reject those that cannot, so a lone running sequence never needs to preempt itself.
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, cpu_block_manager: Optional[BlockManager] = None) -> None:
        if config.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {config.preemption_mode!r}")
        self.config = config
        self.block_manager = block_manager
        self.cpu_block_manager = cpu_block_manager
        self.waiting: deque[Sequence] = deque()
        self.swapped: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: running[-1] is the newest
        self.seqs: dict[int, Sequence] = {}  # every unfinished sequence, by seq_id
        self.stats = SchedulerStats()
        # block tables as the last SchedulerOutputs gave them (what a worker's mirror holds), and
        # the sequences freed since the last step: the next output's deltas are computed from them
        self._sent_tables: dict[int, list[int]] = {}
        self._sent_released: dict[int, int] = {}  # released entries (sliding window) of those tables
        self._freed: list[int] = []
        self.scheduled: list[Sequence] = []  # the Sequences of the last output's seq_ids, in order
        self._planned: list[Sequence] = []  # during schedule(): the sequences planned so far
        self._grown: list[Sequence] = []  # during schedule(): those whose table may have changed
        self._num_decode = 0  # during schedule(): decode tokens planned so far

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.seqs[seq.seq_id] = seq
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self) -> SchedulerOutput:
        """Plan the next step. Allocates blocks for every planned token; ``scheduled`` then holds
        the Sequences of the output's ``seq_ids``, in order."""
        out = SchedulerOutput()
        self._planned = []  # the sequences of this step so far, in batch order
        self._grown = []  # those of them whose block table may differ from the one last sent
        self._num_decode = 0  # of their tokens, those computed one at a time after the prompt
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager

        # 1. Running sequences, oldest first: a decode token each, or the next prefill chunk.
        running = self.running
        i = 0
        while budget > 0:
            i, budget = self._plan_in_place(i, budget, out)  # the run of sequences whose tokens fit their last block
            if i == len(running) or budget <= 0:
                break
            seq = running[i]
            n = min(len(seq.token_ids) - seq.num_computed_tokens, budget)  # > 0: the run stopped here
            while not bm.can_allocate(seq.seq_id, seq.num_computed_tokens + n):
                victim = running.pop()  # the newest
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                self._plan(seq, n, out)
                budget -= n
                i += 1
                continue
            break  # seq itself was preempted: everything after it is gone too

        # 2.-3. Swapped-out, then waiting sequences; none while preemption is under way.
        if not out.preempted_seq_ids:
            budget = self._admit(out, budget)
        # Sequences with nothing to compute (beams waiting for their group) may hold every block
        # while a sibling waits: recompute the newest later (behind the queue) until something runs.
        while not self._planned and self.running and (self.waiting or self.swapped):
            self._preempt(self.running.pop(), out, allow_swap=False, requeue_last=True)
            budget = self._admit(out, budget)

        out.blocks_to_copy = bm.take_copies()
        self._fill_plan(out, self._planned)
        # freed last: a sequence preempted in this step may be readmitted in it too, its table sent
        # whole; a mirror forgets the freed tables before it applies the updates
        if self._freed:
            out.freed_seq_ids, self._freed = self._freed, []
        self.scheduled, self._planned, self._grown = self._planned, [], []
        stats = self.stats
        stats.num_steps += 1
        stats.num_decode_tokens += self._num_decode
        stats.num_prefill_tokens += sum(out.num_new_tokens) - self._num_decode
        return out

    def _fill_plan(self, out: SchedulerOutput, planned: list[Sequence]) -> None:
        """The plain data of the planned sequences: ids, first positions, token ids, and the
        block-table updates (what changed in a table since the last output that held it) of the
        sequences whose table may have changed. Tables only grow at the end, except that
        copy-on-write replaces the last block and a sliding window turns the entries after those
        already released into placeholders, so comparing with the last block sent and with the
        released count sent is enough."""
        out.seq_ids = [seq.seq_id for seq in planned]
        out.num_computed_tokens = starts = [seq.num_computed_tokens for seq in planned]
        out.token_ids = [seq.token_ids[c : c + n] for seq, c, n in zip(planned, starts, out.num_new_tokens)]
        out.partial_seq_ids = [seq.seq_id for seq, c, n in zip(planned, starts, out.num_new_tokens)
                               if seq.num_prompt_tokens <= c + n < len(seq.token_ids)]
        self._table_updates(out, self._grown)

    def _table_updates(self, out: SchedulerOutput, grown: list[Sequence]) -> None:
        """The block-table deltas of ``grown`` since the tables last sent (see ``_fill_plan``)."""
        sent_tables, tables, updates = self._sent_tables, self.block_manager.block_table, out.block_table_updates
        sent_released, num_released = self._sent_released, self.block_manager.num_released
        for seq in grown:
            seq_id = seq.seq_id
            table = tables(seq_id)
            sent = sent_tables.get(seq_id)
            if sent is None:
                sent_tables[seq_id] = list(table)
                sent_released[seq_id] = num_released(seq_id)
                updates[seq_id] = (0, list(table))
                continue
            start = len(sent)
            if start and sent[-1] != table[start - 1]:
                start -= 1
            released = num_released(seq_id)
            if released != sent_released.get(seq_id, 0):
                start = min(start, sent_released.get(seq_id, 0))
                sent_released[seq_id] = released
            if start < len(table) or start < len(sent):
                delta = table[start:]
                sent[start:] = delta
                updates[seq_id] = (start, delta)

    def add_lookahead(self, out: SchedulerOutput, drafts: dict[int, list[int]]) -> dict[int, list[int]]:
        """Speculative decoding: reserve lookahead slots for the draft tokens of decode sequences of
        the step just planned (``drafts``: index in ``scheduled`` -> draft token ids) and add them to
        the plan (the sequence computes its last token and the drafts, k + 1 rows). Drafts never
        preempt anything: a sequence whose drafts do not fit the free blocks or the token budget
        gets fewer or none. Returns the drafts kept, by index."""
        bm = self.block_manager
        budget = self.config.max_num_batched_tokens - sum(out.num_new_tokens)
        kept: dict[int, list[int]] = {}
        grown: list[Sequence] = []
        for i, draft in drafts.items():
            seq = self.scheduled[i]
            draft = draft[: max(budget, 0)]
            total = seq.num_computed_tokens + 1 + len(draft)
            if not draft or not bm.can_allocate(seq.seq_id, total):
                continue
            bm.allocate(seq.seq_id, total)  # no token ids: draft slots never enter the prefix cache
            out.num_new_tokens[i] += len(draft)
            out.token_ids[i] = out.token_ids[i] + draft
            budget -= len(draft)
            kept[i] = draft
            grown.append(seq)
        out.blocks_to_copy.extend(bm.take_copies())
        planned = {seq.seq_id: out.block_table_updates.pop(seq.seq_id) for seq in grown if seq.seq_id in out.block_table_updates}
        self._table_updates(out, grown)
        for seq_id, (start, _) in planned.items():  # one delta per step: from the planned one's start
            new = out.block_table_updates.get(seq_id)
            if new is None or start < new[0]:
                out.block_table_updates[seq_id] = (start, list(bm.block_table(seq_id)[start:]))
        return kept

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        """Give back a sequence's slots past ``num_tokens`` (its rejected draft tokens); the table a
        worker holds is cut to match (its next delta starts from the shorter table)."""
        self.block_manager.truncate(seq.seq_id, num_tokens)
        sent = self._sent_tables.get(seq.seq_id)
        if sent is not None:
            del sent[len(self.block_manager.block_table(seq.seq_id)) :]

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        """Bring back swapped-out sequences, then admit waiting ones, first come first served,
        while the token budget, ``max_num_seqs`` (sequences computing in this step, counting the
        completions a parallel-sampling request forks into) and free blocks allow."""
        bm, cpu, limit = self.block_manager, self.cpu_block_manager, self.config.max_num_seqs
        loras = {s.lora_int_id for s in self.running} - {0} if self.config.max_loras else None  # adapters running
        while self.swapped and budget > 0 and len(self._planned) < limit:
            seq = self.swapped[0]
            if loras is not None and not self._lora_fits(seq, loras):
                return budget
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not bm.can_allocate_copy(cpu.num_tokens(seq.seq_id), cpu.num_released(seq.seq_id), n):
                return budget
            self.swapped.popleft()
            self._swap_in(seq, out)
            self.running.append(seq)
            if n:
                self._plan(seq, n, out)
                budget -= n
        while self.waiting and not self.swapped and budget > 0 and len(self._planned) + 1 + len(self.waiting[0].pending_forks) <= limit:
            seq = self.waiting[0]
            if loras is not None and not self._lora_fits(seq, loras):
                break  # its adapter would be one more than the slots: it waits (FCFS)
            # pooling other than LAST (MEAN, CLS, ALL, STEP) needs every prompt position's hidden state:
            # no prefix-cache hits then
            every_row = seq.pooling is not None and seq.pooling.needs_all_rows
            prefix = bm.match_prefix(seq.token_ids, seq.cache_salt) if seq.num_computed_tokens == 0 and not every_row else []
            if prefix and seq.prompt_logprobs is not None:
                # prompt logprobs need the logits from position len(prompt_logprobs) - 1 on (all of
                # them unless prompt_logprob_start says otherwise): cached blocks only before it
                prefix = prefix[: (len(seq.prompt_logprobs) - 1) // bm.block_size]
            cached = len(prefix) * bm.block_size
            n = min(seq.num_tokens - max(cached, seq.num_computed_tokens), budget)
            if n < seq.num_tokens and seq.pooling is not None and seq.pooling.whole_prompt:
                break  # an encoder's prompt (bidirectional attention) is computed whole, in one step: wait for the budget
            if not bm.can_allocate(seq.seq_id, max(cached, seq.num_computed_tokens) + n, prefix):
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            if seq.num_computed_tokens == 0:
                bm.record_prefix_lookup(seq.num_tokens, cached)
                if seq.num_cached_tokens is None:
                    seq.num_cached_tokens = min(cached, seq.num_prompt_tokens)
                seq.num_computed_tokens = cached
            bm.allocate(seq.seq_id, seq.num_computed_tokens, seq.token_ids, prefix, seq.cache_salt)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._plan(seq, n, out)
            budget -= n
        return budget

    def _lora_fits(self, seq: Sequence, loras: set) -> bool:
        """Whether ``seq``'s adapter can run beside ``loras`` (then added to them): at most
        ``max_loras`` distinct adapters among the running sequences."""
        lora = seq.lora_int_id
        if lora and lora not in loras:
            if len(loras) >= self.config.max_loras:
                return False
            loras.add(lora)
        return True

    def _plan_in_place(self, i: int, budget: int, out: SchedulerOutput) -> tuple[int, int]:
        """Plan ``running[i:]`` while each sequence's next tokens fit the last block it holds (the
        common decode step: no block taken, its table unchanged) and the token budget lasts; return
        the index of the first sequence not planned (``len(running)`` when all are) and the budget
        left. Skips sequences with nothing to compute (a beam waiting for its group). Leaves every
        sequence from the returned index on as it was, so the caller can allocate (or preempt) for it."""
        running, planned, counts = self.running, self._planned, out.num_new_tokens
        sent, grown = self._sent_tables, self._grown
        append_in_place = self.block_manager.append_in_place
        num_decode = 0
        end = len(running)
        while i < end and budget > 0:
            seq = running[i]
            token_ids, c = seq.token_ids, seq.num_computed_tokens
            n = len(token_ids) - c
            if n == 1:  # a decode token, or the last prompt token (prefill)
                if not append_in_place(seq.seq_id, c + 1, token_ids, seq.cache_salt):
                    break
                if c >= seq.num_prompt_tokens:
                    num_decode += 1
            elif n:
                n = min(n, budget)
                if not append_in_place(seq.seq_id, c + n, token_ids, seq.cache_salt):
                    break
            else:  # nothing to compute
                i += 1
                continue
            planned.append(seq)
            counts.append(n)
            if seq.seq_id not in sent:  # new to a worker's mirror (a fork's first step)
                grown.append(seq)
            budget -= n
            i += 1
        self._num_decode += num_decode
        return i, budget

    def _plan(self, seq: Sequence, n: int, out: SchedulerOutput) -> None:
        """Allocate the slots of ``n`` more tokens of a running sequence and add it to the step."""
        self.block_manager.allocate(seq.seq_id, seq.num_computed_tokens + n, seq.token_ids, salt=seq.cache_salt)
        self._planned.append(seq)
        self._grown.append(seq)
        out.num_new_tokens.append(n)
        if n == 1 and seq.num_prompt_tokens <= seq.num_computed_tokens == len(seq.token_ids) - 1:
            self._num_decode += 1

    def finish_many(self, seqs: list[Sequence]) -> None:
        """Retire finished (or dropped) sequences: out of every queue, blocks freed."""
        if not seqs:
            return
        done = set(seqs)  # Sequences hash and compare by identity
        self.running = [s for s in self.running if s not in done]
        if any(s.status is not SequenceStatus.RUNNING for s in seqs):
            self.waiting = deque(s for s in self.waiting if s not in done)
            self.swapped = deque(s for s in self.swapped if s not in done)
        for seq in seqs:
            seq.status = SequenceStatus.FINISHED
            self.seqs.pop(seq.seq_id, None)
            self._release(seq)

    def add_fork(self, seq: Sequence, parent: Sequence) -> None:
        """Queue a sequence forked from ``parent``: right behind it among the running ones (same
        admission age) when the parent runs and the fork shares its blocks; otherwise at the head
        of the waiting queue, to compute its tokens when admitted."""
        self.seqs[seq.seq_id] = seq
        if parent.status is SequenceStatus.RUNNING:
            seq.status = SequenceStatus.RUNNING
            self.running.insert(self.running.index(parent) + 1, seq)
        else:
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)

    def abort_all(self) -> list[Sequence]:
        """Drop every sequence and free their blocks (after an error). Also frees the blocks of
        any sequence the queues lost track of (an interrupt between two of their updates)."""
        dropped = list({id(s): s for s in [*self.running, *self.swapped, *self.waiting, *self.seqs.values()]}.values())
        self.running, self.swapped, self.waiting, self.seqs, self.scheduled = [], deque(), deque(), {}, []
        for seq in dropped:
            seq.status = SequenceStatus.FINISHED
            self._release(seq)
        self._freed.extend(self._sent_tables)  # a worker's mirror forgets every table
        self._sent_tables, self._sent_released = {}, {}
        self.block_manager.take_copies()
        return dropped

    def _release(self, seq: Sequence) -> None:
        """Free the sequence's blocks (device and swap space)."""
        self._forget_table(seq.seq_id)
        self.block_manager.free(seq.seq_id)
        if self.cpu_block_manager is not None:
            self.cpu_block_manager.free(seq.seq_id)

    def _forget_table(self, seq_id: int) -> None:
        self._sent_released.pop(seq_id, None)
        if self._sent_tables.pop(seq_id, None) is not None:
            self._freed.append(seq_id)

    def _preempt(self, seq: Sequence, out: SchedulerOutput, allow_swap: bool = True, requeue_last: bool = False) -> None:
        """Preempt a running sequence, all or nothing: swap it out if configured and there is
        room in swap space, else free everything and requeue it at the head for recompute. Swap
        moves only the blocks the sequence still holds (not those released before its window)."""
        bm, cpu = self.block_manager, self.cpu_block_manager
        seq_id = seq.seq_id
        table, released, num_tokens = bm.block_table(seq_id), bm.num_released(seq_id), bm.num_tokens(seq_id)
        out.preempted_seq_ids.append(seq_id)
        self._forget_table(seq_id)
        seq.num_preemptions += 1
        self.stats.num_preemptions += 1
        if allow_swap and self.config.preemption_mode == "swap" and cpu is not None and table and cpu.can_allocate_copy(num_tokens, released):
            cpu.allocate_copy(seq_id, num_tokens, released)
            out.blocks_to_swap_out.extend(zip(table[released:], cpu.held_blocks(seq_id)))
            bm.free(seq.seq_id)
            seq.status = SequenceStatus.SWAPPED
            self.swapped.appendleft(seq)
            self.stats.num_swaps_out += 1
            return
        bm.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        if requeue_last:
            self.waiting.append(seq)
        else:
            self.waiting.appendleft(seq)
        self.stats.num_recomputes += 1

    def _swap_in(self, seq: Sequence, out: SchedulerOutput) -> None:
        cpu, bm, seq_id = self.cpu_block_manager, self.block_manager, seq.seq_id
        bm.allocate_copy(seq_id, cpu.num_tokens(seq_id), cpu.num_released(seq_id))
        released = bm.num_released(seq_id)  # >= the copy's: blocks before the window are not taken back
        out.blocks_to_swap_in.extend(zip(cpu.block_table(seq_id)[released:], bm.held_blocks(seq_id)))
        cpu.free(seq.seq_id)
        seq.status = SequenceStatus.RUNNING
        self.stats.num_swaps_in += 1
