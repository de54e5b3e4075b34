"""Resumable, exactly once (issue 10): the CLI killed with SIGKILL at random moments of a 2,000-row
run and restarted each time, interrupted by SIGTERM and SIGINT, and handed a torn last line, ends
with the same bytes as an uninterrupted greedy run: every row once, in input order, its fields kept."""
import json
import random
import signal
import time

import pytest

from cli_util import popen_cli, read_jsonl, run_cli
from conftest import story_openings

ROWS = 2000
ARGS = ("--temperature", "0", "--max-tokens", 4, "--flush-rows", 25, "--flush-seconds", 0.05)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, stories_path):
    """(input file, the bytes of an uninterrupted run's output)."""
    folder = tmp_path_factory.mktemp("cli-interrupt")
    src = folder / "in.jsonl"
    prompts = story_openings(1000)
    src.write_text("".join(json.dumps({"id": f"r{i}", "prompt": prompts[i % 1000], "meta": [i]}) + "\n" for i in range(ROWS)))
    return src, folder


@pytest.fixture(scope="module")
def reference(dataset, stories_path, one_torch_thread):
    from pagedgen.cli import main

    src, folder = dataset
    ref = folder / "reference.jsonl"
    assert main(["--model", stories_path, "--input", str(src), "--output", str(ref), *map(str, ARGS), "--no-tqdm"]) == 0
    rows = read_jsonl(ref)
    assert [r["index"] for r in rows] == list(range(ROWS)) and rows[5]["id"] == "r5" and rows[5]["meta"] == [5]
    return ref.read_bytes()


def _lines(path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def _interrupt(proc, out, at_rows: int, sig, timeout=120.0):
    """Send ``sig`` to ``proc`` once ``out`` holds ``at_rows`` lines (or when it exits); returns its
    exit code and stderr."""
    end = time.monotonic() + timeout
    while proc.poll() is None and _lines(out) < at_rows and time.monotonic() < end:
        time.sleep(0.01)
    if proc.poll() is None:
        proc.send_signal(sig)
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def _check_prefix(out, reference: bytes):
    """The file is a prefix of the uninterrupted output, up to a torn tail (cut off on resume)."""
    data = out.read_bytes() if out.exists() else b""
    whole = data[: data.rfind(b"\n") + 1]
    assert reference.startswith(whole)


def test_sigkill_at_random_moments(dataset, reference, stories_path, tmp_path, capsys):
    src, _ = dataset
    out = tmp_path / "out.jsonl"
    rng = random.Random(20261201)
    targets = [0] + sorted(rng.sample(range(50, ROWS - 100), 2))
    for target in targets:
        proc = popen_cli("--model", stories_path, "--input", src, "--output", out, *ARGS)
        if target == 0:  # during start-up or the first rows
            time.sleep(rng.uniform(0.5, 4.0))
        rc, err = _interrupt(proc, out, target, signal.SIGKILL)
        assert rc in (-signal.SIGKILL, 0), err
        _check_prefix(out, reference)
    rc, err = run_cli(capsys, "--model", stories_path, "--input", src, "--output", out, *ARGS)
    assert rc == 0, err
    assert "skipped as already done" in err
    assert out.read_bytes() == reference


def test_sigterm_sigint_and_torn_line(dataset, reference, stories_path, tmp_path, capsys):
    src, _ = dataset
    out = tmp_path / "out.jsonl"
    proc = popen_cli("--model", stories_path, "--input", src, "--output", out, *ARGS)
    rc, err = _interrupt(proc, out, 400, signal.SIGTERM)
    assert rc == 128 + signal.SIGTERM, err
    assert "interrupted by SIGTERM" in err and "run the same command again to resume" in err and "Traceback" not in err
    _check_prefix(out, reference)
    done = _lines(out)
    # a torn last line (a write cut short by a power loss) is cut off and its row generated again
    torn = reference.splitlines(keepends=True)[done][:40]
    with open(out, "ab") as f:
        f.write(torn)
    proc = popen_cli("--model", stories_path, "--input", src, "--output", out, *ARGS)
    rc, err = _interrupt(proc, out, done + 600, signal.SIGINT)
    assert rc == 128 + signal.SIGINT, err
    assert f"cut {len(torn)} bytes of an unfinished last line" in err
    assert "interrupted by SIGINT" in err and "run the same command again to resume" in err
    assert f"{done:,} skipped as already done" in err
    _check_prefix(out, reference)
    rc, err = run_cli(capsys, "--model", stories_path, "--input", src, "--output", out, *ARGS)
    assert rc == 0, err
    assert out.read_bytes() == reference
