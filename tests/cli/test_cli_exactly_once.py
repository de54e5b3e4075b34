"""Resume edge cases of the CLI's exactly-once rules (docs/cli.md, "Resuming"): the recorded input
prefix after a stop at a bad row, foreign lines at the end of an output, outputs whose names differ
only by ``.jsonl``, two runs on one output at once, and an input whose last line was still being
written (in-process runs on stories260K, a few rows, a few tokens)."""
import json
import time

import pytest

from cli_util import error_lines, popen_cli, read_jsonl, run_cli
from conftest import story_openings

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPTS = story_openings(24)


def _base(stories_path, src, dst, *extra):
    return ("--model", stories_path, "--input", src, "--output", dst, "--temperature", "0", "--max-tokens", 2, *extra)


def _openai_line(i, max_tokens, bad=False):
    body = {"prompt": PROMPTS[i], "max_tokens": max_tokens, **({"temperature": -1} if bad else {})}
    return json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}) + "\n"


@pytest.mark.parametrize("rows, bad, max_in_flight, order", [(24, 20, 8, []), (12, 5, 2, ["--unordered"])])
def test_fixing_a_bad_row_after_rows_read_ahead_resumes(rows, bad, max_in_flight, order, stories_path, tmp_path, capsys):
    """Rows are read ahead of the one being added (shapes found to write rows while the bad row,
    already read, waits): the prefix the sidecar records must still end before the bad row, so that
    fixing it, as the message says, resumes."""
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(_openai_line(i, [1, 3][i % 2], i == bad) for i in range(rows)))
    flags = ("--max-num-seqs", 4, "--max-in-flight", max_in_flight, "--flush-rows", 1, *order)
    rc, err = run_cli(capsys, *_base(stories_path, src, dst, *flags))
    assert rc == 2 and f"{src}: line {bad + 1}: " in err and f"{bad} rows are in" in err, err
    written = sorted(int(r["id"].removeprefix("batch_req_")) for r in read_jsonl(dst))
    assert written == list(range(bad))
    assert json.loads((tmp_path / "out.pagedgen.json").read_text())["input"]["rows"] == bad  # not past the bad row
    src.write_text("".join(_openai_line(i, [1, 3][i % 2]) for i in range(rows)))
    rc, err = run_cli(capsys, *_base(stories_path, src, dst, *flags))
    assert rc == 0 and f"{rows - bad} generated, {bad} skipped as already done" in err, err
    assert sorted(int(r["id"].removeprefix("batch_req_")) for r in read_jsonl(dst)) == list(range(rows))


def test_complete_foreign_lines_at_the_end_are_refused_not_cut(stories_path, tmp_path, capsys):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:3]))
    assert run_cli(capsys, *_base(stories_path, src, dst))[0] == 0
    rows = dst.read_bytes().splitlines(keepends=True)
    dst.write_bytes(b"".join(rows[:2]))  # a partial output (row 2 not written yet) ...
    for notes in ([b'{"note": "row 0 checked"}\n', b'{"note": "row 1 checked"}\n'], [b'{"note": "looks fine"}\n']):
        with open(dst, "wb") as f:  # ... with complete lines someone appended
            f.write(b"".join(rows[:2] + notes))
        rc, err = run_cli(capsys, *_base(stories_path, src, dst))
        assert rc == 2 and error_lines(err) and f"{dst}:3: " in error_lines(err)[0], err
        assert "cut" not in err and dst.read_bytes() == b"".join(rows[:2] + notes)
    dst.write_bytes(b"".join(rows[:2]) + rows[2][:10])  # an unfinished last line is still repaired
    rc, err = run_cli(capsys, *_base(stories_path, src, dst))
    assert rc == 0 and "cut 10 bytes of an unfinished last line" in err and dst.read_bytes() == b"".join(rows)


def test_outputs_named_with_and_without_jsonl_keep_their_own_files(stories_path, tmp_path, capsys):
    """``res`` and ``res.jsonl`` share ``res.pagedgen.json`` and ``res.errors.jsonl``: the sidecar
    records its output, and another output's files are never used, replaced or deleted."""
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": PROMPTS[0]}) + "\n" + json.dumps({"text": "no prompt"}) + "\n")
    res_jsonl, res = tmp_path / "res.jsonl", tmp_path / "res"
    car, errors = tmp_path / "res.pagedgen.json", tmp_path / "res.errors.jsonl"
    assert run_cli(capsys, *_base(stories_path, src, res_jsonl, "--on-error", "skip"))[0] == 0
    files = {p: p.read_bytes() for p in (res_jsonl, car, errors)}
    for extra in ([], ["--overwrite"]):
        rc, err = run_cli(capsys, *_base(stories_path, src, res, "--on-error", "skip", *extra))
        assert rc == 2 and f"belong to --output {str(res_jsonl)!r}" in err and "choose another output name" in err, err
        assert not res.exists() and {p: p.read_bytes() for p in files} == files
    rc, err = run_cli(capsys, *_base(stories_path, src, res_jsonl, "--on-error", "skip"))
    assert rc == 0 and "0 generated, 2 skipped as already done" in err, err
    res_jsonl.unlink()  # its files are left over: reused only with --overwrite
    rc, err = run_cli(capsys, *_base(stories_path, src, res, "--on-error", "skip"))
    assert rc == 2 and "which no longer exists: pass --overwrite" in err, err
    rc, err = run_cli(capsys, *_base(stories_path, src, res, "--on-error", "skip", "--overwrite"))
    assert rc == 0 and json.loads(car.read_text())["output"] == "res" and len(read_jsonl(res)) == 1, err
    # an older sidecar (no "output") belongs to whichever of the two names exists
    data = json.loads(car.read_text())
    del data["output"]
    car.write_text(json.dumps(data))
    rc, err = run_cli(capsys, *_base(stories_path, src, res_jsonl, "--on-error", "skip"))
    assert rc == 2 and f"belong to --output {str(res)!r}" in err, err
    rc, err = run_cli(capsys, *_base(stories_path, src, res, "--on-error", "skip"))
    assert rc == 0 and "2 skipped as already done" in err and json.loads(car.read_text())["output"] == "res", err


