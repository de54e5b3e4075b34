"""The CLI's durable, ordered writer; the resume scan (done rows, torn lines); the sidecar's
fingerprints and its input-prefix check. No model needed."""
import hashlib
import json
import os

import pytest

from pagedgen.cli import resume, sidecar
from pagedgen.cli.errors import CLIError
from pagedgen.cli.writer import Appender, RowWriter, output_is_input


def _line(i, **extra):
    return (json.dumps({"index": i, **extra}) + "\n").encode()


def _writer(tmp_path, ordered=True, max_buffered=100, flush_rows=1000, calls=None):
    calls = calls if calls is not None else []
    w = RowWriter(Appender(str(tmp_path / "out.jsonl")), Appender(str(tmp_path / "out.errors.jsonl")), ordered=ordered,
                  max_buffered=max_buffered, flush_rows=flush_rows, flush_seconds=3600, before_write=calls.append)
    return w, calls


def _indices(path):
    return [json.loads(line)["index"] for line in open(path)] if os.path.exists(path) else []


def test_ordered_writer_writes_a_row_only_after_every_earlier_one(tmp_path):
    w, calls = _writer(tmp_path, max_buffered=2)
    for i in range(5):
        w.admit(i)
    w.finish(2, _line(2))
    w.finish(1, _line(1, bad=True), error=True)
    assert w.buffered == 2 and not w.can_admit()  # 0 is still running: 1 and 2 wait
    w.flush()
    assert not os.path.exists(tmp_path / "out.jsonl") and calls == []
    w.finish(0, _line(0))
    assert w.buffered == 0 and w.can_admit()
    w.finish(4, _line(4))
    w.flush()
    assert calls == [2]
    assert _indices(tmp_path / "out.jsonl") == [0, 2] and _indices(tmp_path / "out.errors.jsonl") == [1]
    assert w.abandon() == 1  # row 4 finished, but 3 did not: 4 is generated again on resume
    w.close()
    assert _indices(tmp_path / "out.jsonl") == [0, 2]


def test_unordered_writer_and_flush_by_count(tmp_path):
    w, calls = _writer(tmp_path, ordered=False, flush_rows=2)
    for i in (3, 1):
        w.finish(i, _line(i))
        w.maybe_flush()
    assert _indices(tmp_path / "out.jsonl") == [3, 1] and calls == [3]
    w.finish(0, _line(0))
    w.maybe_flush()  # one row waits: under flush_rows, and the interval has not passed
    assert _indices(tmp_path / "out.jsonl") == [3, 1]
    w.close()
    assert _indices(tmp_path / "out.jsonl") == [3, 1, 0] and w.rows_written == 3


def test_scan_done_rows_and_repair_torn_tail(tmp_path):
    out = tmp_path / "out.jsonl"
    good = _line(0, x="a, \"index\": 9") + _line(2) + _line(1)
    out.write_bytes(good + b'{"index": 3, "compl')
    done = resume.DoneSet()
    scan = resume.scan(str(out), "rows", done)
    assert (done.count, done.max_index, scan.rows, scan.torn_bytes) == (3, 2, 3, len(b'{"index": 3, "compl'))
    assert 1 in done and 3 not in done and 100000 not in done
    resume.truncate_to(scan)
    assert out.read_bytes() == good
    # a power loss can leave zeros after the last line, or a whole line that is not valid JSON
    out.write_bytes(good + b"\0" * 4096)
    scan = resume.scan(str(out), "rows", resume.DoneSet())
    assert scan.torn_bytes == 4096
    out.write_bytes(good + b'{"index": 5, "x": \0\0\0}\n')
    assert resume.scan(str(out), "rows", resume.DoneSet()).good_bytes == len(good)
    # ... but a bad line followed by other lines is not a torn write: refused, whatever follows it
    for tail in (_line(1), b"more garbage\n", b'{"note": 2}\n'):
        out.write_bytes(_line(0) + b"garbage\n" + tail)
        with pytest.raises(CLIError, match=r"out.jsonl:2: not a row pagedgen writes, with more lines after it"):
            resume.scan(str(out), "rows", resume.DoneSet())
    # nor is a complete, valid JSON last line that is not a row: refused, never deleted
    for tail in (b'{"note": "checked by hand"}\n', b'{"index": "x"}\n', b"[1, 2]\n"):
        out.write_bytes(good + tail)
        with pytest.raises(CLIError, match=r"out.jsonl:4: a complete line that is not a row pagedgen writes"):
            resume.scan(str(out), "rows", resume.DoneSet())
    out.write_bytes(good + b'{"note": "unfinished"}')  # valid JSON but no newline: a torn write
    assert resume.scan(str(out), "rows", resume.DoneSet()).good_bytes == len(good)
    out.write_bytes(_line(0) + _line(0))
    with pytest.raises(CLIError, match="row 0 is written twice"):
        resume.scan(str(out), "rows", resume.DoneSet())


