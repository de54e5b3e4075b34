"""The command line's structured outputs (issue 33): a JSONL whose rows carry their own JSON Schema
(``--schema-field``) beside a command-line constraint, killed with SIGKILL and resumed to the bytes
of an uninterrupted run; the OpenAI batch format's ``response_format``; bad constraint flags."""
import json
import re
import signal
import time

import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from cli_util import error_lines, popen_cli, read_jsonl, run_cli
from conftest import story_openings
from json_schemas import SCHEMAS

ROWS = 120
REGEX = r"(yes|no), [a-z]{2,8}\."
ARGS = ("--temperature", "0.8", "--seed", "5", "--max-tokens", 160, "--disable-any-whitespace", "--schema-field", "schema",
        "--regex", REGEX, "--flush-rows", 5, "--flush-seconds", 0.05, "--max-num-seqs", 16)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """(folder, input file): every third row has no schema (the --regex applies), the others one of
    the ten schemas, as an object or as JSON text."""
    folder = tmp_path_factory.mktemp("cli-structured")
    src = folder / "in.jsonl"
    prompts = story_openings(ROWS)
    rows = []
    for i in range(ROWS):
        row = {"prompt": prompts[i], "id": i}
        if i % 3:
            row["schema"] = SCHEMAS[i % 10] if i % 2 else json.dumps(SCHEMAS[i % 10])
        rows.append(row)
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder, src


def _check_rows(rows):
    assert [r["index"] for r in rows] == list(range(ROWS))
    for r in rows:
        c = r["completions"][0]
        assert c["finish_reason"] == "stop", r
        if "schema" in r:
            schema = r["schema"] if isinstance(r["schema"], dict) else json.loads(r["schema"])
            jsonschema.validate(json.loads(c["text"]), schema)
        else:
            assert re.fullmatch(REGEX, c["text"]), c["text"]


def test_schema_column_killed_and_resumed(dataset, stories_path, capsys, one_torch_thread):
    folder, src = dataset
    ref = folder / "reference.jsonl"
    rc, err = run_cli(capsys, "--model", stories_path, "--input", src, "--output", ref, *ARGS)
    assert rc == 0, err
    _check_rows(read_jsonl(ref))
    out = folder / "out.jsonl"
    proc = popen_cli("--model", stories_path, "--input", src, "--output", out, *ARGS)
    end = time.monotonic() + 120
    while proc.poll() is None and (not out.exists() or out.read_bytes().count(b"\n") < ROWS // 3) and time.monotonic() < end:
        time.sleep(0.01)
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=120)
    assert out.read_bytes().count(b"\n") < ROWS  # killed part-way
    rc, err = run_cli(capsys, "--model", stories_path, "--input", src, "--output", out, *ARGS)
    assert rc == 0, err
    assert out.read_bytes() == ref.read_bytes()


def test_openai_batch_response_format(stories_path, tmp_path, capsys, one_torch_thread):
    schema = SCHEMAS[3]
    lines = [
        {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "Pick"}], "max_tokens": 60,
                  "response_format": {"type": "json_schema", "json_schema": {"name": "pick", "schema": schema, "strict": True}}}},
        {"custom_id": "b", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "Once upon a time", "max_tokens": 60, "temperature": 0,
                  "response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}},
        {"custom_id": "c", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "Once upon a time", "max_tokens": 3, "response_format": {"type": "text"}}},
        {"custom_id": "d", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "Once", "max_tokens": 3, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}}},
        {"custom_id": "e", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "Once", "max_tokens": 3, "response_format": {"type": "json_object"}}},
    ]
    src, out = tmp_path / "batch.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    rc, err = run_cli(capsys, "--model", stories_path, "--input", src, "--output", out, "--on-error", "skip", "--chat-template", template,
                      "--disable-any-whitespace")
    assert rc == 0, err
    rows = {r["custom_id"]: r["response"]["body"] for r in read_jsonl(out)}
    jsonschema.validate(json.loads(rows["a"]["choices"][0]["message"]["content"]), schema)
    jsonschema.validate(json.loads(rows["b"]["choices"][0]["text"]), schema)
    assert rows["c"]["choices"][0]["finish_reason"] == "length" and rows["e"]["choices"][0]["text"].startswith("{")
    (error,) = read_jsonl(tmp_path / "out.errors.jsonl")
    assert error["custom_id"] == "d" and "invalid json: Invalid type: nope" in error["response"]["body"]["error"]["message"]