def _wait_for_lines(path, n, proc, timeout=120.0):
    end = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < end:
        if path.exists() and path.read_bytes().count(b"\n") >= n:
            return
        time.sleep(0.01)
    raise AssertionError(f"{path} never held {n} lines: {proc.communicate()[1]}")


def test_a_second_run_on_the_same_output_is_refused(stories_path, tmp_path, capsys):
    """An exclusive lock per output: a second run is refused at once (naming the first one's pid)
    and touches nothing; the lock goes with the process, kill -9 included."""
    import pagedgen.engine_args, pagedgen.sampling_args  # noqa: F401 (imported: the second run reaches the lock at once)

    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = 1000
    src.write_text("".join(json.dumps({"prompt": PROMPTS[i % 24]}) + "\n" for i in range(rows)))
    flags = ("--max-tokens", 4, "--flush-rows", 5, "--flush-seconds", 0.05)
    first = popen_cli(*_base(stories_path, src, dst, *flags))
    try:
        _wait_for_lines(dst, 10, first)
        for extra in ([], ["--overwrite"]):
            rc, err = run_cli(capsys, *_base(stories_path, src, dst, *flags, *extra))
            assert rc == 2 and error_lines(err) == [
                f"pagedgen: error: --output {str(dst)!r}: another pagedgen run (pid {first.pid}, --output 'out.jsonl') is "
                f"writing it (lock {str(tmp_path / 'out.pagedgen.lock')!r}); wait for it to finish, or choose another output"], err
        first.kill()  # kill -9: the kernel drops the lock
        first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate()
    rc, err = run_cli(capsys, *_base(stories_path, src, dst, *flags))
    assert rc == 0 and "skipped as already done" in err, err
    assert [r["index"] for r in read_jsonl(dst)] == list(range(rows))
    rc, err = run_cli(capsys, *_base(stories_path, src, dst, *flags))  # released after a run in this process too
    assert rc == 0 and f"0 generated, {rows:,} skipped as already done" in err, err


def test_an_input_whose_last_line_was_still_being_written(stories_path, tmp_path, capsys):
    """A last line read without its newline: a file that later continues that line changed that
    row (refused unless --overwrite); one that ends the line and goes on resumes."""
    src, dst = tmp_path / "grow.txt", tmp_path / "out.jsonl"
    src.write_bytes(b"Once upon a time\r\nThe d")
    assert run_cli(capsys, *_base(stories_path, src, dst))[0] == 0
    assert [r["prompt"] for r in read_jsonl(dst)] == ["Once upon a time", "The d"]
    with open(src, "ab") as f:
        f.write(b"og ran\nLily\n")
    rc, err = run_cli(capsys, *_base(stories_path, src, dst))
    assert rc == 2 and "row 1, the one the output ends with, was the file's last line, without a newline" in err, err
    assert "--overwrite" in err and [r["prompt"] for r in read_jsonl(dst)] == ["Once upon a time", "The d"]
    rc, err = run_cli(capsys, *_base(stories_path, src, dst, "--overwrite"))
    assert rc == 0 and [r["prompt"] for r in read_jsonl(dst)] == ["Once upon a time", "The dog ran", "Lily"], err
    for ending in (b"\n", b"\r\n"):  # the line ends, the file goes on: the row is the same, the rerun resumes
        src.write_bytes(b"Once upon a time\nThe dog")
        assert run_cli(capsys, *_base(stories_path, src, dst, "--overwrite"))[0] == 0
        with open(src, "ab") as f:
            f.write(ending + b"Lily\n")
        rc, err = run_cli(capsys, *_base(stories_path, src, dst))
        assert rc == 0 and "1 generated, 2 skipped as already done" in err, err
        assert [r["prompt"] for r in read_jsonl(dst)] == ["Once upon a time", "The dog", "Lily"]


@pytest.mark.parametrize("start, more, same", [(b"a\nb", b"", True), (b"a\nb", b"\nc", True), (b"a\nb", b"\r\nc", True),
                                               (b"a\nb\r", b"\nc", True), (b"a\nb\r", b"\r\nc", False), (b"a\nb", b"c\n", False),
                                               (b"a\nb", b"\rc\n", False), (b"a\nb", b" \n", False)])
def test_a_continued_last_line_is_a_changed_row(start, more, same, tmp_path):
    from pagedgen.cli import sidecar
    from pagedgen.cli.errors import CLIError

    src = tmp_path / "in.txt"
    tracker = sidecar.InputTracker()
    for i, line in enumerate(start.splitlines(keepends=True)):
        tracker.feed(line, i + 1)
    car = sidecar.Sidecar(str(tmp_path / "s.json"), {"version": 1, "input": {"format": "text", "bytes": 0, "rows": 0}})
    car.update_input(tracker.state_through(1))
    assert car.data["input"]["ends_mid_line"]
    src.write_bytes(start + more)
    if same:
        car.check_input_file(str(src), "text", "out.jsonl")
    else:
        with pytest.raises(CLIError, match="the file now continues that line"):
            car.check_input_file(str(src), "text", "out.jsonl")