def test_scan_openai_and_custom_index_field(tmp_path):
    out = tmp_path / "o.jsonl"
    out.write_bytes(b'{"id": "batch_req_4", "custom_id": "x"}\n')
    done = resume.DoneSet()
    resume.scan(str(out), "openai", done)
    assert 4 in done
    out.write_bytes(b'{"row_id": 7, "index": 1}\n')
    done = resume.DoneSet()
    resume.scan(str(out), "rows", done, index_field="row_id")
    assert 7 in done and 1 not in done


def test_done_set_is_compact():
    done = resume.DoneSet()
    for i in range(0, 1_000_000, 3):
        assert done.add(i)
    assert not done.add(999_999) and done.count == 333_334 and 999_998 not in done
    assert len(done._bits) <= 2 * 125_000


def test_sidecar_round_trip_and_checks(tmp_path):
    path = str(tmp_path / "out.pagedgen.json")
    data = {"version": sidecar.SIDECAR_VERSION, "created": 1, "input": {"format": "jsonl", "bytes": 0, "rows": 0},
            "model": {"config.json": {"size": 2, "sha256": "ab"}}, "params": {"temperature": 0.0, "max_tokens": 8}}
    car = sidecar.Sidecar(path, data)
    car.save()
    loaded = sidecar.Sidecar.load(path)
    assert loaded.data == data and not os.path.exists(path + ".tmp")
    loaded.check(data["model"], data["params"], "out.jsonl")
    with pytest.raises(CLIError, match=r"parameters differ .*temperature: 0.0 -> 0.8"):
        loaded.check(data["model"], {"temperature": 0.8, "max_tokens": 8}, "out.jsonl")
    with pytest.raises(CLIError, match=r"model differs .*changed: config.json"):
        loaded.check({"config.json": {"size": 3, "sha256": "cd"}}, data["params"], "out.jsonl")
    # a flag a newer pagedgen added (prompt_logprob_start), left unset, is the same run; set, it differs
    loaded.check(data["model"], {**data["params"], "prompt_logprob_start": None}, "out.jsonl")
    with pytest.raises(CLIError, match=r"parameters differ .*prompt_logprob_start: None -> 3"):
        loaded.check(data["model"], {**data["params"], "prompt_logprob_start": 3}, "out.jsonl")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(CLIError, match="cannot read the sidecar"):
        sidecar.Sidecar.load(str(tmp_path / "bad.json"))


