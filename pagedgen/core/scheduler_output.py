"""The step boundary: what the scheduler decided for one model step, as plain data.

``SchedulerOutput`` holds only ids, counts, token ids and block ids (no Sequence objects, no
tensors), so that it can be pickled and sent to worker processes that own a shard of the model
and of the KV cache (tensor or pipeline parallelism, the pattern of vLLM v1's ``SchedulerOutput``).
A worker keeps a mirror of the block tables and updates it with ``apply_block_tables``; with the
token ids and the first position of each scheduled sequence it has every input of the forward
pass: positions, slot mapping, block tables, and which rows give logits. Sampling, stop checks and
request state stay with the engine that owns the scheduler.

``ScheduledBatch`` is the same step for a model runner: the plan plus the Sequence objects its ids
name (in this process the driver's own; in a worker the mirrors it built from the step records,
pagedgen/worker/worker.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SchedulerOutput:
    """The plan of one step.

    Scheduled sequences, in batch order (``seq_ids[i]`` computes tokens ``num_computed_tokens[i] ..
    num_computed_tokens[i] + num_new_tokens[i] - 1``, whose ids are ``token_ids[i]``; it samples when
    that reaches the end of its tokens):
        seq_ids, num_new_tokens, num_computed_tokens, token_ids
    ``block_table_updates``: {seq_id: (start, block ids)}: that sequence's table is the previous one
    with everything from index ``start`` on replaced by the block ids (a sequence new to a mirror,
    or back after preemption, gets its whole table from 0; a copy-on-write replaces the last
    block; blocks released before a sliding window become placeholders, sent from the first one
    newly released). A scheduled sequence not in it keeps its table: most decode steps take no
    new block.
    ``freed_seq_ids``: sequences whose tables were freed since the previous output or while this
    one was planned (finished, aborted, preempted): a mirror forgets them before applying the
    deltas (a sequence preempted and readmitted in one step is in both, its table sent whole).
    Block moves to run before the model step, in this order, each a list of (src, dst) block ids:
    ``blocks_to_swap_out`` (device -> CPU swap space), ``blocks_to_swap_in`` (CPU -> device),
    ``blocks_to_copy`` (copy-on-write, within the device cache).
    ``preempted_seq_ids``: preempted in this step (recompute or swap).
    ``forked``: (child, parent) seq ids of parallel samples forked in this step (by the engine, after
    scheduling): a child shares its parent's blocks and samples from its parent's logits row; its
    table reaches a mirror, whole, the first time it is scheduled.
    ``partial_seq_ids``: scheduled sequences whose step stops short of their last known token after
    the prompt (the tokens a grammar forced, appended by jump-forward decoding, in more than one
    chunk): they do not sample, though a worker's mirror, which learns such tokens only as they are
    scheduled, sees the step reach its end.
    """

    seq_ids: list[int] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    block_table_updates: dict[int, tuple[int, list[int]]] = field(default_factory=dict)
    freed_seq_ids: list[int] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    preempted_seq_ids: list[int] = field(default_factory=list)
    forked: list[tuple[int, int]] = field(default_factory=list)
    partial_seq_ids: list[int] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def apply_block_tables(self, tables: dict[int, list[int]]) -> None:
        """Bring a worker's mirror ``{seq_id: block table}`` up to date with this step."""
        for seq_id in self.freed_seq_ids:
            tables.pop(seq_id, None)
        for seq_id, (start, new) in self.block_table_updates.items():
            table = tables.setdefault(seq_id, [])
            del table[start:]
            table.extend(new)


@dataclass
class ScheduledBatch:
    """One step for the in-process model runner: ``plan`` and the sequences it names.

    ``seqs[i]`` is the Sequence of ``plan.seq_ids[i]``; ``forked`` the (child, parent) Sequences of
    ``plan.forked``. The other attributes read through to the plan.
    """

    plan: SchedulerOutput
    seqs: list[Any]
    forked: list[tuple[Any, Any]] = field(default_factory=list)
    grammar_bitmask: Any = None  # structured outputs: the step's GrammarBitmask (structured_output/manager.py), for the sampler
    drafts: dict = field(default_factory=dict)  # speculative decoding: {seq_id: draft token ids} (pagedgen/spec_decode/)

    @property
    def num_new_tokens(self) -> list[int]:
        return self.plan.num_new_tokens

    @property
    def blocks_to_swap_out(self) -> list[tuple[int, int]]:
        return self.plan.blocks_to_swap_out

    @property
    def blocks_to_swap_in(self) -> list[tuple[int, int]]:
        return self.plan.blocks_to_swap_in

    @property
    def blocks_to_copy(self) -> list[tuple[int, int]]:
        return self.plan.blocks_to_copy
