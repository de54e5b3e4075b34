"""Input readers: each streams the rows of one file format lazily (a generator; memory stays flat
however big the file), numbering them 0, 1, 2, ... and remembering the file line each starts on.

Formats (``--input-format``, default from the file name and its first line):

- ``jsonl``: one JSON object per line (or a JSON string: the prompt). Blank lines are not rows. A
  value holding a lone UTF-16 surrogate (``"\\ud800"``: not text, not writable as UTF-8) is a bad row.
- ``openai``: JSON lines in the OpenAI batch input format (``custom_id``, ``method``, ``url``, ``body``).
- ``csv`` / ``tsv``: a header line, then one record per row, parsed by Python's ``csv`` module (quoted
  fields may hold commas and newlines). Blank lines are not rows.
- ``text``: one prompt per line (an empty line is an empty prompt).
- ``json``: one JSON array of objects (or strings), read element by element (``json_array``).
- ``parquet``: read in record batches with pyarrow (an optional dependency).

Every row carries ``span``, the input bytes from the end of the previous row through its own end
(the CSV header and blank lines included), so that the concatenated spans are the file's bytes:
the resume check hashes them (see ``sidecar``). Parquet rows have no byte span (the whole file is
hashed instead).
"""
from __future__ import annotations

import csv
import json
import os
import re
import sys
from dataclasses import dataclass
from typing import BinaryIO, Iterator, Optional

from pagedgen.cli.errors import CLIError
from pagedgen.cli.json_array import iter_json_array

FORMATS = ("jsonl", "openai", "csv", "tsv", "text", "json", "parquet")
_BY_SUFFIX = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".tsv": "tsv", ".txt": "text",
              ".json": "json", ".parquet": "parquet", ".pq": "parquet"}
PARQUET_BATCH_ROWS = 1024


@dataclass
class Row:
    """One input row.

    Attributes:
        index: 0-based position among the rows (the output's ``index``).
        line: 1-based line of the file where the row starts (blank lines counted); for Parquet the
            1-based row number.
        fields: the row as a dict (text rows: ``{prompt_field: line}``), or None when unreadable.
        error: why the row could not be read (not valid JSON / UTF-8 / CSV), else None.
        span: input bytes since the previous row's end through this row's end (hashed, then dropped).
        end: byte offset just past the row (0 for Parquet).
    """

    index: int
    line: int
    fields: Optional[dict]
    error: Optional[str] = None
    span: bytes = b""
    end: int = 0


def open_binary(path: str) -> BinaryIO:
    """The input as a binary stream: ``-`` is stdin. Raises FileNotFoundError / IsADirectoryError."""
    if path == "-":
        return sys.stdin.buffer
    if os.path.isdir(path):
        raise IsADirectoryError(21, "Is a directory", path)
    return open(path, "rb")


def detect_format(path: str, stream: Optional[BinaryIO] = None) -> str:
    """The format of ``path`` from its suffix; a ``.jsonl``/``.json`` file (or stdin) whose first
    line is an OpenAI batch request is ``openai``, a ``.json`` file not starting with ``[`` is JSON
    lines; other files are plain text."""
    fmt = _BY_SUFFIX.get(os.path.splitext(path)[1].lower(), "text") if path != "-" else "jsonl"
    if fmt not in ("jsonl", "json"):
        return fmt
    head = _peek(path, stream).lstrip()
    if fmt == "json" and head[:1] == b"[":
        return "json"
    first = head.split(b"\n", 1)[0]
    try:
        obj = json.loads(first)
    except ValueError:
        return "jsonl"
    if isinstance(obj, dict) and {"custom_id", "url", "body"} <= obj.keys():
        return "openai"
    return "jsonl"


def _peek(path: str, stream: Optional[BinaryIO]) -> bytes:
    if stream is not None:
        peek = getattr(stream, "peek", None)
        return peek(1 << 16)[: 1 << 16] if peek else b""
    with open(path, "rb") as f:
        return f.read(1 << 16)


def _decode(raw: bytes, lineno: int) -> tuple[Optional[str], Optional[str]]:
    """(text, None) or (None, reason). A UTF-8 byte order mark on line 1 is dropped."""
    if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    try:
        return raw.decode("utf-8"), None
    except UnicodeDecodeError as exc:
        return None, f"not valid UTF-8 (byte {exc.start} of the line)"


def read_text(f: BinaryIO, prompt_field: str) -> Iterator[Row]:
    """One row per line: ``{prompt_field: line}`` without its line ending."""
    index = 0
    for lineno, raw in enumerate(f, 1):
        text, error = _decode(raw, lineno)
        fields = None if text is None else {prompt_field: text.rstrip("\n").removesuffix("\r")}
        yield Row(index, lineno, fields, error, raw)
        index += 1


