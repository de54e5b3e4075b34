"""Appending finished rows durably, in input order (default) or as they finish (``--unordered``).

Input order while appending as rows finish: a finished row is written only once every earlier
admitted row is written. Rows that finish early wait in a reorder buffer; when it holds
``max_buffered`` rows the runner stops admitting new rows until the oldest one finishes (memory
stays bounded; the engine keeps working on what is in flight). So the output is, at every moment,
the finished rows in input order with nothing missing before the last one: a crash at any point
leaves a file that a rerun only has to extend, and there is no final reorder or rename that a
crash could interrupt.

Durability: lines are buffered in memory and written and fsynced in batches, when ``flush_rows``
are waiting or ``flush_seconds`` have passed since the last write. A ``kill -9`` loses at most the
unwritten batch (those rows are generated again on resume); a power loss at most the batch being
written (a torn last line, cut off on resume). Before a batch holding a row at or past the
sidecar's verified input prefix is written, ``before_write`` is called (it records a longer prefix).
"""
from __future__ import annotations

import collections
import os
import time
from typing import Callable, Optional

from pagedgen.cli.errors import CLIError
from pagedgen.cli.sidecar import fsync_dir


class Appender:
    """Whole lines appended to one file (created on first write), fsynced in batches."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._f = None
        self.pending: list[bytes] = []
        self.max_pending_index = -1
        self.lines_written = 0
        self._torn = False  # a write failed half-way: append nothing more

    def add(self, index: int, line: bytes) -> None:
        self.pending.append(line)
        self.max_pending_index = max(self.max_pending_index, index)

    def write_pending(self) -> None:
        """Write what is pending and fsync (the file is created, durably, on the first call).

        The pending lines are taken before the write: if it fails or is interrupted half-way, they
        are not written again by this process, and nothing more is appended after the torn line
        it may leave (a rerun cuts it off and generates those rows again)."""
        if not self.pending or self._torn:
            return
        if self._f is None:
            existed = os.path.exists(self.path)
            self._f = open(self.path, "ab", buffering=0)
            if not existed:
                fsync_dir(self.path)
        lines, self.pending, self.max_pending_index = self.pending, [], -1
        self._torn = True
        view = memoryview(b"".join(lines))
        while view:  # a raw write may be partial
            view = view[self._f.write(view):]
        os.fsync(self._f.fileno())
        self._torn = False
        self.lines_written += len(lines)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


class RowWriter:
    """Finished rows to the output (and failed ones to the errors file), ordered or not.

    Args:
        output, errors: the two appenders.
        ordered: keep input order (see the module docstring); else write in completion order.
        max_buffered: most finished rows waiting for an earlier one (ordered mode).
        flush_rows, flush_seconds: write a batch when this many rows wait, or this long after the
            last write.
        before_write: called with the largest index of a batch before it is written.
    """

    def __init__(self, output: Appender, errors: Appender, *, ordered: bool, max_buffered: int, flush_rows: int,
                 flush_seconds: float, before_write: Callable[[int], None]) -> None:
        self.output, self.errors = output, errors
        self.ordered = ordered
        self.max_buffered = max_buffered
        self.flush_rows, self.flush_seconds = flush_rows, flush_seconds
        self.before_write = before_write
        self._order: collections.deque[int] = collections.deque()  # admitted, not yet written (ordered)
        self._ready: dict[int, tuple[bytes, bool]] = {}
        self._last_write = time.monotonic()

    def admit(self, index: int) -> None:
        """Row ``index`` is about to run (admitted in increasing index order)."""
        if self.ordered:
            self._order.append(index)

    def finish(self, index: int, line: bytes, error: bool = False) -> None:
        """Row ``index`` finished; ``line`` (ending in a newline) goes to the errors file if ``error``."""
        if not self.ordered:
            (self.errors if error else self.output).add(index, line)
            return
        self._ready[index] = (line, error)
        while self._order and self._order[0] in self._ready:
            head = self._order.popleft()
            head_line, head_error = self._ready.pop(head)
            (self.errors if head_error else self.output).add(head, head_line)

    @property
    def buffered(self) -> int:
        """Finished rows waiting for an earlier row to finish."""
        return len(self._ready)

    def can_admit(self) -> bool:
        return len(self._ready) < self.max_buffered

    def maybe_flush(self) -> None:
        """Write a batch if enough rows wait or enough time passed."""
        waiting = len(self.output.pending) + len(self.errors.pending)
        if waiting and (waiting >= self.flush_rows or time.monotonic() - self._last_write >= self.flush_seconds):
            self.flush()

    def flush(self) -> None:
        """Write and fsync everything writable now."""
        top = max(self.output.max_pending_index, self.errors.max_pending_index)
        if top < 0:
            return
        self.before_write(top)
        for appender in (self.errors, self.output):
            try:
                appender.write_pending()
            except OSError as exc:
                raise CLIError(f"cannot write {appender.path!r}: {exc.strerror or exc} (the rows written before stay; "
                               f"rerun the same command to resume)") from exc
        self._last_write = time.monotonic()

    def abandon(self) -> int:
        """Forget admitted rows that cannot be written in order now (an interrupted run); returns
        how many finished rows are dropped with them (they are generated again on resume)."""
        dropped = len(self._ready)
        self._order.clear()
        self._ready.clear()
        return dropped

    @property
    def rows_written(self) -> int:
        return self.output.lines_written

    @property
    def errors_written(self) -> int:
        return self.errors.lines_written

    def close(self, flush: bool = True) -> None:
        if flush:
            self.flush()
        self.output.close()
        self.errors.close()


def output_is_input(output: str, input_path: str) -> Optional[str]:
    """Why ``output`` must not be written (it is the input, by path or inode), else None."""
    if input_path == "-":
        return None
    if os.path.abspath(output) == os.path.abspath(input_path):
        return "is the input file"
    try:
        if os.path.exists(output) and os.path.samefile(output, input_path):
            return "is the input file (the same inode)"
    except OSError:
        return None
    return None
