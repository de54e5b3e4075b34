"""The CLI's input readers: each format parsed as what it is, rows numbered, line numbers the file's
own (1-based, blank lines counted), bad rows reported not dropped, spans concatenating to the file's
bytes (the resume check hashes them), and memory flat (rows come from a generator)."""
import io
import json
import time

import pytest

from pagedgen.cli import readers
from pagedgen.cli.errors import CLIError
from pagedgen.cli.json_array import iter_json_array


def _rows(tmp_path, name, data: bytes, fmt=None, prompt_field="prompt", required=None):
    path = tmp_path / name
    path.write_bytes(data)
    fmt = fmt or readers.detect_format(str(path))
    rows = list(readers.read_rows(str(path), fmt, prompt_field=prompt_field, required_column=required))
    if fmt != "parquet":
        joined = b"".join(r.span for r in rows)
        assert data.startswith(joined) and rows[-1].end == len(joined) if rows else True
        assert all(r.end == sum(len(x.span) for x in rows[: i + 1]) for i, r in enumerate(rows))
    return fmt, rows


def test_jsonl_lines_blank_lines_and_bad_rows(tmp_path):
    data = b'{"prompt": "a", "id": 1}\n\n  \n"just a string"\n{"prompt": "b"\n[1, 2]\n\xff\xfe\n{"prompt": "c"}'
    fmt, rows = _rows(tmp_path, "in.jsonl", data)
    assert fmt == "jsonl"
    assert [(r.index, r.line) for r in rows] == [(0, 1), (1, 4), (2, 5), (3, 6), (4, 7), (5, 8)]
    assert rows[0].fields == {"prompt": "a", "id": 1} and rows[1].fields == {"prompt": "just a string"}
    assert rows[2].fields is None and rows[2].error.startswith("not valid JSON")
    assert rows[3].error == "expected a JSON object (or a string prompt), got a JSON list"
    assert rows[4].error.startswith("not valid UTF-8")
    assert rows[5].fields == {"prompt": "c"} and rows[5].error is None
    _, rows = _rows(tmp_path, "big.jsonl", b'{"n": 1' + b"9" * 5000 + b'}\n{"prompt": "d"}\n')  # past Python's int limit
    assert "not valid JSON" in rows[0].error and "4300" in rows[0].error and rows[1].fields == {"prompt": "d"}


def test_text_lines(tmp_path):
    fmt, rows = _rows(tmp_path, "in.txt", "\ufeffOnce\r\n\nsecond, with \"quotes\"\nno newline".encode())
    assert fmt == "text"
    assert [r.fields["prompt"] for r in rows] == ["Once", "", 'second, with "quotes"', "no newline"]
    assert [r.line for r in rows] == [1, 2, 3, 4]


def test_csv_is_parsed_as_csv_not_lines(tmp_path):
    data = b'id,prompt\n1,"hello, world"\n\n2,"two\nlines ""quoted"""\n3,too,many\n4,last\n'
    fmt, rows = _rows(tmp_path, "in.csv", data, required="prompt")
    assert fmt == "csv"
    assert [r.fields for r in rows] == [{"id": "1", "prompt": "hello, world"}, {"id": "2", "prompt": 'two\nlines "quoted"'}, None, {"id": "4", "prompt": "last"}]
    assert [r.line for r in rows] == [2, 4, 6, 7]
    assert rows[2].error == "has 3 fields, the header has 2"
    with pytest.raises(CLIError, match=r"no column 'text' \(columns: id, prompt\); use --prompt-column"):
        _rows(tmp_path, "in.csv", data, required="text")
    _, rows = _rows(tmp_path, "in.tsv", b"prompt\tn\nsay, hi\t1\n")
    assert rows[0].fields == {"prompt": "say, hi", "n": "1"}
    _, rows = _rows(tmp_path, "bad.csv", b'prompt\n"unterminated\n')
    assert rows[0].error.startswith("not valid CSV")


def test_json_array_elements(tmp_path):
    data = b'[\n {"prompt": "a, [b]", "x": {"y": [1, "]"]}},\n "plain \\" string",\n {"prompt": tru},\n 7\n]\n'
    fmt, rows = _rows(tmp_path, "in.json", data)
    assert fmt == "json"
    assert rows[0].fields == {"prompt": "a, [b]", "x": {"y": [1, "]"]}} and rows[1].fields == {"prompt": 'plain " string'}
    assert rows[2].error.startswith("not valid JSON") and rows[3].error.endswith("got a JSON int")
    assert [r.line for r in rows] == [2, 3, 4, 5]
    for bad, message in [(b'{"a": 1}', "not a JSON array"), (b'[{"a": 1} {"b": 2}]', "expected ',' or ']'"),
                         (b'[{"a": 1},]', "expected an array element after ','"), (b'[{"a": 1}', "not closed"),
                         (b'[{"a": "x]', "ends inside an array element"), (b'[1] 2', "text after the end")]:
        with pytest.raises(CLIError, match=message):
            list(readers.read_rows(str(_write(tmp_path, bad)), "json", prompt_field="prompt", required_column=None))