def read_json_lines(f: BinaryIO, prompt_field: str) -> Iterator[Row]:
    """One row per non-blank line: a JSON object, or a JSON string read as ``{prompt_field: s}``."""
    index, pending = 0, b""
    for lineno, raw in enumerate(f, 1):
        if not raw.strip():
            pending += raw  # blank lines belong to the next row's span
            continue
        span, pending = pending + raw, b""
        text, error = _decode(raw, lineno)
        fields = None
        if text is not None:
            try:
                value = json.loads(text.rstrip("\r\n"))
            except json.JSONDecodeError as exc:
                error = f"not valid JSON ({exc.msg}: column {exc.colno})"
            except ValueError as exc:  # an integer past Python's 4,300 digits
                error = f"not valid JSON ({exc})"
            else:
                fields, error = _as_fields(value, prompt_field, raw)
        yield Row(index, lineno, fields, error, span)
        index += 1


# a JSON escape of a UTF-16 surrogate: json.loads makes a lone one a str that UTF-8 cannot encode
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _unwritable(value, span: bytes) -> Optional[str]:
    """Why a parsed JSON value cannot be written back as UTF-8 (it holds a lone surrogate, from a
    ``\\ud800``-style escape), else None. Only a span with such an escape is checked in full."""
    if not _SURROGATE_ESCAPE.search(span):
        return None
    for key, item in (value.items() if isinstance(value, dict) else [(None, value)]):
        try:
            json.dumps([key, item], ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            where = f"field {key!a}" if isinstance(value, dict) else "the value"
            return (f"{where} holds a lone UTF-16 surrogate ({exc.object[exc.start:exc.end]!a}, an unpaired "
                    f"\\ud800-\\udfff escape), which is not text and cannot be written as UTF-8")
    return None


def _as_fields(value, prompt_field: str, span: bytes = b"") -> tuple[Optional[dict], Optional[str]]:
    why = _unwritable(value, span)
    if why is not None:
        return None, why
    if isinstance(value, dict):
        return value, None
    if isinstance(value, str):
        return {prompt_field: value}, None
    return None, f"expected a JSON object (or a string prompt), got a JSON {type(value).__name__}"


def read_json_array(f: BinaryIO, name: str, prompt_field: str) -> Iterator[Row]:
    """One row per element of a JSON array file (objects, or strings read as prompts)."""
    for index, (line, end, span, value, error) in enumerate(iter_json_array(f, name)):
        fields = None
        if error is None:
            fields, error = _as_fields(value, prompt_field, span)
        yield Row(index, line, fields, error, span, end)


class _LineFeed:
    """Feeds decoded lines to ``csv.reader`` and keeps the raw bytes and line numbers they came from."""

    def __init__(self, f: BinaryIO) -> None:
        self._lines = enumerate(f, 1)
        self.raw: list[bytes] = []
        self.lineno = 0
        self.error: Optional[str] = None

    def __iter__(self):
        return self

    def __next__(self) -> str:
        self.lineno, raw = next(self._lines)
        self.raw.append(raw)
        text, error = _decode(raw, self.lineno)
        if text is None:
            self.error = self.error or error
            return ""  # the record is reported as bad
        return text

    def take(self) -> bytes:
        span, self.raw, self.error = b"".join(self.raw), [], None
        return span


def read_csv(f: BinaryIO, name: str, delimiter: str, required: Optional[str]) -> Iterator[Row]:
    """One row per record after the header line, as ``{column: str}``.

    Raises CLIError when the header is missing or lacks the ``required`` column (every row would
    fail). A record with another number of fields than the header, or one ``csv`` cannot parse, is
    a bad row.
    """
    feed = _LineFeed(f)
    reader = csv.reader(feed, delimiter=delimiter, strict=True)
    try:
        header = next(reader)
        while header == [] and not feed.error:  # blank lines before the header (their bytes stay in the first span)
            header = next(reader)
    except StopIteration:
        blank = " (only blank lines)" if feed.lineno else ""
        raise CLIError(f"{name}: empty file{blank}: no header line (a header line naming the columns is needed)") from None
    except csv.Error as exc:
        raise CLIError(f"{name}:1: the header line is not valid CSV ({exc})") from None
    if feed.error:
        raise CLIError(f"{name}:1: the header line is {feed.error}")
    _check_column(name, required, header)
    pending = feed.take()
    index = 0
    while True:
        start = feed.lineno + 1
        try:
            record = next(reader)
            error = feed.error
        except StopIteration:
            return
        except csv.Error as exc:
            record, error = None, f"not valid CSV ({exc})"
        span = pending + feed.take()
        if record == [] and error is None:  # a blank line is not a row
            pending = span
            continue
        pending = b""
        fields = None
        if error is None:
            if len(record) != len(header):
                error = f"has {len(record)} fields, the header has {len(header)}"
            else:
                fields = dict(zip(header, record))
        yield Row(index, start, fields, error, span)
        index += 1


def read_parquet(path: str, batch_rows: int = PARQUET_BATCH_ROWS) -> Iterator[Row]:
    """One row per Parquet record (``{column: value}`` as pyarrow's ``to_pylist`` gives them),
    read a record batch at a time. Raises CLIError when pyarrow is not installed."""
    pq = import_pyarrow_parquet()
    index = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_rows):
        for record in batch.to_pylist():
            yield Row(index, index + 1, record)
            index += 1


