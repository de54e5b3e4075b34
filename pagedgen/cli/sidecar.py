"""The sidecar file ``OUTPUT.pagedgen.json``: what an output file was made from, so that a rerun resumes
only when the input, the model and the parameters are those of the run that started it.

- **Input**: the SHA-256 of the input's first ``bytes`` bytes, rows ``0 .. rows-1``, where row
  ``rows-1`` is the highest row in the output (or the errors file). The runner hashes the bytes as
  it reads them (row spans, see ``readers``) and, *before* a row past ``rows`` is written, rewrites
  the sidecar to end with that row, so the check always covers every finished row and never a row
  read ahead but not written (a bad row the run stopped at, or rows after it). A rerun re-hashes that prefix (about 1 s per GB) and
  compares: an input replaced, truncated or edited anywhere before the last row written is refused;
  rows after it may change (a fixed bad row, appended rows). When that row was the file's last
  line, without a newline (``ends_mid_line``: a file still being written), a file that now
  continues that line is refused too, as it changes the row. Parquet has no row byte ranges: its
  whole file is hashed instead. From stdin the prefix is checked as the rows stream in.
- **Model**: size and SHA-256 of config.json, the tokenizer files and the safetensors index; for
  weight files over 64 MiB the size and a hash of 16 evenly spaced 1 MiB samples (a fine-tune or
  another checkpoint changes them; a copy or a fresh download of the same files does not, and
  reading 16 MiB stays fast for any model). Paths are not compared (a moved folder still resumes).
- **Parameters**: everything that shapes an output row (sampling flags, dtype, engine seed,
  max_model_len, the input-reading and output flags, ``--close-at-max-tokens`` where a request can
  be structured); a flag added later, at its default, reads as an older sidecar's missing key
  (``ADDED_DEFAULTS``); performance knobs (max_num_seqs, KV cache
  size, block size, prefix caching, device...) may change between runs.

The file is replaced atomically (write, fsync, rename, fsync the folder).
"""
from __future__ import annotations

import collections
import fnmatch
import hashlib
import json
import os
from typing import Optional

from pagedgen.cli.errors import CLIError

SIDECAR_VERSION = 1
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json", "added_tokens.json",
               "vocab.*", "merges.txt", "*.model", "chat_template.*", "*.safetensors", "*.safetensors.index.json")
SAMPLED_OVER = 64 << 20
SAMPLES, SAMPLE_BYTES = 16, 1 << 20
READ_CHUNK = 4 << 20


def paths_for(output: str) -> tuple[str, str]:
    """(sidecar, errors file) of ``output``: ``out.jsonl`` -> ``out.pagedgen.json``, ``out.errors.jsonl``.
    ``out`` has the same two (see ``check_owner``)."""
    base = output[: -len(".jsonl")] if output.endswith(".jsonl") else output
    return base + ".pagedgen.json", base + ".errors.jsonl"


def _sibling(output: str) -> str:
    """The other output name with the same sidecar and errors file (``out.jsonl`` <-> ``out``)."""
    return output[: -len(".jsonl")] if output.endswith(".jsonl") else output + ".jsonl"


def check_owner(output: str, overwrite: bool) -> None:
    """Refuse to use a sidecar (and errors file) that belongs to another output.

    ``out`` and ``out.jsonl`` share ``out.pagedgen.json`` and ``out.errors.jsonl``; the sidecar
    records the name of the output it was written for (``"output"``; a sidecar of an older
    version, which has none, belongs to the other name when only that one exists).

    Raises:
        CLIError: the sidecar belongs to the other output and that output exists (even with
            ``overwrite``: its files are never deleted), or it belongs to the other output, which is
            gone, and ``overwrite`` is not set.
    """
    path, errors = paths_for(output)
    if not os.path.exists(path):
        return
    owner = _recorded_output(path)
    sibling = _sibling(output)
    if owner is None:  # an older sidecar: it belongs to whichever of the two outputs exists
        owner = os.path.basename(sibling if os.path.exists(sibling) and not os.path.exists(output) else output)
    if owner == os.path.basename(output):
        return
    other = os.path.join(os.path.dirname(output), owner)
    shared = f"the sidecar {path!r} and errors file {errors!r} belong to --output {other!r} (outputs named with and without .jsonl share them)"
    if os.path.exists(other):
        raise CLIError(f"--output {output!r}: {shared}, which exists: choose another output name (its files are never replaced)")
    if not overwrite:
        raise CLIError(f"--output {output!r}: {shared}, which no longer exists: pass --overwrite to replace them, or choose "
                       f"another output name")