def test_constraint_flags(stories_path, tmp_path, capsys, one_torch_thread):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "Once upon a time"}) + "\n")
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMAS[7]))
    base = ("--model", stories_path, "--input", src)
    rc, err = run_cli(capsys, *base, "--output", tmp_path / "a.jsonl", "--json-schema", schema_file, "--disable-any-whitespace", "--max-tokens", 40)
    assert rc == 0, err
    jsonschema.validate(json.loads(read_jsonl(tmp_path / "a.jsonl")[0]["completions"][0]["text"]), SCHEMAS[7])
    rc, err = run_cli(capsys, *base, "--output", tmp_path / "b.jsonl", "--choice", "red", "green", "--n", 3, "--temperature", 1, "--seed", 2)
    assert rc == 0, err
    assert {c["text"] for c in read_jsonl(tmp_path / "b.jsonl")[0]["completions"]} <= {"red", "green"}
    grammar_file = tmp_path / "grammar.gbnf"
    grammar_file.write_text('root ::= "The " animal "."\nanimal ::= "cat" | "dog"\n')
    rc, err = run_cli(capsys, *base, "--output", tmp_path / "g.jsonl", "--grammar", grammar_file)
    assert rc == 0, err
    assert read_jsonl(tmp_path / "g.jsonl")[0]["completions"][0]["text"] in ("The cat.", "The dog.")
    for flags, message in (
        (("--choice", "a", "--regex", "b"), "--regex and --choice: give one structured-output constraint"),
        (("--json-schema", '{"type": "foo"}'), "invalid json: Invalid type: foo"),
        (("--json-schema", str(tmp_path / "missing.json")), "no such file"),
        (("--regex", "[a-"), "invalid regex"),
        (("--choice", "a", "--ignore-eos"), "--ignore-eos cannot be combined with --choice"),
        (("--regex", "a+", "--min-tokens", 3), "--min-tokens cannot be combined with --regex"),
    ):
        rc, err = run_cli(capsys, *base, "--output", tmp_path / "c.jsonl", *flags)
        assert rc != 0 and len(error_lines(err)) == 1 and message in err, (flags, err)
        assert not (tmp_path / "c.jsonl").exists()


def test_a_schema_field_no_row_has_is_a_warning(stories_path, tmp_path, capsys, one_torch_thread):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": p, "schema": SCHEMAS[0]}) + "\n" for p in story_openings(3)))
    rc, err = run_cli(capsys, "--model", stories_path, "--input", src, "--output", tmp_path / "out.jsonl",
                      "--max-tokens", 4, "--schema-field", "shcema")
    assert rc == 0, err
    assert "pagedgen: warning: no row of this run had the field 'shcema' named by --schema-field" in err
    rc, err = run_cli(capsys, "--model", stories_path, "--input", src, "--output", tmp_path / "ok.jsonl",
                      "--max-tokens", 4, "--schema-field", "schema")
    assert rc == 0 and "warning" not in err, err


def test_a_row_that_fails_mid_generation_goes_to_the_errors_file_with_skip(stories_path, tmp_path, capsys, one_torch_thread):
    """Rows without a schema get a Lark grammar that passes llguidance's parser row limit at its
    second word (it compiles, then fails mid-generation): with --on-error skip they go to the
    errors file with llguidance's reason (``on_error="return"``) and the rows with a schema are
    written; with --on-error stop they end as vLLM ends them (finish_reason "stop", incomplete)."""
    src = tmp_path / "in.jsonl"
    rows = [{"prompt": p, **({"schema": SCHEMAS[0]} if i % 2 == 0 else {})} for i, p in enumerate(story_openings(4))]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    grammar = tmp_path / "g.lark"
    grammar.write_text("start: x x\nx: " + " | ".join(f'"w{i}" y' for i in range(2500)) + '\ny: "a" | "b"\n')
    base = ("--model", stories_path, "--input", src, "--schema-field", "schema", "--grammar", grammar, "--temperature", 1, "--seed", 1,
            "--max-tokens", 60, "--disable-any-whitespace")
    rc, err = run_cli(capsys, *base, "--output", tmp_path / "skip.jsonl", "--on-error", "skip")
    assert rc == 0, err
    assert [r["index"] for r in read_jsonl(tmp_path / "skip.jsonl")] == [0, 2]
    errors = read_jsonl(tmp_path / "skip.errors.jsonl")
    assert [e["index"] for e in errors] == [1, 3] and [e["line"] for e in errors] == [2, 4]
    for e in errors:
        assert re.fullmatch(rf"row {e['index']}: llguidance failed on its grammar constraint \(.*max is 2000.*\) after \d+ generated tokens",
                            e["error"]), e
        assert e["row"] == rows[e["index"]]
    rc, err = run_cli(capsys, *base, "--output", tmp_path / "stop.jsonl")
    assert rc == 0, err
    written = read_jsonl(tmp_path / "stop.jsonl")
    assert [r["index"] for r in written] == [0, 1, 2, 3] and not (tmp_path / "stop.errors.jsonl").exists()
    assert all(written[i]["completions"][0]["finish_reason"] == "stop" for i in (1, 3))
