"""The progress bar (rows done, output tokens/s, ETA) and the closing summary.

The bar (plain lines where stderr is not a terminal: ``pagedgen.progress.bar_options``) counts rows;
its total is the input's row count, counted in a background thread while generation starts
(a fast newline count for the line formats, the metadata for Parquet); from stdin it is unknown.
"""
from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from pagedgen.cli import readers
from pagedgen.cli.errors import CLIError
from pagedgen.cli.json_array import iter_json_array
from pagedgen.progress import bar_options

# how the closing summary names the model's weights (ModelConfig.quantization, docs/quantization.md)
_QUANT_LABELS = {"int8": "int8 W8A8", "fp8": "FP8 W8A16", "gptq": "int4 GPTQ W4A16", "awq": "int4 AWQ W4A16",
                 "compressed-tensors": "compressed-tensors (int8 W8A8, FP8 W8A16 or int4 W4A16)"}

_BLANK_LINE = re.compile(rb"^[ \t\r]*\n", re.M)
_CHUNK = 4 << 20


def count_rows(path: str, fmt: str) -> int:
    """Rows in ``path`` as ``readers`` numbers them (blank lines are rows only in text files)."""
    if fmt == "parquet":
        return readers.import_pyarrow_parquet().ParquetFile(path).metadata.num_rows
    if fmt == "json":
        with open(path, "rb") as f:
            return sum(1 for _ in iter_json_array(f, path, parse=False))
    if fmt in ("csv", "tsv"):
        return sum(1 for _ in readers.read_rows(path, fmt, prompt_field="prompt", required_column=None))
    rows, carry = 0, b""
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            chunk = carry + chunk
            cut = chunk.rfind(b"\n") + 1  # whole lines only; the rest waits for the next chunk
            whole, carry = chunk[:cut], chunk[cut:]
            rows += whole.count(b"\n")
            if fmt != "text":
                rows -= sum(1 for _ in _BLANK_LINE.finditer(whole))
    if carry and (fmt == "text" or carry.strip()):
        rows += 1
    return rows


class RowCounter(threading.Thread):
    """Counts the input's rows in the background; ``total`` is None until done (or on failure)."""

    def __init__(self, path: str, fmt: str) -> None:
        super().__init__(daemon=True, name="pagedgen-row-count")
        self.path, self.fmt = path, fmt
        self.total: Optional[int] = None

    def run(self) -> None:
        try:
            self.total = count_rows(self.path, self.fmt)
        except (OSError, ValueError, CLIError, ImportError):  # the bar stays without a total; the run reports reading errors
            self.total = None


@dataclass
class RunStats:
    """Counts of one run (rows are input rows; tokens summed over a row's completions)."""

    already_done: int = 0  # rows skipped: an earlier run wrote them
    generated: int = 0
    bad: int = 0  # rows written to the errors file (--on-error skip)
    prompt_tokens: int = 0
    output_tokens: int = 0
    start: float = field(default_factory=time.perf_counter)

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start


class Progress:
    """A tqdm bar over rows (finished ones, counting those done by earlier runs) with output tok/s."""

    def __init__(self, enabled: bool, stats: RunStats, counter: Optional[RowCounter]) -> None:
        self.stats = stats
        self.counter = counter
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=None, initial=stats.already_done, unit="row", desc="pagedgen", **bar_options(tqdm, mininterval=0.5))

    def update(self) -> None:
        if self.bar is None:
            return
        s = self.stats
        done = s.already_done + s.generated + s.bad
        if self.bar.total is None and self.counter is not None and self.counter.total is not None:
            self.bar.total = self.counter.total
        if done != self.bar.n:
            self.bar.update(done - self.bar.n)
            self.bar.set_postfix_str(f"{s.output_tokens / max(s.elapsed, 1e-9):,.0f} output tok/s", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            if self.counter is not None:
                self.counter.join(timeout=0.2)  # a short input's count is there; a huge one's is not awaited
            self.update()
            self.bar.close()


def summary(stats: RunStats, engine_stats, output: str, errors: Optional[str], completed: bool = True, has_rows: bool = True) -> str:
    """The closing summary (two or three lines); ``completed``: the run went through every row (it
    was not stopped at a bad row, a read error or a signal); ``has_rows``: the output holds a row (a
    stopped run that wrote none removes the output it created: the summary does not name it as a result)."""
    s, t = stats, max(stats.elapsed, 1e-9)
    total = s.already_done + s.generated + s.bad
    lines = [
        f"pagedgen: {total:,} {'row' if total == 1 else 'rows'}: {s.generated:,} generated, {s.already_done:,} skipped as already done, {s.bad:,} bad"
        f"{' (in the errors file)' if s.bad else ''}; {s.prompt_tokens:,} prompt and {s.output_tokens:,} output tokens in {t:.1f} s "
        f"({s.output_tokens / t:,.0f} output tok/s, {(s.prompt_tokens + s.output_tokens) / t:,.0f} tok/s in all)",
    ]
    if engine_stats is not None and engine_stats.num_steps == 0:  # no KV cache figures to give: no engine step ran
        if not completed:
            lines.append("pagedgen: the run stopped before the engine ran a step")
        else:
            why = "the rows left were all bad" if s.bad else "every row was done by an earlier run" if s.already_done else "the input has no rows"
            lines.append(f"pagedgen: nothing was left to generate ({why})")
    elif engine_stats is not None:
        e = engine_stats
        lines.append(
            f"pagedgen: KV cache utilization {e.kv_utilization_mean:.1%} (mean over {e.num_steps:,} steps, peak "
            f"{e.peak_used_blocks:,} of {e.num_kv_blocks:,} blocks"
            f"{'' if getattr(e, 'kv_cache_dtype', 'auto') == 'auto' else ', kv_cache_dtype ' + e.kv_cache_dtype}), {e.num_preemptions:,} preemptions, "
            f"prefix-cache hit rate {e.prefix_cache_hit_rate:.1%}"
            + (f"; {_QUANT_LABELS.get(e.quantization, 'quantized')} weights (quantization={e.quantization!r})"
               if getattr(e, "quantization", "") else "")
        )
        if getattr(e, "num_draft_tokens", 0):  # speculative decoding (docs/speculative.md)
            rates = ", ".join(f"{r:.0%}" for r in e.acceptance_rate_per_position)
            lines.append(
                f"pagedgen: speculative decoding: {e.num_accepted_tokens:,} of {e.num_draft_tokens:,} draft tokens accepted "
                f"({e.num_accepted_tokens / e.num_draft_tokens:.1%}; by position {rates})"
            )
    lines.append((f"pagedgen: output {output}" if has_rows else f"pagedgen: no row was written to {output}")
                 + (f", bad rows in {errors}" if errors else ""))
    return "\n".join(lines)
