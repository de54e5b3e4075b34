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


def _files(folder) -> list[str]:
    """The files in ``folder`` but lock files (taken before the checks, never deleted, they block nothing)."""
    return sorted(name for name in os.listdir(folder) if not name.endswith(".pagedgen.lock"))


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
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (tmp_path / "o3.pagedgen.json.tmp").symlink_to(victim)  # the sidecar's temporary file
    cases = [(link, "is a symbolic link"), (fifo, "is not a regular file"), (tmp_path / "o2.jsonl", "o2.errors.jsonl"),
             (tmp_path / "o3.jsonl", "o3.pagedgen.json.tmp' is a symbolic link"), ("-", "writing to stdout is not supported")]
    monkeypatch.chdir(tmp_path)
    for out, why in cases:
        for extra in ((), ("--overwrite",)):
            rc, err = run_cli(capsys, *_base(stories_path, src, out, *extra))
            assert rc == 2 and len(error_lines(err)) == 1 and why in err, err
            assert "loading" not in err and "rows:" not in err
    assert link.is_symlink() and os.readlink(link) == str(target) and target.read_text() == ""
    assert fifo.is_fifo() and errors_fifo.is_fifo() and not (tmp_path / "-").exists() and victim.read_text() == "keep me"
    assert not (tmp_path / "o2.jsonl").exists() and not (tmp_path / "link.pagedgen.json").exists()
    # an empty regular output without a sidecar is written in place (the same file, not removed)
    dst = tmp_path / "empty.jsonl"
    dst.write_text("")
    inode = dst.stat().st_ino
    rc, err = run_cli(capsys, *_base(stories_path, src, dst))
    assert rc == 0, err
    assert dst.stat().st_ino == inode and [r["index"] for r in read_jsonl(dst)] == [0]


def test_lone_surrogates_are_bad_rows(stories_path, tmp_path, capsys):
    src = _input(tmp_path, {"prompt": "Once upon"}, r'{"prompt": "hi", "x": "\ud800"}', r'{"prompt": "hi \udc80 there"}',
                 r'{"prompt": "a pair \ud83d\ude00 is fine"}', {"prompt": "The cat"})
    dst = tmp_path / "out.jsonl"
    rc, err = run_cli(capsys, *_base(stories_path, src, dst))
    assert rc == 2 and "internal error" not in err
    assert error_lines(err) == [f"pagedgen: error: {src}: line 2: field 'x' holds a lone UTF-16 surrogate ('\\ud800', an "
                                "unpaired \\ud800-\\udfff escape), which is not text and cannot be written as UTF-8 (stopped "
                                f"there: 1 row is in {str(dst)!r}; fix the row and rerun the same command to resume, or "
                                "pass --on-error skip)"]
    rc, err = run_cli(capsys, *_base(stories_path, src, dst, "--on-error", "skip", "--overwrite"))
    assert rc == 0 and "internal error" not in err, err
    assert [r["index"] for r in read_jsonl(dst)] == [0, 3, 4]
    errors = read_jsonl(tmp_path / "out.errors.jsonl")
    assert [(r["index"], r["line"]) for r in errors] == [(1, 2), (2, 3)]
    assert "field 'prompt' holds a lone UTF-16 surrogate ('\\udc80'" in errors[1]["error"]
    assert errors[1]["row"] == r'{"prompt": "hi \udc80 there"}'  # the line's own text
    arr = tmp_path / "in.json"  # a JSON array too
    arr.write_text(r'[{"prompt": "Once"}, {"prompt": "\udfff"}]')
    rc, err = run_cli(capsys, *_base(stories_path, arr, tmp_path / "arr.jsonl", "--on-error", "skip"))
    assert rc == 0 and "1 bad" in err, err


