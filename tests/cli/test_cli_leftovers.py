"""What a run leaves behind and what a rerun finds (issue 37): no lock file after a run, no files at
all after a run refused before it wrote a row (so the corrected command simply runs), the lock's
removal safe against a run waiting for it, a hand-deleted output line refused rather than appended
out of order, and the summary of a rerun with nothing left (in-process runs on stories260K)."""
import json
import os

import pytest

from cli_util import error_lines, read_jsonl, run_cli
from conftest import story_openings

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPTS = story_openings(30, seed=3)


def _base(model, src, dst, *extra):
    return ("--model", model, "--input", src, "--output", dst, "--temperature", "0", "--max-tokens", 2, *extra)


def _files(folder):
    return sorted(os.listdir(folder))


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_no_lock_file_after_a_run_and_nothing_after_a_refused_one(stories_path, tmp_path, capsys):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _jsonl(src, [{"prompt": p} for p in PROMPTS[:3]])
    rc, err = run_cli(capsys, *_base(stories_path, src, dst))
    assert rc == 0, err
    assert _files(tmp_path) == ["in.jsonl", "out.jsonl", "out.pagedgen.json"]  # no out.pagedgen.lock
    other = tmp_path / "other.jsonl"
    rc, err = run_cli(capsys, *_base(tmp_path / "no-such-model", src, other))  # refused before any work
    assert rc == 2 and "model folder not found" in err, err
    assert _files(tmp_path) == ["in.jsonl", "out.jsonl", "out.pagedgen.json"]


def test_empty_output_path_leaves_nothing(stories_path, tmp_path, capsys, monkeypatch):
    src = tmp_path / "in.jsonl"
    _jsonl(src, [{"prompt": "Once upon a time"}])
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    rc, err = run_cli(capsys, *_base(stories_path, src, ""))
    assert rc == 2 and error_lines(err) == ["pagedgen: error: --output '': give the path of the output file"], err
    assert _files(work) == []


def test_a_run_stopped_at_its_first_row_does_not_hold_the_next_to_its_flags(stories_path, tmp_path, capsys):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _jsonl(src, [{"prompt": p} for p in PROMPTS[:4]])
    rc, err = run_cli(capsys, *_base(stories_path, src, dst, "--prompt-field", "text"))
    assert rc == 2 and f"{src}: line 1: no field 'text'" in err and "(stopped there: no row was written;" in err, err
    assert f"pagedgen: output {dst}" not in err and f"pagedgen: no row was written to {dst}" in err, err  # not named as a result
    assert _files(tmp_path) == ["in.jsonl"]  # no empty output, no sidecar, no lock
    rc, err = run_cli(capsys, *_base(stories_path, src, dst))  # the corrected command
    assert rc == 0, err
    assert [r["index"] for r in read_jsonl(dst)] == [0, 1, 2, 3]


def test_an_empty_output_left_with_its_sidecar_starts_afresh(stories_path, tmp_path, capsys):
    """Files of an earlier run that wrote no row (a run killed before its first write, or an older
    version): the sidecar's flags do not bind the next run."""
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _jsonl(src, [{"prompt": p, "text": p.upper()} for p in PROMPTS[:3]])
    assert run_cli(capsys, *_base(stories_path, src, dst, "--prompt-field", "text"))[0] == 0
    dst.write_bytes(b"")  # as a run killed before its first write leaves it
    rc, err = run_cli(capsys, *_base(stories_path, src, dst))
    assert rc == 0 and "3 generated, 0 skipped" in err, err
    assert [r["prompt"] for r in read_jsonl(dst)] == PROMPTS[:3]
    assert json.loads((tmp_path / "out.pagedgen.json").read_text())["params"]["prompt_field"] == "prompt"


def test_a_deleted_line_is_refused_not_appended_out_of_order(stories_path, tmp_path, capsys):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _jsonl(src, [{"prompt": p} for p in PROMPTS])
    assert run_cli(capsys, *_base(stories_path, src, dst))[0] == 0
    lines = dst.read_bytes().splitlines(keepends=True)
    edited = b"".join(lines[:10] + lines[11:])  # row 10 deleted by hand
    dst.write_bytes(edited)
    rc, err = run_cli(capsys, *_base(stories_path, src, dst))
    assert rc == 2 and error_lines(err)[0].startswith(
        f"pagedgen: error: {dst}:11: row 10 is missing before this line's row 11"), err
    assert "remove their lines and every line after them" in err and dst.read_bytes() == edited
    swapped = b"".join(lines[:3] + [lines[4], lines[3]] + lines[5:])  # rows out of order
    dst.write_bytes(swapped)
    rc, err = run_cli(capsys, *_base(stories_path, src, dst))
    assert rc == 2 and f"{dst}:5: row 3 comes after row 4" in err, err
    dst.write_bytes(b"".join(lines[:10]))  # as the message says: rows 10-29 are generated again, in order
    rc, err = run_cli(capsys, *_base(stories_path, src, dst))
    assert rc == 0 and "20 generated, 10 skipped as already done" in err, err
    assert dst.read_bytes() == b"".join(lines)
    # --unordered promises no order: its rerun fills the hole at the end
    unordered = tmp_path / "u.jsonl"
    assert run_cli(capsys, *_base(stories_path, src, unordered, "--unordered"))[0] == 0
    rows = unordered.read_bytes().splitlines(keepends=True)
    unordered.write_bytes(b"".join(r for r in rows if json.loads(r)["index"] != 10))
    rc, err = run_cli(capsys, *_base(stories_path, src, unordered, "--unordered"))
    assert rc == 0 and "1 generated, 29 skipped" in err, err
    assert [r["index"] for r in read_jsonl(unordered)][-1] == 10


