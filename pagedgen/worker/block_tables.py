"""The model runner's persistent block tables: one int32 tensor kept across steps and updated from
each step's ``SchedulerOutput`` deltas, instead of a table rebuilt from Python lists every step.

    table [num_rows, max_blocks] int32      row r: the block table of the sequence in row r,
                                            padded with 0 (never read: a sequence's kernels read
                                            only its first ceil(seq_len / block_size) entries)

A sequence gets a row when its table first reaches the runner (``block_table_updates`` holds it
whole then) and gives it back when the scheduler frees it (``freed_seq_ids``). A decode step
mostly changes nothing here: a sequence takes a new block every ``block_size`` tokens, so the
per-step cost is one ``index_select`` of the scheduled rows (vLLM v1's ``BlockTable`` in
``vllm/v1/worker/block_table.py`` keeps its tables the same way). The cells a step changes (new
blocks, copy-on-write, freed rows zeroed) are collected first and written with one ``index_put_``,
not one tensor assignment per sequence.

The runner sees every step's output in order, so the mirror always equals the block manager's
tables (``tests/worker/test_model_runner.py`` checks it through preemption, swapping and copy-on-write).
A step that raises rolls the engine back: every request is aborted and the scheduler frees every
table it had sent, so the next output frees every row, whatever the interrupted step left here.
A table freed and sent again in one output (a sequence preempted and readmitted in the same step)
is freed first: ``apply`` forgets before it writes.
"""
from __future__ import annotations

from array import array
from typing import Callable, Optional

import torch


def int_tensor(values: list[int], dtype: torch.dtype) -> torch.Tensor:
    """A 1-D CPU tensor of Python ints, through ``array`` (several times faster than ``torch.tensor``
    on a list: the ints are converted in one C loop)."""
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(array(_TYPECODES[dtype], values), dtype=dtype)


_TYPECODES = {torch.int64: "q", torch.int32: "i"}


class BlockTables:
    """Block tables of the sequences the runner has seen, one row each, in a persistent tensor.

    Args:
        max_blocks: columns to start with (ceil(max_model_len / block_size)); grows if a table is
            longer (a runner built without max_model_len).
        rows: rows to start with; doubles when full.
    """

    def __init__(self, max_blocks: int, rows: int = 64) -> None:
        self.table = torch.zeros(max(rows, 1), max(max_blocks, 1), dtype=torch.int32)  # [rows, max_blocks]
        self._row: dict[int, int] = {}  # seq_id -> row
        self._len: list[int] = [0] * self.table.shape[0]  # blocks held in each row
        self._free_rows = list(range(self.table.shape[0] - 1, -1, -1))  # a stack: row 0 first
        self._pending: dict[int, int] = {}  # cells not yet written: flat index into table -> block id

    def __len__(self) -> int:
        return len(self._row)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._row

    def row_list(self, seq_id: int) -> list[int]:
        """The sequence's table as a list (for tests and debugging)."""
        self._flush()
        row = self._row[seq_id]
        return self.table[row, : self._len[row]].tolist()

    def apply(self, freed_seq_ids: list[int], updates: dict[int, tuple[int, list[int]]]) -> None:
        """Forget the freed sequences, then apply ``{seq_id: (start, block ids)}``: the table from
        index ``start`` on becomes the block ids (``SchedulerOutput.block_table_updates``)."""
        for seq_id in freed_seq_ids:
            row = self._row.pop(seq_id, None)
            if row is not None:
                self._clear(row, 0)
                self._free_rows.append(row)
        for seq_id, (start, blocks) in updates.items():
            if start == 0 or seq_id in self._row:  # else the prefix is unknown here: gather's fallback fills it
                self._set(seq_id, start, blocks)
        self._flush()

    def gather(self, seq_ids: list[int], width: int, fallback: Optional[Callable[[int], list[int]]] = None) -> torch.Tensor:
        """[len(seq_ids), width] int32: the tables of ``seq_ids`` in that order, cut or padded to
        ``width`` columns. ``fallback(seq_id)`` gives the table of a sequence without a row; without
        one, such a sequence is a RuntimeError (its table never reached this mirror)."""
        rows = self._row
        try:
            index = [rows[s] for s in seq_ids]
        except KeyError:
            for seq_id in seq_ids:
                if seq_id not in rows:
                    if fallback is None:
                        raise RuntimeError(f"the block table of sequence {seq_id} never reached this worker's mirror") from None
                    self._set(seq_id, 0, fallback(seq_id))
            self._flush()
            index = [rows[s] for s in seq_ids]
        if width > self.table.shape[1]:
            self._grow(self.table.shape[0], width)
        return self.table[:, :width].index_select(0, int_tensor(index, torch.int64))  # [n, width], a new contiguous tensor

    # ----- internals -----------------------------------------------------------------------------
    def _set(self, seq_id: int, start: int, blocks: list[int]) -> None:
        row = self._row.get(seq_id)
        if row is None:
            if not self._free_rows:
                self._grow(2 * self.table.shape[0], self.table.shape[1])
            row = self._free_rows.pop()
            self._row[seq_id] = row
        end = start + len(blocks)
        if end > self.table.shape[1]:
            self._grow(self.table.shape[0], max(end, 2 * self.table.shape[1]))
        base = row * self.table.shape[1] + start
        self._pending.update(zip(range(base, base + len(blocks)), blocks))
        self._clear(row, end)
        self._len[row] = end

    def _clear(self, row: int, end: int) -> None:
        """Zero the row past ``end`` (what a shorter table left there)."""
        old = self._len[row]
        if old > end:
            base = row * self.table.shape[1]
            self._pending.update(dict.fromkeys(range(base + end, base + old), 0))
            self._len[row] = end

    def _flush(self) -> None:
        """Write the pending cells into the table, in one ``index_put_``."""
        if self._pending:
            cells, self._pending = self._pending, {}
            index = int_tensor(list(cells), torch.int64)  # [C] flat indices into the table
            self.table.view(-1).index_put_((index,), int_tensor(list(cells.values()), torch.int32))

    def _grow(self, rows: int, cols: int) -> None:
        self._flush()  # pending cells are flat indices for the old width
        old = self.table
        self.table = torch.zeros(rows, cols, dtype=torch.int32)
        self.table[: old.shape[0], : old.shape[1]] = old
        self._free_rows[:0] = range(rows - 1, old.shape[0] - 1, -1)  # the new rows, below the stack's top
        self._len += [0] * (rows - old.shape[0])