def check_errors_file_not_shared(output: str) -> None:
    """Refuse an output that is another run's errors file, or whose errors file is another run's
    output (even with ``--overwrite``: the other run's rows would be mixed with this run's, or
    replaced).

    ``out.errors.jsonl`` is the errors file of ``out.jsonl`` (and ``out``) when the sidecar
    ``out.pagedgen.json`` exists; it is an output of its own when ``out.errors.pagedgen.json`` exists.

    Raises:
        CLIError: naming both outputs and the sidecar that ties them.
    """
    if output.endswith(".errors.jsonl"):
        base = output[: -len(".errors.jsonl")]
        owner_sidecar = base + ".pagedgen.json"
        if os.path.exists(owner_sidecar):
            owner = os.path.join(os.path.dirname(output), _recorded_output(owner_sidecar) or os.path.basename(base + ".jsonl"))
            raise CLIError(f"--output {output!r} is the errors file of --output {owner!r} (its sidecar {owner_sidecar!r} "
                           f"exists): choose another output name (another run's files are never written to)")
    errors = paths_for(output)[1]
    errors_sidecar = paths_for(errors)[0]
    if os.path.exists(errors_sidecar):
        raise CLIError(f"--output {output!r}: its errors file {errors!r} is the output of another run (its sidecar "
                       f"{errors_sidecar!r} exists): choose another output name (another run's files are never written to)")


#: parameters added after sidecars were first written whose default is not None (None is unset),
#: with that default: a value equal to it compares as the key an older sidecar lacks, at the top
#: level and in the recorded ``structured_outputs``. So a run with the default resumes an older
#: sidecar, and one with another value is refused (``close_at_max_tokens: None -> False``).
ADDED_DEFAULTS = {"close_at_max_tokens": True}


def _set(params) -> Optional[dict]:
    """``params`` without its None values and ``ADDED_DEFAULTS``: a key an older sidecar lacks reads as unset."""
    if not isinstance(params, dict):
        return params
    out = {k: v for k, v in params.items() if v is not None and ADDED_DEFAULTS.get(k, None) != v}
    if isinstance(out.get("structured_outputs"), dict):
        out["structured_outputs"] = _set(out["structured_outputs"])
    return out