def import_pyarrow_parquet():
    """``pyarrow.parquet``, or a CLIError naming the package to install."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise CLIError("reading Parquet needs the pyarrow package: pip install pyarrow") from None
    return pq


def _check_column(name: str, required: Optional[str], columns: list[str]) -> None:
    repeated = [c for i, c in enumerate(columns) if c in columns[:i]]
    if repeated:  # rows become {column: value}: one of the two values would be dropped without a word
        raise CLIError(f"{name}: the header names column {repeated[0]!r} more than once (columns: {', '.join(columns)}); "
                       "give every column its own name, or one of its values in each row would be lost")
    if required is not None and required not in columns:
        raise CLIError(f"{name}: no column {required!r} (columns: {', '.join(columns)}); use --prompt-column")


def check_header(path: str, fmt: str, *, prompt_field: str, required_column: Optional[str]) -> None:
    """Read the header line (CSV/TSV) or the schema (Parquet) of ``path`` now: CLIError for an
    empty file or a missing ``required_column``, before any work (``read_rows`` checks lazily, at
    its first row). Other formats are not checked here; stdin (which cannot be read twice) only
    when the buffered start of it (``peek``) holds the whole header line."""
    if fmt not in ("csv", "tsv", "parquet"):
        return
    if path == "-":
        if fmt != "parquet":
            _check_peeked_header(_peek(path, sys.stdin.buffer), "," if fmt == "csv" else "\t", required_column)
        return
    rows = read_rows(path, fmt, prompt_field=prompt_field, required_column=required_column)
    try:
        next(rows, None)  # the header, then the first row (a bad one is reported when the run reaches it)
    finally:
        rows.close()


def _check_peeked_header(head: bytes, delimiter: str, required: Optional[str]) -> None:
    """The column check of ``read_csv`` on the first bytes of stdin, when they hold its first
    non-blank line whole (a header that does not parse here is left to ``read_csv``)."""
    lines = [line for line in head.splitlines(keepends=True) if line.endswith(b"\n")]
    first = next((line for line in lines if line.strip()), None)
    if first is None:
        return
    try:
        header = next(csv.reader([first.decode("utf-8-sig")], delimiter=delimiter, strict=True))
    except (csv.Error, UnicodeDecodeError, StopIteration):
        return
    _check_column("<stdin>", required, header)


def read_rows(path: str, fmt: str, *, prompt_field: str, required_column: Optional[str], stream: Optional[BinaryIO] = None) -> Iterator[Row]:
    """The rows of ``path`` (``-``: ``stream`` or stdin) in format ``fmt`` (one of FORMATS).

    ``required_column`` (CSV/TSV/Parquet) must be a column of the file; else CLIError before any
    row. Text and string rows put the prompt under ``prompt_field``.
    """
    name = "<stdin>" if path == "-" else path
    if fmt == "parquet":
        if path == "-":
            raise CLIError("Parquet cannot be read from stdin (it needs a seekable file); give its path")
        pq = import_pyarrow_parquet()
        columns = pq.ParquetFile(path).schema_arrow.names
        _check_column(name, required_column, columns)
        yield from read_parquet(path)
        return
    f = stream if stream is not None else open_binary(path)
    try:
        if fmt == "text":
            rows = read_text(f, prompt_field)
        elif fmt in ("jsonl", "openai"):
            rows = read_json_lines(f, prompt_field)
        elif fmt == "json":
            rows = read_json_array(f, name, prompt_field)
        elif fmt in ("csv", "tsv"):
            rows = read_csv(f, name, "," if fmt == "csv" else "\t", required_column)
        else:
            raise CLIError(f"unknown input format {fmt!r}; one of {', '.join(FORMATS)}")
        end = 0
        for row in rows:
            if not row.end:
                end += len(row.span)
                row.end = end
            yield row
    finally:
        if f is not sys.stdin.buffer and stream is None:
            f.close()