def test_input_prefix_check(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c"}\n')
    tracker = sidecar.InputTracker()
    for i, line in enumerate(src.read_bytes().splitlines(keepends=True)):
        tracker.feed(line, i + 1)
    car = sidecar.Sidecar(str(tmp_path / "s.json"), {"version": 1, "input": {"format": "jsonl", "bytes": 0, "rows": 0}})
    car.update_input(tracker.state_through(0))  # row 0 written; rows 1-2 read ahead (a bad row, say) are not covered
    assert car.input_rows == 1 and car.data["input"]["bytes"] == 16
    car.update_input(tracker.state_through(1))
    assert car.input_rows == 2 and tracker.state() == {"bytes": 48, "rows": 3, "sha256": hashlib.sha256(src.read_bytes()).hexdigest()}
    with pytest.raises(KeyError):
        tracker.state_through(0)  # forgotten: the prefix only grows
    with pytest.raises(KeyError):
        tracker.state_through(5)
    car.update_input({"bytes": 16, "rows": 1, "sha256": "x"})  # never shorter
    assert car.input_rows == 2
    later = sidecar.InputTracker(keep_from=2)  # a resumed run keeps the states of rows past the sidecar's prefix only
    for i, line in enumerate(src.read_bytes().splitlines(keepends=True)):
        later.feed(line, i + 1)
    assert later.state_through(2) == {**tracker.state(), "ends_mid_line": False} and len(later._after) == 1
    car.check_input_file(str(src), "jsonl", "out.jsonl")
    src.write_bytes(b'{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "CHANGED after the prefix"}\n{"more": 1}\n')
    car.check_input_file(str(src), "jsonl", "out.jsonl")
    src.write_bytes(b'{"prompt": "a"}\n{"prompt": "B"}\n{"prompt": "c"}\n')
    with pytest.raises(CLIError, match=r"changed since .*first 32 bytes \(rows 0-1; the output holds rows up to row 1\) differ"):
        car.check_input_file(str(src), "jsonl", "out.jsonl")
    src.write_bytes(b'{"prompt": "a"}\n')
    with pytest.raises(CLIError, match="are missing"):
        car.check_input_file(str(src), "jsonl", "out.jsonl")


def test_model_fingerprint(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "README.md").write_text("not part of the model")
    big = tmp_path / "model.safetensors"
    big.write_bytes(os.urandom(3 << 20))
    monkeypatch.setattr(sidecar, "SAMPLED_OVER", 1 << 20)
    monkeypatch.setattr(sidecar, "SAMPLE_BYTES", 1 << 16)
    fp = sidecar.model_fingerprint([str(tmp_path)])
    assert set(fp) == {"config.json", "model.safetensors"} and "sampled_sha256" in fp["model.safetensors"]
    os.utime(big, (0, 0))  # a copy with another mtime is the same model
    assert sidecar.model_fingerprint([str(tmp_path)]) == fp
    data = bytearray(big.read_bytes())
    data[-5] ^= 1  # the last sample covers the file's tail
    big.write_bytes(bytes(data))
    assert sidecar.model_fingerprint([str(tmp_path)]) != fp


def test_output_is_input(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("{}\n")
    os.link(src, tmp_path / "hard.jsonl")
    assert output_is_input(str(src), str(src)) == "is the input file"
    assert output_is_input(str(tmp_path / "." / "in.jsonl"), str(src)) == "is the input file"
    assert "same inode" in output_is_input(str(tmp_path / "hard.jsonl"), str(src))
    assert output_is_input(str(tmp_path / "out.jsonl"), str(src)) is None
    assert sidecar.paths_for("out.jsonl") == ("out.pagedgen.json", "out.errors.jsonl")


def test_nothing_is_appended_after_a_failed_write(tmp_path, monkeypatch):
    app = Appender(str(tmp_path / "out.jsonl"))
    app.add(0, _line(0))
    app.write_pending()
    app.add(1, _line(1))

    class Full:
        def write(self, data):
            raise OSError(28, "No space left on device")

    real = app._f
    app._f = Full()
    with pytest.raises(OSError):
        app.write_pending()
    app._f = real
    app.add(2, _line(2))
    app.write_pending()  # after a torn write nothing more goes in: rows 1 and 2 are redone on resume
    app.close()
    assert _indices(tmp_path / "out.jsonl") == [0] and app.lines_written == 1