def _recorded_output(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None  # unreadable: Sidecar.load reports it
    return data.get("output") if isinstance(data, dict) else None


def hash_prefix(path: str, nbytes: Optional[int] = None) -> tuple[str, int]:
    """(SHA-256 hex digest, bytes hashed) of the first ``nbytes`` bytes of ``path`` (all if None)."""
    h, done = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while nbytes is None or done < nbytes:
            chunk = f.read(READ_CHUNK if nbytes is None else min(READ_CHUNK, nbytes - done))
            if not chunk:
                break
            h.update(chunk)
            done += len(chunk)
    return h.hexdigest(), done


def _sampled_hash(path: str, size: int) -> str:
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        for k in range(SAMPLES):
            f.seek((size - SAMPLE_BYTES) * k // (SAMPLES - 1))
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def model_fingerprint(folders: list[str]) -> dict:
    """``{file: {"size", "sha256" | "sampled_sha256"}}`` of the model's files in ``folders`` (the
    model folder, then a separate tokenizer folder if any)."""
    out = {}
    for k, folder in enumerate(folders):
        for name in sorted(os.listdir(folder)):
            path = os.path.join(folder, name)
            if not os.path.isfile(path) or not any(fnmatch.fnmatch(name, p) for p in MODEL_FILES):
                continue
            size = os.path.getsize(path)
            entry = {"size": size}
            if size > SAMPLED_OVER:
                entry["sampled_sha256"] = _sampled_hash(path, size)
            else:
                entry["sha256"] = hash_prefix(path)[0]
            out[f"tokenizer/{name}" if k else name] = entry
    return out


class InputTracker:
    """The running SHA-256 of the input's bytes, fed one row span at a time, in row order.

    ``state()`` covers every row read so far; ``state_through(index)`` ends with row ``index``. The
    sidecar records ``state_through`` the highest row written, never the rows read: the runner
    reads rows ahead of the ones it adds (a bad row among them, and rows after it, are never
    written), so the recorded prefix holds only rows up to the last one in the output and fixing
    a bad row keeps it valid.

    Args:
        keep_from: the first row index whose state is kept (rows before it are covered by the
            sidecar already); ``state_through`` forgets the rows before the one it is asked for,
            so the states kept are those of the rows read but not yet written.
        lines: the format is one row per line (JSONL, OpenAI, text, CSV/TSV): the state records
            whether the row ended without a newline (``ends_mid_line``: the last line of a file,
            perhaps still being written; see ``Sidecar.check_input_file``).
    """

    def __init__(self, keep_from: int = 0, lines: bool = True) -> None:
        self._hash = hashlib.sha256()
        self.bytes = 0
        self.rows = 0
        self.keep_from = keep_from
        self.lines = lines
        self._after: collections.deque = collections.deque()  # (row index, bytes, hash, ends mid-line) after each row

    def feed(self, span: bytes, rows_after: int) -> None:
        self._hash.update(span)
        self.bytes += len(span)
        self.rows = rows_after
        if rows_after - 1 >= self.keep_from:
            self._after.append((rows_after - 1, self.bytes, self._hash.copy(), self.lines and not span.endswith(b"\n")))

    def state(self) -> dict:
        return {"bytes": self.bytes, "rows": self.rows, "sha256": self._hash.hexdigest()}

    def state_through(self, index: int) -> dict:
        """The state after row ``index`` was fed (rows ``0 .. index``); forgets the rows before it.

        Raises:
            KeyError: row ``index`` was not fed, or is before ``keep_from`` or an earlier call's row.
        """
        while self._after and self._after[0][0] < index:
            self._after.popleft()
        if not self._after or self._after[0][0] != index:
            raise KeyError(f"the input state after row {index} is not kept")
        _, nbytes, h, mid_line = self._after[0]
        return {"bytes": nbytes, "rows": index + 1, "sha256": h.hexdigest(), "ends_mid_line": mid_line}


class Sidecar:
    """The sidecar's contents (a dict) and its atomic save.

    Keys: ``version``, ``output`` (the output file's name, without its folder; see ``check_owner``),
    ``input`` ({"path", "format", "bytes", "rows", "sha256"} or, for Parquet,
    {"path", "format", "file_sha256", "rows"}), ``model`` (``model_fingerprint``), ``params``,
    ``created`` (Unix time of the first run, used for the OpenAI format's ``created``).
    """

    def __init__(self, path: str, data: dict) -> None:
        self.path = path
        self.data = data

    @classmethod
    def load(cls, path: str) -> Optional["Sidecar"]:
        """The sidecar at ``path``, None if there is none. Raises CLIError if it is unreadable."""
        if not os.path.exists(path):
            return None
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError) as exc:
            raise CLIError(f"cannot read the sidecar {path!r} ({exc}); pass --overwrite to start the output again") from None
        if not isinstance(data, dict) or data.get("version") != SIDECAR_VERSION:
            raise CLIError(f"{path!r} is not a pagedgen sidecar of version {SIDECAR_VERSION}; pass --overwrite to start again")
        return cls(path, data)

    def save(self) -> None:
        """Write the sidecar atomically and durably."""
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.data, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fsync_dir(self.path)

    @property
    def input_rows(self) -> int:
        return self.data["input"].get("rows", 0)

    def update_input(self, state: dict) -> None:
        """Record a longer verified input prefix (never a shorter one: rows in the output stay in it) and save."""
        if state["rows"] > self.input_rows:
            self.data["input"].update(state)
            self.save()

    def check(self, model: dict, params: dict, output: str) -> None:
        """Raise CLIError naming what differs from the run that started ``output``."""
        again = f"rerun with the same input, model and flags to resume {output!r}, or pass --overwrite to start it again"
        was, now = _set(self.data.get("params")), _set(params)
        if was != now:  # a flag a newer pagedgen added, left unset (or at its ADDED_DEFAULTS value): the same run
            old, was = self.data.get("params") or {}, was or {}
            diffs = [f"{k}: {old.get(k)!r} -> {params.get(k)!r}" for k in sorted(set(was) | set(now)) if was.get(k) != now.get(k)]
            raise CLIError(f"the parameters differ from the run that started {output!r} ({'; '.join(diffs)}); {again}")
        if self.data.get("model") != model:
            old = self.data.get("model") or {}
            diffs = [name for name in sorted(set(old) | set(model)) if old.get(name) != model.get(name)]
            raise CLIError(f"the model differs from the run that started {output!r} (changed: {', '.join(diffs)}); {again}")

    def check_input_file(self, path: str, fmt: str, output: str) -> None:
        """Raise CLIError unless the input file still holds the rows the output came from."""
        recorded = self.data["input"]
        if recorded.get("rows", 0) == 0:
            return
        what = f"the input {path!r} changed since {output!r} was started"
        hint = f"use the original input to resume, or pass --overwrite to start {output!r} again"
        if fmt == "parquet":
            if hash_prefix(path)[0] != recorded.get("file_sha256"):
                raise CLIError(f"{what} (its SHA-256 differs); {hint}")
            return
        digest, got = hash_prefix(path, recorded["bytes"])
        if got < recorded["bytes"] or digest != recorded["sha256"]:
            raise CLIError(
                f"{what}: its first {recorded['bytes']:,} bytes (rows 0-{recorded['rows'] - 1}; the output holds "
                f"rows up to row {recorded['rows'] - 1}) {'are missing' if got < recorded['bytes'] else 'differ'}; {hint}"
            )
        if recorded.get("ends_mid_line") and not _line_ended(path, recorded["bytes"]):
            raise CLIError(
                f"{what}: row {recorded['rows'] - 1}, the one the output ends with, was the file's last line, without "
                f"a newline, and the file now continues that line (the file was still being written?); {hint}"
            )


def _line_ended(path: str, nbytes: int) -> bool:
    """Whether the line that ran to byte ``nbytes`` of ``path`` without a newline still reads the same:
    the file ends there, or goes on with a line end (``\\n``, or ``\\r\\n`` after a byte other than
    ``\\r``: the readers drop one ``\\r\\n`` or ``\\n``)."""
    with open(path, "rb") as f:
        f.seek(max(nbytes - 1, 0))
        around = f.read(3 if nbytes else 2)
    last, after = (around[:1], around[1:]) if nbytes else (b"", around)
    return after == b"" or after.startswith(b"\n") or (after.startswith(b"\r\n") and last != b"\r")


def fsync_dir(path: str) -> None:
    """fsync the folder holding ``path`` (makes a create or rename durable)."""
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
