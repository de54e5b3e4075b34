"""The progress bar of ``LLM`` calls: finished requests, with the output tokens/s (tqdm).

On a terminal (or in a notebook) tqdm redraws one line. Where stderr is not a terminal (a log file,
a batch job's captured output) redrawing would leave one endless line of carriage returns, so the
bar is printed as plain lines instead: tqdm's own redraws, at most one every ``LOG_INTERVAL_S``
seconds (tqdm's ``mininterval``), each written as a line of its own (``LineFile``), and a last one
when the bar closes. ``bar_options`` gives the tqdm arguments for either case; the command line's
bar (``pagedgen.cli.progress``) uses it too.
"""
from __future__ import annotations

import sys
import time
from typing import Optional

REFRESH_S = 0.5  # seconds between redraws of the tok/s figure while no request finishes
LOG_INTERVAL_S = 10.0  # seconds between progress lines when stderr is not a terminal


class LineFile:
    """A file for tqdm that writes each redraw (a carriage return, the bar, blank padding) as a line."""

    def __init__(self, fp) -> None:
        self.fp = fp

    def write(self, s: str) -> None:
        line = s.replace("\r", "").rstrip()
        if line:  # tqdm's clears and its closing newline carry no text
            self.fp.write(line + "\n")

    def flush(self) -> None:
        getattr(self.fp, "flush", lambda: None)()


def _redraws(fp, tqdm_class) -> bool:
    """Whether a bar on ``fp`` can redraw its line: a terminal, or a Jupyter/IPython kernel (tqdm's
    widget, or its text bar in a notebook's output area)."""
    if any(c.__module__ == "tqdm.notebook" for c in tqdm_class.__mro__) or "ipykernel" in sys.modules:
        return True
    try:
        return bool(fp.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed file
        return False


def bar_options(tqdm_class, mininterval: float = 0.1, file=None) -> dict:
    """tqdm keyword arguments (``file``, ``mininterval``, ...) for a bar of ``tqdm_class`` on ``file``
    (default: sys.stderr): a redrawn bar when it can redraw, else plain lines (module docstring)."""
    fp = sys.stderr if file is None else file
    if _redraws(fp, tqdm_class):
        return {"file": fp, "mininterval": mininterval, "dynamic_ncols": True}
    return {"file": LineFile(fp), "mininterval": LOG_INTERVAL_S, "ascii": True}


class Progress:
    """A tqdm bar of ``total`` requests (None: unknown), or nothing when ``enabled`` is False.

    ``num_generated_tokens``: the engine's running count of generated tokens now;
    ``update(num_finished, num_generated_tokens)`` after each engine step: the requests that
    finished in it, and that count again (for the output tok/s figure).
    """

    def __init__(self, enabled: bool, total: Optional[int], desc: str, num_generated_tokens: int = 0) -> None:
        self.bar = None
        self._refresh_s = REFRESH_S
        if enabled:
            from tqdm.auto import tqdm

            options = bar_options(tqdm)
            self._refresh_s = max(REFRESH_S, options["mininterval"])  # plain lines: no redraw between them
            self.bar = tqdm(total=total, desc=desc, **options)
        self._start = self._shown = time.perf_counter()
        self._tokens0 = num_generated_tokens

    def update(self, num_finished: int, num_generated_tokens: int) -> None:
        if self.bar is None:
            return
        now = time.perf_counter()
        if num_finished or now - self._shown >= self._refresh_s:  # tok/s moves while no request finishes too
            rate = (num_generated_tokens - self._tokens0) / max(now - self._start, 1e-9)
            self.bar.set_postfix_str(f"output {rate:.0f} tok/s", refresh=False)
            if num_finished:
                self.bar.update(num_finished)  # redraws (postfix included) at most every tqdm mininterval
            else:
                self.bar.refresh()
            self._shown = now

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