def _write(tmp_path, data):
    path = tmp_path / "x.json"
    path.write_bytes(data)
    return path


def test_json_array_small_chunks_match_one_chunk():
    """Element boundaries found across buffer refills (chunks of 1..7 bytes) equal one big read."""
    data = json.dumps([{"prompt": "p" * i + '",]\\', "k": [i, {"z": "}"}]} for i in range(30)] + ["s", 1.5, None], indent=1).encode()
    # Non-ASCII text raw and escaped, invalid UTF-8 in a string, a bad element, a number past Python's
    # int limit: whole elements in the buffer take the C decoder's fast path, split ones the scanner's.
    data = data[:-2] + b",\n" + b", ".join([
        '{"prompt": "café 日本", "e": "\\u00e9"}'.encode(), b'{"prompt": "\xff\xfe"}', '{"prompt": "é 日本 [\\"]"}'.encode(),
        b"[1, tru]", b'{"n": 1' + b"9" * 5000 + b"}", b'{"ok": 1}']) + b"\n]"
    whole = list(iter_json_array(io.BytesIO(data), "x"))
    for chunk in (1, 2, 3, 7):
        assert list(iter_json_array(io.BytesIO(data), "x", chunk_size=chunk)) == whole
    values = [v for _, _, _, v, _ in whole]
    assert values[30:33] == ["s", 1.5, None] and values[33] == {"prompt": "café 日本", "e": "é"}
    assert whole[34][4] == "not valid JSON (invalid start byte)" and values[35] == {"prompt": "é 日本 [\"]"}
    assert whole[36][4] == "not valid JSON (Expecting value)" and "4300" in whole[37][4] and values[38] == {"ok": 1}


def test_json_array_line_numbers_cost_one_pass():
    """Numbering elements counts newlines from the previous element, not from the buffer's start:
    with 1 MiB reads, 100k small elements took 15x as long as with 8 KiB reads before (21 s vs 1.5 s)."""
    data = b"[" + b"1,\n" * 100_000 + b"1]"

    def seconds(chunk_size):
        start = time.perf_counter()
        lines = [line for line, *_ in iter_json_array(io.BytesIO(data), "x", chunk_size=chunk_size, parse=False)]
        assert lines[-1] == 100_001 and len(lines) == 100_001
        return time.perf_counter() - start

    # the best of three each, interleaved: a busy machine slows single runs, not the best of three
    small, big = (min(t) for t in zip(*((seconds(8 << 10), seconds(1 << 20)) for _ in range(3))))
    assert big < 3 * small + 0.2, f"{big:.2f} s with 1 MiB reads vs {small:.2f} s with 8 KiB reads"


def test_openai_batch_detected(tmp_path):
    line = {"custom_id": "r1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi"}}
    fmt, rows = _rows(tmp_path, "batch.jsonl", (json.dumps(line) + "\n").encode())
    assert fmt == "openai" and rows[0].fields == line


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"prompt": [f"p{i}" for i in range(2500)], "n": list(range(2500))})
    pq.write_table(table, tmp_path / "in.parquet", row_group_size=1000)
    fmt, rows = _rows(tmp_path, "in.parquet", (tmp_path / "in.parquet").read_bytes(), required="prompt")
    assert fmt == "parquet" and len(rows) == 2500 and rows[2499].fields == {"prompt": "p2499", "n": 2499}
    assert rows[7].line == 8
    with pytest.raises(CLIError, match="no column 'text'"):
        _rows(tmp_path, "in.parquet", (tmp_path / "in.parquet").read_bytes(), required="text")


def test_parquet_without_pyarrow_names_the_package(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_pyarrow(name, *args, **kwargs):
        if name.startswith("pyarrow"):
            raise ImportError("No module named 'pyarrow'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    (tmp_path / "in.parquet").write_bytes(b"PAR1")
    with pytest.raises(CLIError, match="needs the pyarrow package: pip install pyarrow"):
        list(readers.read_rows(str(tmp_path / "in.parquet"), "parquet", prompt_field="prompt", required_column=None))


def test_rows_stream_lazily(tmp_path):
    """The reader yields the first row of a big file without reading the rest."""
    path = tmp_path / "big.jsonl"
    with open(path, "wb") as f:
        for i in range(200_000):
            f.write(b'{"prompt": "row %d"}\n' % i)
    rows = readers.read_rows(str(path), "jsonl", prompt_field="prompt", required_column=None)
    first = next(rows)
    assert first.fields == {"prompt": "row 0"}
    rows.close()


@pytest.mark.parametrize("name, data", [
    ("a.jsonl", b'{"a": 1}\n\n \n{"b": 2}\n{"c": 3}'),
    ("a.txt", b"x\n\ny\nz"),
    ("a.csv", b'p\n"multi\nline"\n\nb\n'),
    ("a.json", b'[{"a": "]"}, "s", 3]'),
])
def test_count_rows_matches_the_readers(tmp_path, name, data):
    from pagedgen.cli.progress import count_rows

    fmt, rows = _rows(tmp_path, name, data)
    assert count_rows(str(tmp_path / name), fmt) == len(rows)