def test_a_row_the_tokenizer_refuses_fails_alone(llm):
    """One text the tokenizer cannot take fails its own row only; the batch's other rows are
    tokenized as in one call."""
    from pagedgen import SamplingParams
    from pagedgen.cli.prompts import PromptSpec, Request, RequestBuilder
    from pagedgen.cli.readers import Row

    builder = RequestBuilder(llm.tokenizer, PromptSpec(mode="prompt"), SamplingParams(max_tokens=2), 512)
    rows = [Row(i, i + 1, {"prompt": p}) for i, p in enumerate(["Once upon", "hi \udc80 there", "The cat"])]
    built = builder.build_many(rows)
    assert [r.index for r, _ in built] == [0, 1, 2]
    assert isinstance(built[1][1], str) and "the tokenizer cannot tokenize the prompt" in built[1][1]
    for k in (0, 2):
        assert isinstance(built[k][1], Request)
        assert built[k][1].prompt["prompt_token_ids"] == llm.tokenizer(rows[k].fields["prompt"])["input_ids"]


@pytest.mark.parametrize("flag, value, message", [
    ("--logprobs", 100000, "--logprobs must be in [0, 512] (the vocabulary size), got 100000"),
    ("--prompt-logprobs", 600, "--prompt-logprobs must be in [0, 512] (the vocabulary size), got 600"),
    ("--allowed-token-ids", 999999, "--allowed-token-ids has token id 999999 outside the vocabulary [0, 512)"),
    ("--stop-token-ids", 99999, "--stop-token-ids has token id 99999 outside the vocabulary [0, 512)"),
    ("--logit-bias", '{"99999": 1}', "--logit-bias has token id 99999 outside the vocabulary [0, 512)"),
])
def test_flag_values_that_do_not_fit_the_vocabulary(flag, value, message, stories_path, tmp_path, capsys):
    src = _input(tmp_path, {"prompt": "a"}, {"prompt": "b"})
    dst = tmp_path / "out.jsonl"
    for extra in ((), ("--on-error", "skip")):
        rc, err = run_cli(capsys, *_base(stories_path, src, dst, flag, value, *extra))
        assert rc == 2 and error_lines(err) == [f"pagedgen: error: {message} (a command-line value that does not fit "
                                                f"the model {str(stories_path)!r})"], err
        assert _files(tmp_path) == ["in.jsonl"]  # no output, sidecar or errors file


@pytest.mark.parametrize("extra, message", [
    (("--output-field", "index"), "--index-field and --output-field name the same field 'index'"),
    (("--index-field", "row", "--output-field", "row"), "--index-field and --output-field name the same field 'row'"),
    (("--output-field", "prompt"), "--output-field and --prompt-field name the same field 'prompt'"),
    (("--messages-field", "chat", "--index-field", "chat"), "--index-field and --messages-field name the same field 'chat'"),
    (("--prompt-logprobs", 1, "--output-field", "prompt_logprobs"),
     "--output-field and --prompt-logprobs name the same field 'prompt_logprobs'"),
    (("--prompt-field", ""), "--prompt-field must be a non-empty field name, got ''"),
    (("--output-field", " "), "--output-field must be a non-empty field name, got ' '"),
    (("--index-field", ""), "--index-field must be a non-empty field name, got ''"),
    (("--messages-field", ""), "--messages-field must be a non-empty field name, got ''"),
])
def test_field_names_are_checked_at_parsing(extra, message, tmp_path, capsys):
    src = _input(tmp_path, {"prompt": "a"})
    rc, err = run_cli(capsys, "--model", tmp_path / "no-model", "--input", src, "--output", tmp_path / "out.jsonl", *extra)
    assert rc == 2 and len(error_lines(err)) == 1 and message in error_lines(err)[0], err
    assert _files(tmp_path) == ["in.jsonl"]