def test_summary_of_a_rerun_with_nothing_left(stories_path, tmp_path, capsys):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _jsonl(src, [{"prompt": p} for p in PROMPTS[:2]])
    rc, err = run_cli(capsys, *_base(stories_path, src, dst))
    assert rc == 0 and "KV cache utilization" in err, err
    rc, err = run_cli(capsys, *_base(stories_path, src, dst))
    assert rc == 0 and "0 generated, 2 skipped as already done" in err, err
    assert "pagedgen: nothing was left to generate (every row was done by an earlier run)" in err
    assert "KV cache utilization" not in err and "mean over 0 steps" not in err


def test_the_lock_file_is_removed_only_while_held(tmp_path, monkeypatch):
    """A run that opened the lock file while the holder removed it must not lock the removed file
    (a third run would then lock a new one at the same path, and two runs would write at once)."""
    import fcntl

    from pagedgen.cli.errors import CLIError
    from pagedgen.cli.lock import OutputLock

    out = str(tmp_path / "out.jsonl")
    first = OutputLock(out).__enter__()
    with pytest.raises(CLIError, match="another pagedgen run"):
        OutputLock(out).__enter__()
    assert os.path.exists(first.path)
    real_flock, calls = fcntl.flock, []

    def flock(fd, op):  # the first run ends between the second's open and its flock
        calls.append(fd)
        if len(calls) == 1:
            first.__exit__(None, None, None)
        return real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    second = OutputLock(out).__enter__()
    monkeypatch.setattr(fcntl, "flock", real_flock)
    assert len(calls) == 2  # it locked the removed file, saw that, and locked the new one
    st, own = os.stat(second.path), os.fstat(second._fd)
    assert (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)
    with pytest.raises(CLIError, match="another pagedgen run"):
        OutputLock(out).__enter__()  # a third run is refused
    second.__exit__(None, None, None)
    assert not os.path.exists(second.path)


def test_a_wrong_field_name_is_hinted_by_the_rows_fields_never_by_on_error_skip(stories_path, tmp_path, capsys):
    """A first row without --prompt-field's field: the command's name is likely wrong. The hint names
    the row's field that could be the prompt and does not suggest --on-error skip (which would make
    every row bad and keep a sidecar binding the next run to the wrong name)."""
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _jsonl(src, [{"id": i, "text": p} for i, p in enumerate(PROMPTS[:2])])
    rc, err = run_cli(capsys, *_base(stories_path, src, dst))
    assert rc == 2 and error_lines(err) == [
        f"pagedgen: error: {src}: line 1: no field 'prompt' (fields: id, text); use --prompt-field text (stopped there: "
        "no row was written; rerun with the field's name corrected, which starts afresh)"], err
    assert _files(tmp_path) == ["in.jsonl"]
    _jsonl(src, [{"a": "x", "b": "y"}, {"prompt": PROMPTS[0]}])  # several candidates: all named
    rc, err = run_cli(capsys, *_base(stories_path, src, dst))
    assert rc == 2 and "use --prompt-field with one of a, b (stopped there" in err and "--on-error" not in err, err
    _jsonl(src, [{"prompt": PROMPTS[0]}, {"text": PROMPTS[1]}])  # after a written row: the row is the odd one out
    rc, err = run_cli(capsys, *_base(stories_path, src, dst))
    assert rc == 2 and "use --prompt-field text (stopped there: 1 row is in" in err and "or pass --on-error skip)" in err, err


def test_a_missing_messages_field_names_the_fields_holding_messages():
    from pagedgen.cli.prompts import missing_field
    row = {"id": 1, "conv": [{"role": "user", "content": "hi"}], "tags": ["a"]}
    assert missing_field("messages", "--messages-field", row) == \
        "no field 'messages' (fields: id, conv, tags); use --messages-field conv"
    assert missing_field("prompt", "--prompt-field", {"ids": [1, 2], "n": 3}) == \
        "no field 'prompt' (fields: ids, n); use --prompt-field ids"
