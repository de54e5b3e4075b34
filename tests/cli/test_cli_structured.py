"""The command line's structured outputs (issue 33): a JSONL whose rows carry their own JSON Schema
(``--schema-field``) beside a command-line constraint, killed with SIGKILL and resumed to the bytes
of an uninterrupted run; the OpenAI batch format's ``response_format``; bad constraint flags;
``--close-at-max-tokens`` / ``--no-close-at-max-tokens`` (issue 51) reaching every structured
request and binding a resumed run."""
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


def _spy_structured_outputs(monkeypatch) -> dict:
    """{row index: the StructuredOutputsParams (or None) of the SamplingParams the engine got}, per run."""
    from pagedgen.engine.llm_engine import LLMEngine

    seen = {}
    add_request = LLMEngine.add_request

    def spy(self, request_id, prompt, sampling_params=None, **kwargs):
        seen[int(request_id)] = sampling_params.structured_outputs
        return add_request(self, request_id, prompt, sampling_params, **kwargs)

    monkeypatch.setattr(LLMEngine, "add_request", spy)
    return seen


def test_close_at_max_tokens_flag_reaches_every_structured_request(stories_path, tmp_path, capsys, monkeypatch, one_torch_thread):
    """``--close-at-max-tokens`` (default) / ``--no-close-at-max-tokens`` set
    ``StructuredOutputsParams.close_at_max_tokens`` of the command line's constraint, of a row's
    own ``--schema-field`` schema and of an OpenAI body's ``response_format``; unconstrained
    requests stay unconstrained; ``--help`` lists both spellings."""
    from pagedgen.cli.args import build_parser

    assert "--close-at-max-tokens, --no-close-at-max-tokens" in build_parser().format_help()
    seen = _spy_structured_outputs(monkeypatch)
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "Once upon a time", "schema": SCHEMAS[0]}) + "\n" + json.dumps({"prompt": "Lily saw"}) + "\n")
    batch = tmp_path / "batch.jsonl"
    bodies = [{"type": "json_schema", "json_schema": {"schema": SCHEMAS[3]}}, {"type": "json_object"}, {"type": "text"}, None]
    batch.write_text("".join(json.dumps({"custom_id": str(i), "method": "POST", "url": "/v1/completions",
                                         "body": {"prompt": "Once", "max_tokens": 8, **({"response_format": rf} if rf else {})}}) + "\n"
                             for i, rf in enumerate(bodies)))
    regex = ("--regex", "(yes|no)")
    for flags, close in (((), True), (("--close-at-max-tokens",), True), (("--no-close-at-max-tokens",), False)):
        seen.clear()
        rc, err = run_cli(capsys, "--model", stories_path, "--input", src, "--output", tmp_path / f"rows{close}{len(flags)}.jsonl",
                          "--max-tokens", 8, "--schema-field", "schema", "--json-schema", json.dumps(SCHEMAS[7]), "--disable-any-whitespace", *flags)
        assert rc == 0, err
        assert seen[0].json == SCHEMAS[0] and seen[1].json == SCHEMAS[7], seen
        assert all(s.close_at_max_tokens is close and s.disable_any_whitespace for s in seen.values()), seen
        seen.clear()
        rc, err = run_cli(capsys, "--model", stories_path, "--input", batch, "--output", tmp_path / f"batch{close}{len(flags)}.jsonl", *flags)
        assert rc == 0, err
        assert seen[0].json == SCHEMAS[3] and seen[1].json_object and seen[2] is None and seen[3] is None, seen
        assert seen[0].close_at_max_tokens is close and seen[1].close_at_max_tokens is close
        seen.clear()  # the other kinds carry it too (only JSON is steered)
        rc, err = run_cli(capsys, "--model", stories_path, "--input", src, "--output", tmp_path / f"regex{close}{len(flags)}.jsonl",
                          "--max-tokens", 4, *regex, *flags)
        assert rc == 0, err
        assert [s.regex for s in seen.values()] == ["(yes|no)"] * 2 and all(s.close_at_max_tokens is close for s in seen.values())
    rc, err = run_cli(capsys, "--model", stories_path, "--input", src, "--output", tmp_path / "x.jsonl", "--close-at-max-tokens", "no")
    assert rc == 2 and "unrecognized arguments: no" in err, err


def test_close_at_max_tokens_binds_a_resumed_run(stories_path, tmp_path, capsys, one_torch_thread):
    """The sidecar records ``close_at_max_tokens`` when a request can be structured (a constraint,
    ``--schema-field``, OpenAI input): a rerun with the other value is refused naming it, the same
    value resumes; a sidecar of an older pagedgen, without the key, resumes at the default and
    refuses ``--no-close-at-max-tokens``; a run that builds no structured request does not record it."""
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": p, **({"schema": SCHEMAS[0]} if i % 2 else {})}) + "\n"
                           for i, p in enumerate(story_openings(3))))
    for structured, recorded in ((("--schema-field", "schema"), True), (("--json-schema", json.dumps(SCHEMAS[7])), True), ((), False)):
        out = tmp_path / f"out{len(structured) and structured[0]}.jsonl"
        base = ("--model", stories_path, "--input", src, "--output", out, "--max-tokens", 6, *structured)
        rc, err = run_cli(capsys, *base)
        assert rc == 0, err
        written = out.read_bytes()
        car = tmp_path / out.name.replace(".jsonl", ".pagedgen.json")
        params = json.loads(car.read_text())["params"]
        assert params.get("close_at_max_tokens") is (True if recorded else None), params
        rc, err = run_cli(capsys, *base, "--no-close-at-max-tokens")
        if not recorded:  # nothing structured: the flag shapes no row
            assert rc == 0, err
            continue
        assert rc == 2 and "parameters differ" in err and "close_at_max_tokens: True -> False" in err, err
        assert len(error_lines(err)) == 1 and out.read_bytes() == written
        rc, err = run_cli(capsys, *base, "--close-at-max-tokens")
        assert rc == 0, err
        assert out.read_bytes() == written
        # an older sidecar: no top-level key, none in the recorded structured_outputs
        data = json.loads(car.read_text())
        del data["params"]["close_at_max_tokens"]
        if data["params"].get("structured_outputs"):
            del data["params"]["structured_outputs"]["close_at_max_tokens"]
        car.write_text(json.dumps(data))
        rc, err = run_cli(capsys, *base)
        assert rc == 0, err
        rc, err = run_cli(capsys, *base, "--no-close-at-max-tokens")
        assert rc == 2 and "close_at_max_tokens: None -> False" in err, err
    out = tmp_path / "off.jsonl"  # started with it off: a rerun at the default is refused
    base = ("--model", stories_path, "--input", src, "--output", out, "--max-tokens", 6, "--schema-field", "schema")
    rc, err = run_cli(capsys, *base, "--no-close-at-max-tokens")
    assert rc == 0, err
    rc, err = run_cli(capsys, *base)
    assert rc == 2 and "close_at_max_tokens: False -> True" in err, err