def test_a_missing_column_is_refused_before_the_model_loads(stories_path, tmp_path, capsys):
    src, dst = tmp_path / "p.csv", tmp_path / "out.jsonl"
    src.write_text("id,text\n1,Once upon\n2,The cat\n")
    rc, err = run_cli(capsys, *_base(stories_path, src, dst, "--prompt-column", "txt"))
    assert rc == 2 and error_lines(err) == [f"pagedgen: error: {src}: no column 'txt' (columns: id, text); use --prompt-column"]
    assert "rows:" not in err and _files(tmp_path) == ["p.csv"]  # no summary, output or sidecar
    rc, err = run_cli(capsys, *_base(stories_path, src, dst, "--prompt-column", "text"))  # the corrected command runs
    assert rc == 0, err
    assert [r["text"] for r in read_jsonl(dst)] == ["Once upon", "The cat"]
    blank = tmp_path / "blank.csv"
    blank.write_text("\n\n\n")
    rc, err = run_cli(capsys, *_base(stories_path, blank, tmp_path / "b.jsonl"))
    assert rc == 2 and f"{blank}: empty file (only blank lines): no header line" in err and not (tmp_path / "b.jsonl").exists()
    twice = tmp_path / "twice.csv"  # a repeated column name would drop one value of every row
    twice.write_text("id,prompt,prompt\n1,Once,upon\n")
    rc, err = run_cli(capsys, *_base(stories_path, twice, tmp_path / "t.jsonl"))
    assert rc == 2 and f"{twice}: the header names column 'prompt' more than once (columns: id, prompt, prompt)" in err
    assert not (tmp_path / "t.jsonl").exists()
    late = tmp_path / "late.csv"  # blank lines before the header are skipped (line numbers stay the file's)
    late.write_text("\nprompt\nOnce\n")
    rc, err = run_cli(capsys, *_base(stories_path, late, tmp_path / "late.jsonl"))
    assert rc == 0 and read_jsonl(tmp_path / "late.jsonl")[0]["prompt"] == "Once", err


def test_a_missing_parquet_column_is_refused_before_the_model_loads(stories_path, tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    src = tmp_path / "p.parquet"
    pq.write_table(pa.table({"id": [1], "text": ["Once"]}), src)
    rc, err = run_cli(capsys, *_base(stories_path, src, tmp_path / "out.jsonl", "--prompt-column", "txt"))
    assert rc == 2 and error_lines(err) == [f"pagedgen: error: {src}: no column 'txt' (columns: id, text); use --prompt-column"]
    assert _files(tmp_path) == ["p.parquet"]


def test_a_missing_column_on_stdin_is_refused_before_any_output(stories_path, tmp_path, capsys, monkeypatch):
    import io

    data = b"id,text\n1,Once upon\n"
    dst = tmp_path / "out.jsonl"
    for column, rc_want in (("txt", 2), ("text", 0)):
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BufferedReader(io.BytesIO(data))))
        rc, err = run_cli(capsys, *_base(stories_path, "-", dst, "--input-format", "csv", "--prompt-column", column))
        assert rc == rc_want, err
        if rc_want == 2:
            assert error_lines(err) == ["pagedgen: error: <stdin>: no column 'txt' (columns: id, text); use --prompt-column"]
            assert not _files(tmp_path)
    assert [r["text"] for r in read_jsonl(dst)] == ["Once upon"]


def test_row_messages_name_the_row_and_the_element(stories_path, tmp_path, capsys):
    src = _input(tmp_path, {"prompt": "Once"}, {"prompt": [1, True, 3]}, {"prompt": [1, -5]}, {"prompt": [1, "x"]})
    rc, err = run_cli(capsys, *_base(stories_path, src, tmp_path / "out.jsonl", "--on-error", "skip"))
    assert rc == 0, err
    errors = [r["error"] for r in read_jsonl(tmp_path / "out.errors.jsonl")]
    assert errors == ["prompt[1] must be an int token id, got bool True",
                      "row 2's prompt has token id -5 outside the vocabulary [0, 512)",
                      'prompt[1] must be an int token id, got str \'x\'']


@pytest.mark.parametrize("typo, closest", [("--max-token", "--max-tokens"), ("--temperatur", "--temperature"),
                                           ("--max-num-seq", "--max-num-seqs"), ("--engine-see", "--engine-seed")])
