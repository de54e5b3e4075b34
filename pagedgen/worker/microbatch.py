"""Micro-batches of one step for pipeline parallelism: split a ``ScheduledBatch``, merge the outputs.

With P pipeline stages a step's scheduled sequences are cut into up to P contiguous micro-batches
of about equal token counts, so that stage 0 computes micro-batch 1 while stage 1 computes
micro-batch 0 (GPipe's schedule within one engine step; the driver still runs one step at a time):

    stage 0:  [mb 0][mb 1]
    stage 1:        [mb 0][mb 1]         -> the last stage samples each, the outputs merged

Every rank computes the same split from the same plan. A micro-batch is an ordinary
``ScheduledBatch`` of its sequences: the first carries the step's block-table updates and freed
ids (the runner's block tables take them once, before any micro-batch is prepared); the block
moves (swap, copy-on-write) run once for the whole step before the first. A forked parallel sample
goes with its parent (it samples from the parent's row). Each sequence's rows are computed exactly
as in the unsplit step when the kernels are batch-invariant (the default on CPUs,
docs/determinism.md), and the draws are keyed by (seed, completion, position), so the merged
output is bitwise the unsplit step's; ``merge`` puts it in the unsplit step's order.
"""
from __future__ import annotations

from itertools import accumulate

from pagedgen.core.scheduler_output import ScheduledBatch, SchedulerOutput


def split(batch: ScheduledBatch, parts: int) -> list[ScheduledBatch]:
    """Up to ``parts`` micro-batches of ``batch`` (contiguous runs of its sequences, balanced by
    tokens; fewer when there are fewer sequences; ``[batch]`` for one part)."""
    plan = batch.plan
    n = len(plan.seq_ids)
    if parts <= 1 or n <= 1:
        return [batch]
    cum = list(accumulate(plan.num_new_tokens, initial=0))  # [n + 1]
    total, cuts = cum[-1], [0]
    for j in range(1, parts):
        target = total * j / parts
        i = next(i for i in range(1, n + 1) if cum[i] >= target)  # the first prefix that reaches the share
        cuts.append(min(max(i, cuts[-1] + 1), n))
    cuts.append(n)
    out = []
    for a, b in zip(cuts, cuts[1:]):
        if a >= b:
            continue
        ids = set(plan.seq_ids[a:b])
        first = not out
        sub = SchedulerOutput(
            seq_ids=plan.seq_ids[a:b],
            num_new_tokens=plan.num_new_tokens[a:b],
            num_computed_tokens=plan.num_computed_tokens[a:b],
            token_ids=plan.token_ids[a:b],
            block_table_updates=plan.block_table_updates if first else {},  # (the runner applies the whole step's before the split)
            freed_seq_ids=plan.freed_seq_ids if first else [],
            forked=[(c, p) for c, p in plan.forked if p in ids],
            partial_seq_ids=[s for s in plan.partial_seq_ids if s in ids],
        )
        mask = batch.grammar_bitmask
        if mask is not None and not ids.union(c for c, _ in sub.forked).intersection(mask.seq_ids):
            mask = None
        forked = [(c, p) for c, p in batch.forked if p.seq_id in ids]
        out.append(ScheduledBatch(sub, batch.seqs[a:b], forked, mask))
    return out


def merge(batch: ScheduledBatch, outputs: list):
    """One ``StepOutput`` of the micro-batches' ``outputs``, in the unsplit step's order (sampled
    sequences in plan order, then the forked children in fork order; beams and prompt logprobs in
    plan order). ``outputs``: the model runner's ``StepOutput``s (built here by their own type:
    this module sits below the model runner)."""
    if len(outputs) == 1:
        return outputs[0]
    order = {seq.seq_id: i for i, seq in enumerate(batch.seqs)}
    n = len(order)
    for j, (child, _) in enumerate(batch.forked):
        order[child.seq_id] = n + j
    asked = any(o.logprobs is not None for o in outputs)
    rows = []
    for o in outputs:
        lps = o.logprobs if o.logprobs is not None else [None] * len(o.seqs)
        rows.extend(zip(o.seqs, o.token_ids, lps))
    rows.sort(key=lambda r: order[r[0].seq_id])
    out = type(outputs[0])([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows] if asked else None)
    out.prompt_logprobs = sorted((p for o in outputs for p in o.prompt_logprobs), key=lambda p: order[p[0].seq_id])
    out.beam_logprobs = sorted((b for o in outputs for b in o.beam_logprobs), key=lambda b: order[b[0].seq_id])
    return out
