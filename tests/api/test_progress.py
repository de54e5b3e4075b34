"""The progress bars where stderr is not a terminal (a log file, a batch job): plain lines, one per
interval and one at the end, instead of one endless line of carriage returns (issue 37). No model."""
import io
import sys

import pytest

import pagedgen.progress
from pagedgen.cli import progress as cli_progress
from pagedgen.progress import Progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def stderr(monkeypatch):
    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)  # not inside a Jupyter kernel
    monkeypatch.setattr(pagedgen.progress, "LOG_INTERVAL_S", 0.0, raising=False)  # a line at every update, for the test
    def use(stream):
        monkeypatch.setattr(sys, "stderr", stream)
        return stream
    return use


def _run(bar: Progress, steps: int = 5) -> None:
    for i in range(steps):
        bar.update(2, 10 * (i + 1))
    bar.close()


def test_llm_progress_writes_plain_lines_to_a_log(stderr):
    log = stderr(io.StringIO())
    _run(Progress(True, 10, "Processed prompts"))
    text = log.getvalue()
    lines = text.splitlines()
    assert "\r" not in text and text.endswith("\n")
    assert len(lines) >= 3 and all(line.startswith("Processed prompts:") for line in lines)
    assert "10/10 [" in lines[-1] and "output" in lines[-1] and "tok/s" in lines[-1]
    assert [int(line.split("/10 [")[0].rsplit(" ", 1)[1]) for line in lines] == sorted(
        int(line.split("/10 [")[0].rsplit(" ", 1)[1]) for line in lines)  # counts go up, line by line


def test_llm_progress_redraws_on_a_terminal(stderr):
    tty = stderr(_Terminal())
    _run(Progress(True, 10, "Processed prompts"))
    assert "\r" in tty.getvalue() and "10/10 [" in tty.getvalue()


def test_plain_lines_are_rate_limited(stderr, monkeypatch):
    log = stderr(io.StringIO())
    monkeypatch.setattr(pagedgen.progress, "LOG_INTERVAL_S", 3600.0, raising=False)
    _run(Progress(True, 200, "Processed prompts"), steps=100)
    lines = log.getvalue().splitlines()
    assert len(lines) == 2 and "0/200" in lines[0] and "200/200" in lines[1]  # the start and the end


def test_cli_progress_writes_plain_lines_to_a_log(stderr):
    log = stderr(io.StringIO())
    stats = cli_progress.RunStats(already_done=3)
    bar = cli_progress.Progress(True, stats, None)
    for _ in range(4):
        stats.generated += 1
        stats.output_tokens += 7
        bar.update()
    bar.close()
    text = log.getvalue()
    assert "\r" not in text and len(text.splitlines()) >= 3
    lines = text.splitlines()
    assert lines[0].startswith("pagedgen: 3row [") and lines[-1].startswith("pagedgen: 7row [")
    assert all(line.startswith("pagedgen: ") for line in lines) and "output tok/s" in lines[-1]