def test_a_flag_is_never_abbreviated_and_a_typo_names_the_closest_flag(typo, closest, stories_path, tmp_path, capsys):
    """argparse would take a prefix of one flag as that flag (--max-token 10 as --max-tokens 10); here it
    is an error before any work, naming the flag meant, and nothing is written."""
    src = _input(tmp_path, {"prompt": "a"})
    rc, err = run_cli(capsys, "--model", stories_path, "--input", src, "--output", tmp_path / "o.jsonl", typo, "1")
    lines = error_lines(err)
    assert rc == 2 and len(lines) == 1, err
    assert f"unrecognized argument {typo} (did you mean {closest}?)" in lines[0]
    assert _files(tmp_path) == ["in.jsonl"]


def test_unknown_flag_without_a_close_one_and_stray_values(stories_path, tmp_path, capsys):
    src = _input(tmp_path, {"prompt": "a"})
    base = ["--model", stories_path, "--input", src, "--output", tmp_path / "o.jsonl"]
    rc, err = run_cli(capsys, *base, "--zzzzqqq", "3")
    assert rc == 2 and "unrecognized argument --zzzzqqq" in error_lines(err)[0] and "did you mean" not in err
    rc, err = run_cli(capsys, *base, "stray")
    assert rc == 2 and "unrecognized arguments: stray" in error_lines(err)[0]


def test_seed_minus_one_is_refused_naming_both_meanings(tmp_path, capsys):
    """``--seed -1`` reads as "random" on a command line, while vLLM's API reads -1 as no seed, and
    unseeded rows draw from the --engine-seed key: refused at parsing, before any file is touched."""
    rc, err = run_cli(capsys, "--model", "m", "--input", tmp_path / "in.jsonl", "--output", tmp_path / "o.jsonl", "--seed", "-1")
    assert rc == 2 and error_lines(err) == [
        "pagedgen: error: --seed -1 is ambiguous: leave --seed out (or --seed none) for unseeded rows, whose draws come from "
        "the --engine-seed key (not fresh randomness on each run: pass another --engine-seed for other draws), or give a "
        "seed >= 0 (see pagedgen --help)"], err
    assert os.listdir(tmp_path) == []


def test_an_output_that_is_another_runs_errors_file_is_refused(stories_path, tmp_path, capsys):
    """``x.errors.jsonl`` is the errors file of ``x.jsonl`` once that run's sidecar exists, and an
    output of its own once its own sidecar exists: neither run may write the other's file, even
    with --overwrite (rows of two runs mixed, or one run's output replaced)."""
    src = _input(tmp_path, {"prompt": "Once upon a time"}, {"text": "bad"})
    out, errors = tmp_path / "x.jsonl", tmp_path / "x.errors.jsonl"
    assert run_cli(capsys, *_base(stories_path, src, out, "--on-error", "skip"))[0] == 0
    kept = {p: p.read_bytes() for p in (out, errors)}
    for extra in ((), ("--overwrite",)):
        rc, err = run_cli(capsys, *_base(stories_path, src, errors, *extra))
        assert rc == 2 and error_lines(err) == [
            f"pagedgen: error: --output {str(errors)!r} is the errors file of --output {str(out)!r} (its sidecar "
            f"{str(tmp_path / 'x.pagedgen.json')!r} exists): choose another output name (another run's files are never "
            "written to)"], err
    assert {p: p.read_bytes() for p in kept} == kept and not (tmp_path / "x.errors.pagedgen.json").exists()
    # the other way round: y.errors.jsonl written first as an output, then y.jsonl's run would append its bad rows to it
    other, other_errors = tmp_path / "y.jsonl", tmp_path / "y.errors.jsonl"
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"prompt": "Once upon a time"}) + "\n")
    assert run_cli(capsys, *_base(stories_path, good, other_errors))[0] == 0
    written = other_errors.read_bytes()
    for extra in ((), ("--overwrite",)):
        rc, err = run_cli(capsys, *_base(stories_path, src, other, "--on-error", "skip", *extra))
        assert rc == 2 and f"its errors file {str(other_errors)!r} is the output of another run" in err, err
    assert other_errors.read_bytes() == written and not other.exists()
