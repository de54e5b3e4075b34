"""What an earlier run already wrote: the set of finished row indices, and the repair of a torn tail.

Each output (and errors-file) line starts with the row's index (``{"index": 12, ...`` or, in the
OpenAI batch format, ``{"id": "batch_req_12", ...``), so the scan reads indices without parsing
whole rows; lines in the last ``FULL_CHECK_BYTES`` of a file (where a power loss can leave a
partly written line) are also parsed as JSON. A line is finished only when it ends in a newline:
the writer writes whole lines, so a torn write is only ever the *last* line: one without a final
newline, or one that is not valid JSON (zeros a power loss left), and that is cut off
(``truncate_to``). Any other line that is not a row (a bad line with lines after it, or a complete,
valid JSON last line that is not one of this run's rows) is not something pagedgen writes: the run
is refused with its line number rather than deleting what someone else put there.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from pagedgen.cli.errors import CLIError

FULL_CHECK_BYTES = 64 << 20


def index_pattern(kind: str, index_field: str = "index") -> "re.Pattern[bytes]":
    """The start of a line written for row N, N captured: ``{"index": N,`` (``kind`` "rows", with
    ``--index-field``'s name) or ``{"id": "batch_req_N",`` ("openai")."""
    if kind == "openai":
        return re.compile(rb'^\{"id": "batch_req_(\d+)"[,}]')
    return re.compile(rb"^\{" + re.escape(json.dumps(index_field, ensure_ascii=False).encode()) + rb": (\d+)[,}]")


class DoneSet:
    """A set of row indices as a bitmap (1 bit per row: 125 KB per million rows)."""

    def __init__(self) -> None:
        self._bits = bytearray()
        self.count = 0
        self.max_index = -1

    def add(self, index: int) -> bool:
        """Mark ``index`` done; False if it already was."""
        byte, bit = divmod(index, 8)
        if byte >= len(self._bits):
            self._bits.extend(bytes(max(byte + 1 - len(self._bits), len(self._bits))))
        if self._bits[byte] >> bit & 1:
            return False
        self._bits[byte] |= 1 << bit
        self.count += 1
        self.max_index = max(self.max_index, index)
        return True

    def first_missing(self) -> int:
        """The smallest index not in the set."""
        byte = next((i for i, b in enumerate(self._bits) if b != 0xFF), len(self._bits))
        value = self._bits[byte] if byte < len(self._bits) else 0
        return byte * 8 + next(bit for bit in range(9) if not value >> bit & 1)

    def __contains__(self, index: int) -> bool:
        byte, bit = divmod(index, 8)
        return byte < len(self._bits) and bool(self._bits[byte] >> bit & 1)


@dataclass
class Scan:
    """The result of scanning one file: ``good_bytes`` ends the last good line; ``torn_bytes``
    follow it (to cut off); ``rows`` good lines were read."""

    path: str
    good_bytes: int = 0
    torn_bytes: int = 0
    rows: int = 0
    in_order: bool = True  # the rows' indices increase line by line


def scan(path: str, kind: str, done: DoneSet, index_field: str = "index") -> Scan:
    """Add the indices of the rows in ``path`` (if it exists) to ``done``.

    Args:
        kind: "rows" (the JSONL output and errors file) or "openai" (OpenAI batch output).
        index_field: the output's index field (``--index-field``).

    Raises:
        CLIError: a damaged line followed by good ones, or an index written twice.
    """
    result = Scan(path)
    if not os.path.exists(path):
        return result
    pattern = index_pattern(kind, index_field)
    size = os.path.getsize(path)
    bad = None  # (line number, offset, line) of a line that is not a finished row: allowed only last
    offset = 0
    last = -1
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if bad is not None:
                raise CLIError(f"{path}:{bad[0]}: not a row pagedgen writes, with more lines after it (the file was "
                               f"edited or damaged): remove that line, or pass --overwrite to start again")
            start, offset = offset, offset + len(line)
            match = pattern.match(line) if line.endswith(b"\n") else None
            if match and start >= size - FULL_CHECK_BYTES:
                try:
                    json.loads(line)
                except ValueError:
                    match = None
            if not match:
                bad = (lineno, start, line)
                continue
            index = int(match.group(1))
            if not done.add(index):
                raise CLIError(f"{path}:{lineno}: row {index} is written twice (the file was edited?): remove one, or pass --overwrite")
            result.in_order = result.in_order and index > last
            last = index
            result.rows += 1
    if bad is not None and bad[2].endswith(b"\n") and _is_json(bad[2]):
        raise CLIError(f"{path}:{bad[0]}: a complete line that is not a row pagedgen writes (the file was edited or "
                       f"appended to): remove that line, or pass --overwrite to start again")
    result.good_bytes = bad[1] if bad else size
    result.torn_bytes = size - result.good_bytes
    return result


def _is_json(line: bytes) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return False
    return True


def truncate_to(result: Scan) -> None:
    """Cut ``result.path`` back to its last good line (a torn write), durably."""
    if not result.torn_bytes:
        return
    with open(result.path, "r+b") as f:
        f.truncate(result.good_bytes)
        f.flush()
        os.fsync(f.fileno())


def check_in_order(done: DoneSet, scans: list[Scan], kind: str, index_field: str = "index") -> None:
    """In input order (the default) a row is written only after every earlier row, so the output and
    the errors file together hold rows ``0 .. max_index``, each file in increasing order. A hole
    (a line deleted by hand to have that row generated again) would be filled by appending the row
    at the end, out of order: refused instead, naming the line after the hole.

    Raises:
        CLIError: a row is missing before the last one, or a file's rows are not in increasing order.
    """
    missing = done.first_missing() if done.count != done.max_index + 1 else None
    if missing is None and all(s.in_order for s in scans):
        return
    pattern = index_pattern(kind, index_field)  # read again to name the line: only when something is wrong
    for path in (s.path for s in scans):
        if not os.path.exists(path):
            continue
        last = -1
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                match = pattern.match(line) if line.endswith(b"\n") else None
                if not match:
                    break  # a torn last line (scan allows no other)
                index = int(match.group(1))
                if index < last:
                    raise CLIError(f"{path}:{lineno}: row {index} comes after row {last}, but the output keeps input "
                                   f"order (the file was edited?): restore the order, or pass --overwrite to start again")
                if missing is not None and index > missing:
                    raise CLIError(
                        f"{path}:{lineno}: row {missing} is missing before this line's row {index} (it is in neither "
                        f"the output nor the errors file: a line was deleted?). The output keeps input order, so a missing "
                        f"row cannot be appended at the end: to generate rows again, remove their lines and every line "
                        f"after them (those rows are generated again too), or pass --overwrite to start again")
                last = index
