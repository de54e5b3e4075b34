"""Pooling in the worker: which rows of a step a pooling sequence needs, the hidden states of its
prompt gathered across prefill chunks, and its result once the prompt is computed (vLLM's
``Pooler``: LAST, MEAN, CLS, ALL, STEP; then the classification head, the activation, matryoshka
``dimensions``, L2 normalisation).

A pooling sequence is prefilled like any prompt (chunked when long, its KV blocks from the pool)
and never decodes: the step that computes its last prompt token returns its result, and the engine
finishes it. Rows per step:

    LAST         the last prompt row, in the step that computes it (earlier chunks and prefix-cache
                 hits need none: a decoder's last row sees the whole prompt through the KV cache)
    MEAN/CLS/    every row the step computes; the chunks are kept per sequence (``_chunks``, keyed by
    ALL/STEP     seq id) and joined in the last one, so the result does not depend on the chunking.
                 These sequences skip the prefix cache (core/scheduler.py): every row is computed.

A chunk that starts at position 0 starts the sequence afresh (a recompute after preemption);
freed sequences (finished, aborted) are forgotten.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from pagedgen.core.sequence import Sequence
from pagedgen.pooling_params import PoolingSpec


@dataclass
class _Item:
    seq: Sequence
    offset: int  # its first row among the step's pooled rows
    count: int  # rows it has this step
    start: int  # the position of its step's first computed token
    done: bool  # the step computes its last prompt token


class PoolingRunner:
    """The pooling state of one model runner (``ModelRunner(pooling=True)``)."""

    def __init__(self) -> None:
        self._chunks: dict[int, list[torch.Tensor]] = {}  # seq id -> hidden rows so far, each [k, hidden] model dtype

    @staticmethod
    def token_types(seqs: list[Sequence], starts: list[int], ends: list[int]) -> Optional[list[int]]:
        """The step's token type per row (an encoder's pairs: 1 from ``token_type_start`` on), or
        None when every row is type 0."""
        if all(seq.pooling.token_type_start is None for seq in seqs):
            return None
        types: list[int] = []
        for seq, start, end in zip(seqs, starts, ends):
            boundary = seq.pooling.token_type_start
            types.extend(0 if boundary is None or p < boundary else 1 for p in range(start, end))
        return types

    def forget(self, seq_ids) -> None:
        for seq_id in seq_ids:
            self._chunks.pop(seq_id, None)

    def rows(self, seqs: list[Sequence], starts: list[int], ends: list[int], query_start_loc: list[int]) -> tuple[list[int], list[_Item]]:
        """The step's flat rows whose final hidden states are wanted, and per sequence its share."""
        rows: list[int] = []
        items: list[_Item] = []
        for seq, start, end, row_end in zip(seqs, starts, ends, query_start_loc[1:]):
            spec: PoolingSpec = seq.pooling
            done = end == seq.num_prompt_tokens
            if spec.whole_prompt and (start != 0 or not done):
                raise RuntimeError(f"encoder sequence {seq.seq_id} scheduled in a chunk [{start}, {end}) of its {seq.num_prompt_tokens}-token prompt")
            if spec.needs_all_rows:
                wanted = list(range(row_end - (end - start), row_end))
            else:
                wanted = [row_end - 1] if done else []
            items.append(_Item(seq, len(rows), len(wanted), start, done))
            rows.extend(wanted)
        return rows, items

    def outputs(self, items: list[_Item], hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor]) -> list[tuple[Sequence, torch.Tensor]]:
        """(sequence, result on the CPU, float32) for each sequence whose prompt is done.
        ``hidden``: [R, hidden] model dtype, the rows of ``rows``; ``head``: the model's
        classification head ([m, hidden] -> [m, num_labels])."""
        results = []
        for item in items:
            seq, spec = item.seq, item.seq.pooling
            chunk = hidden[item.offset : item.offset + item.count]  # [k, hidden]
            if spec.needs_all_rows:
                if item.start == 0:
                    self._chunks[seq.seq_id] = []
                elif seq.seq_id not in self._chunks:
                    raise RuntimeError(f"pooling sequence {seq.seq_id} resumed at position {item.start} without its earlier rows")
                self._chunks[seq.seq_id].append(chunk.clone())  # the step's buffers are reused
                if not item.done:
                    continue
                parts = self._chunks.pop(seq.seq_id)
                chunk = parts[0] if len(parts) == 1 else torch.cat(parts)  # [prompt, hidden]
            if item.done:
                results.append((seq, finish(spec, chunk, seq.prompt_token_ids, head).cpu()))
        return results


def finish(spec: PoolingSpec, rows: torch.Tensor, token_ids: list[int], head: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """One request's result from its hidden rows (``rows``: [prompt, hidden] model dtype; LAST: the
    last row only [1, hidden]): [hidden] / [dimensions] / [num_labels] for the sequence tasks,
    [m, ...] for ALL (m = prompt) and STEP (m = the rows whose token is ``step_tag_id``), float32."""
    kind = spec.pooling_type
    if kind == "LAST":
        x = rows[-1:]
    elif kind == "CLS":
        x = rows[:1]
    elif kind == "MEAN":
        x = rows.float().mean(dim=0, keepdim=True).to(rows.dtype)  # [1, hidden]
    elif kind == "STEP" and spec.step_tag_id is not None:
        x = rows[torch.tensor(token_ids, device=rows.device) == spec.step_tag_id]
    else:  # ALL, STEP without a tag
        x = rows
    if spec.head:
        x = head(x).float()  # [m, num_labels]
        if spec.returned_token_ids is not None:
            x = x[:, list(spec.returned_token_ids)]
        if spec.activation == "softmax":
            x = x.softmax(dim=-1)
        elif spec.activation == "sigmoid":
            x = x.sigmoid()
    else:
        x = x.float()
        if spec.dimensions is not None:
            x = x[:, : spec.dimensions]
        if spec.normalize:
            x = F.normalize(x, p=2.0, dim=-1)
    return x if spec.task.startswith("token_") else x[0]
