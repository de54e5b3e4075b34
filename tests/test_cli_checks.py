"""The CLI's checks before any work: output paths that are not regular files, flag values that
depend on the loaded vocabulary, field names, input headers; and rows whose text cannot be
tokenized or written (lone surrogates). Each is one `pagedgen: error:` line (exit 2) or a bad row."""
import json
import os

import pytest

from cli_util import error_lines, read_jsonl, run_cli

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _base(stories_path, src, dst, *extra):
    return ("--model", stories_path, "--input", src, "--output", dst, "--temperature", "0", "--max-tokens", 2, *extra)


def _input(tmp_path, *rows):
    src = tmp_path / "in.jsonl"
    src.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return src


def test_output_that_is_not_a_regular_file_is_refused_and_kept(stories_path, tmp_path, capsys, monkeypatch):
    src = _input(tmp_path, {"prompt": "a"})
    target = tmp_path / "target.jsonl"
    target.write_text("")
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    errors_fifo = tmp_path / "o2.errors.jsonl"
    os.mkfifo(errors_fifo)
    cases = [(link, "is a symbolic link"), (fifo, "is not a regular file"), (tmp_path / "o2.jsonl", "o2.errors.jsonl"),
             ("-", "writing to stdout is not supported")]
    monkeypatch.chdir(tmp_path)
    for out, why in cases:
        for extra in ((), ("--overwrite",)):
            rc, err = run_cli(capsys, *_base(stories_path, src, out, *extra))
            assert rc == 2 and len(error_lines(err)) == 1 and why in err, err
            assert "loading" not in err and "rows:" not in err
    assert link.is_symlink() and os.readlink(link) == str(target) and target.read_text() == ""
    assert fifo.is_fifo() and errors_fifo.is_fifo() and not (tmp_path / "-").exists()
    assert not (tmp_path / "o2.jsonl").exists() and not (tmp_path / "link.pagedgen.json").exists()
    # an empty regular output without a sidecar is written in place (the same file, not removed)
    dst = tmp_path / "empty.jsonl"
    dst.write_text("")
    inode = dst.stat().st_ino
    rc, err = run_cli(capsys, *_base(stories_path, src, dst))
    assert rc == 0, err
    assert dst.stat().st_ino == inode and [r["index"] for r in read_jsonl(dst)] == [0]
