"""Every input format round-trips through the CLI (in-process): rows in input order, their own fields
kept, plus ``index`` and greedy completions equal to ``LLM.generate``'s; the OpenAI batch format for
completions and chat; chat rows rendered with a chat template given on the command line."""
import csv
import io
import json

import pytest

from cli_util import read_jsonl, run_cli
from conftest import story_openings
from pagedgen import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")
MAX_TOKENS = 6
PROMPTS = story_openings(10) + ['He said, "hi, there"\tand left', ""]
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"


@pytest.fixture(scope="module")
def expected(llm):
    return [o.outputs[0] for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)]


def _base(stories_path, src, dst, *extra):
    return ("--model", stories_path, "--input", src, "--output", dst, "--temperature", "0", "--max-tokens", MAX_TOKENS, *extra)


def _write(fmt: str, path):
    rows = [{"id": str(i), "prompt": p} for i, p in enumerate(PROMPTS)]
    if fmt in ("jsonl", "stdin"):
        rows = [{"prompt": p, "id": i, "meta": {"k": [i, None]}} for i, p in enumerate(PROMPTS)]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "text":
        rows = [{"prompt": p} for p in PROMPTS]
        path.write_text("".join(p + "\n" for p in PROMPTS))
    elif fmt in ("csv", "tsv"):
        buf = io.StringIO()
        writer = csv.DictWriter(buf, ["id", "prompt"], delimiter="," if fmt == "csv" else "\t")
        writer.writeheader()
        writer.writerows(rows)
        path.write_text(buf.getvalue())
    elif fmt == "json":
        rows = [{"prompt": p, "n": i} for i, p in enumerate(PROMPTS)]
        path.write_text(json.dumps(rows, indent=2))
    elif fmt == "parquet":
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq

        rows = [{"prompt": p, "id": i} for i, p in enumerate(PROMPTS)]
        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=4)
    return rows


@pytest.mark.parametrize("fmt, suffix", [("jsonl", ".jsonl"), ("text", ".txt"), ("csv", ".csv"), ("tsv", ".tsv"),
                                         ("json", ".json"), ("parquet", ".parquet"), ("stdin", ".jsonl")])
def test_format_round_trip(fmt, suffix, stories_path, tmp_path, capsys, monkeypatch, expected):
    src, dst = tmp_path / f"in{suffix}", tmp_path / "out.jsonl"
    rows = _write(fmt, src)
    if fmt == "stdin":
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BufferedReader(io.BytesIO(src.read_bytes()))))
        src = "-"
    rc, err = run_cli(capsys, *_base(stories_path, src, dst))
    assert rc == 0, err
    out = read_jsonl(dst)
    assert [r["index"] for r in out] == list(range(len(PROMPTS)))
    for r, row, e in zip(out, rows, expected):
        assert {k: v for k, v in r.items() if k not in ("index", "completions")} == row
        (c,) = r["completions"]
        assert (c["token_ids"], c["text"], c["finish_reason"]) == (e.token_ids, e.text, e.finish_reason)
    assert f"{len(PROMPTS)} rows: {len(PROMPTS)} generated" in err


def test_messages_field_with_chat_template_file(stories_path, tmp_path, capsys, llm):
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS[:4]]
    conversations[1] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": PROMPTS[1]}]}]
    src, dst, tmpl = tmp_path / "chat.jsonl", tmp_path / "out.jsonl", tmp_path / "tmpl.jinja"
    src.write_text("".join(json.dumps({"conversation": c, "n": i}) + "\n" for i, c in enumerate(conversations)))
    tmpl.write_text(TEMPLATE)
    rc, err = run_cli(capsys, *_base(stories_path, src, dst, "--messages-field", "conversation"))
    assert rc == 2 and "the tokenizer has no chat template: pass one with --chat-template FILE" in err
    rc, err = run_cli(capsys, *_base(stories_path, src, dst, "--messages-field", "conversation", "--chat-template", tmpl))
    assert rc == 0, err
    plain = [[{**m, "content": m["content"] if isinstance(m["content"], str) else m["content"][0]["text"]} for m in c] for c in conversations]
    expected = llm.chat(plain, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), chat_template=TEMPLATE, use_tqdm=False)
    out = read_jsonl(dst)
    assert [r["conversation"] for r in out] == conversations
    assert [r["completions"][0]["token_ids"] for r in out] == [e.outputs[0].token_ids for e in expected]
    try:  # a Parquet list-of-structs column holds conversations too
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        return
    pq.write_table(pa.Table.from_pylist([{"conversation": c, "n": i} for i, c in enumerate(plain)]), tmp_path / "chat.parquet")
    rc, err = run_cli(capsys, *_base(stories_path, tmp_path / "chat.parquet", tmp_path / "pq.jsonl", "--messages-field", "conversation",
                                     "--chat-template", tmp_path / "tmpl.jinja"))
    assert rc == 0, err
    assert [r["completions"][0]["token_ids"] for r in read_jsonl(tmp_path / "pq.jsonl")] == [e.outputs[0].token_ids for e in expected]


def test_openai_batch_completions_and_chat(stories_path, tmp_path, capsys, llm, expected):
    requests = [
        {"custom_id": "c0", "method": "POST", "url": "/v1/completions", "body": {"model": "tiny", "prompt": PROMPTS[0]}},
        {"custom_id": "c1", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": [PROMPTS[1]], "max_tokens": 3, "logprobs": 2, "n": 2, "temperature": 0}},
        {"custom_id": "h0", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": PROMPTS[2]}], "max_completion_tokens": 4, "logprobs": True, "top_logprobs": 2}},
    ]
    src, dst = tmp_path / "batch.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in requests))
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    rc, err = run_cli(capsys, *_base(stories_path, src, dst, "--chat-template", tmp_path / "t.jinja"))
    assert rc == 0, err
    out = read_jsonl(dst)
    assert [(r["id"], r["custom_id"], r["error"], r["response"]["status_code"]) for r in out] == [
        ("batch_req_0", "c0", None, 200), ("batch_req_1", "c1", None, 200), ("batch_req_2", "h0", None, 200)]
    body0, body1, body2 = (r["response"]["body"] for r in out)
    assert (body0["object"], body0["model"], body1["model"]) == ("text_completion", "tiny", "stories260K")
    assert body0["choices"][0]["text"] == expected[0].text and body0["choices"][0]["logprobs"] is None
    e0 = expected[0]
    assert body0["usage"]["completion_tokens"] == len(e0.token_ids) and body0["usage"]["total_tokens"] > len(e0.token_ids)
    greedy3 = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=3, logprobs=2), use_tqdm=False)[0].outputs[0]
    assert [c["text"] for c in body1["choices"]] == [greedy3.text] * 2 and [c["index"] for c in body1["choices"]] == [0, 1]
    lp = body1["choices"][0]["logprobs"]
    # within a tolerance: the CLI batches the three requests together (no batch invariance is promised)
    assert len(lp["tokens"]) == 3 and lp["token_logprobs"][0] == pytest.approx(greedy3.logprobs[0][greedy3.token_ids[0]].logprob, abs=1e-4)
    assert len(lp["top_logprobs"][0]) >= 2 and lp["text_offset"][0] == 0
    chat = llm.chat([{"role": "user", "content": PROMPTS[2]}], SamplingParams(temperature=0, max_tokens=4), chat_template=TEMPLATE, use_tqdm=False)
    assert body2["object"] == "chat.completion"
    assert body2["choices"][0]["message"] == {"role": "assistant", "content": chat[0].outputs[0].text}
    content = body2["choices"][0]["logprobs"]["content"]
    assert len(content) == len(chat[0].outputs[0].token_ids) and all(len(t["top_logprobs"]) == 2 for t in content)


def test_openai_batch_bad_requests(stories_path, tmp_path, capsys):
    good = {"custom_id": "ok", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Hi"}}
    lines = [json.dumps(good),
             json.dumps({**good, "custom_id": "e1", "url": "/v1/embeddings"}),
             json.dumps({**good, "custom_id": "e2", "body": {"prompt": "Hi", "stream": True}}),
             json.dumps({**good, "custom_id": "e3", "body": {"prompt": "Hi", "tools": []}}),
             '{"custom_id": "e4", "method": "POST", "url": "/v1/completions", "body": ',
             json.dumps({**good, "custom_id": "e5", "body": {"prompt": "Hi", "temperature": -2}})]
    src, dst = tmp_path / "batch.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    rc, err = run_cli(capsys, *_base(stories_path, src, dst, "--on-error", "skip"))
    assert rc == 0, err
    assert [r["custom_id"] for r in read_jsonl(dst)] == ["ok"]
    errors = read_jsonl(tmp_path / "out.errors.jsonl")
    assert [r["custom_id"] for r in errors] == ["e1", "e2", "e3", None, "e5"]
    assert all(r["response"]["status_code"] == 400 and r["id"] == f"batch_req_{i + 1}" for i, r in enumerate(errors))
    messages = [r["response"]["body"]["error"]["message"] for r in errors]
    assert messages[0].startswith("line 2: url '/v1/embeddings' is not supported")
    assert "stream=True is not supported" in messages[1] and "tools not supported" in messages[2]
    assert messages[3].startswith("line 5: not valid JSON") and "temperature must be in [0, inf)" in messages[4]
    assert "5 bad" in err


def _drop_tail(path, keep: int, torn: bytes = b"") -> None:
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:keep]) + torn)


@pytest.mark.parametrize("unordered", [False, True])
def test_resume_finishes_what_is_missing(unordered, stories_path, tmp_path, capsys):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write("jsonl", src)
    flags = ["--unordered"] if unordered else []
    rc, err = run_cli(capsys, *_base(stories_path, src, dst, *flags))
    assert rc == 0, err
    full = dst.read_bytes()
    torn = b'{"index": 5, "prompt": "cut sh'
    _drop_tail(dst, 5, torn=torn)
    rc, err = run_cli(capsys, *_base(stories_path, src, dst, *flags))
    assert rc == 0, err
    assert "5 skipped as already done" in err and f"cut {len(torn)} bytes of an unfinished last line" in err
    if unordered:
        assert sorted(dst.read_bytes().splitlines()) == sorted(full.splitlines())
    else:
        assert dst.read_bytes() == full
    rc, err = run_cli(capsys, *_base(stories_path, src, dst, *([] if unordered else ["--unordered"])))
    assert rc == 2 and "unordered: " in err  # the order is part of what the output was started with


def test_stdin_resume_checks_the_rows_as_they_stream(stories_path, tmp_path, capsys, monkeypatch):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write("jsonl", src)

    def stdin(data: bytes):
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BufferedReader(io.BytesIO(data))))

    stdin(src.read_bytes())
    assert run_cli(capsys, *_base(stories_path, "-", dst))[0] == 0
    full = dst.read_bytes()
    _drop_tail(dst, 4)
    lines = src.read_bytes().splitlines(keepends=True)
    stdin(b"".join(lines[:2]) + b'{"prompt": "another row"}\n' + b"".join(lines[3:]))
    rc, err = run_cli(capsys, *_base(stories_path, "-", dst))
    assert rc == 2 and "the input on stdin is not the one the output was started from" in err
    assert dst.read_bytes() == full[: len(b"".join(full.splitlines(keepends=True)[:4]))]
    stdin(src.read_bytes())
    rc, err = run_cli(capsys, *_base(stories_path, "-", dst))
    assert rc == 0 and "4 skipped as already done" in err and dst.read_bytes() == full


def test_field_names_logprobs_and_seeded_resume(stories_path, tmp_path, capsys, llm):
    """Rows with their own ``index``: refused by default, written with --index-field/--output-field;
    seeded sampling with n, logprobs and prompt logprobs equals LLM.generate's and resumes to the same rows."""
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"index": f"doc-{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS[:6])))
    rc, err = run_cli(capsys, *_base(stories_path, src, dst))
    assert rc == 2 and "line 1: the row has its own field 'index', which the output adds; choose another name with --index-field" in err
    flags = ["--overwrite", "--index-field", "row", "--output-field", "out", "--temperature", "1", "--seed", "5", "--n", "2",
             "--logprobs", "1", "--prompt-logprobs", "1"]
    rc, err = run_cli(capsys, *_base(stories_path, src, dst, *flags))
    assert rc == 0, err
    params = SamplingParams(temperature=1, seed=5, n=2, max_tokens=MAX_TOKENS, logprobs=1, prompt_logprobs=1)
    expected = llm.generate(PROMPTS[:6], params, use_tqdm=False)
    out = read_jsonl(dst)
    assert [(r["row"], r["index"]) for r in out] == [(i, f"doc-{i}") for i in range(6)]
    for r, e in zip(out, expected):
        assert [c["token_ids"] for c in r["out"]] == [c.token_ids for c in e.outputs]
        for c, ec in zip(r["out"], e.outputs):
            got = [{int(t): v["logprob"] for t, v in step.items()} for step in c["logprobs"]]
            assert got == [{t: pytest.approx(lp.logprob, abs=1e-4) for t, lp in step.items()} for step in ec.logprobs]
        assert r["prompt_logprobs"][0] is None and len(r["prompt_logprobs"]) == len(e.prompt_token_ids)
    _drop_tail(dst, 2)
    rc, err = run_cli(capsys, *_base(stories_path, src, dst, *flags[1:]))
    assert rc == 0 and "2 skipped as already done" in err, err
    assert [[c["token_ids"] for c in r["out"]] for r in read_jsonl(dst)] == [[c["token_ids"] for c in r["out"]] for r in out]


@pytest.mark.parametrize("unordered", [False, True])
def test_rows_in_memory_are_bounded(unordered, stories_path, tmp_path, capsys, monkeypatch):
    """Flat memory: rows are pulled from the input only while fewer than --max-in-flight run and the
    reorder buffer has room (a few at a time: at most min(runner.READ_AHEAD, --max-in-flight)), so the
    rows held at once never depend on the input's length."""
    from pagedgen.cli import readers
    from pagedgen.cli.writer import RowWriter
    from pagedgen.engine.llm_engine import LLMEngine

    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [{"prompt": PROMPTS[i % len(PROMPTS)], "id": i} for i in range(40)]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    seen = {"unfinished": 0, "held": 0}
    writers = []
    real_add, real_read, real_init = LLMEngine.add_request, readers.read_rows, RowWriter.__init__

    def add_request(self, *args, **kwargs):
        seen["unfinished"] = max(seen["unfinished"], self.get_num_unfinished_requests() + 1)
        return real_add(self, *args, **kwargs)

    def read_rows(*args, **kwargs):
        for row in real_read(*args, **kwargs):
            # rows read but not yet written: running, or finished and waiting in the reorder buffer
            seen["held"] = max(seen["held"], row.index - writers[0].rows_written - writers[0].errors_written)
            yield row

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        writers.append(self)

    monkeypatch.setattr(LLMEngine, "add_request", add_request)
    monkeypatch.setattr(readers, "read_rows", read_rows)
    monkeypatch.setattr(RowWriter, "__init__", init)
    flags = ["--max-in-flight", 3, "--reorder-buffer", 2, "--flush-rows", 1] + (["--unordered"] if unordered else [])
    rc, err = run_cli(capsys, *_base(stories_path, src, dst, *flags))
    assert rc == 0, err
    out = read_jsonl(dst)
    assert sorted(r["index"] for r in out) == list(range(40)) and [r["id"] for r in sorted(out, key=lambda r: r["index"])] == list(range(40))
    assert seen["unfinished"] == 3  # the window fills, and never more
    # when a row is read: fewer than 3 in flight, plus (in input order) at most 2 finished rows waiting for an
    # earlier one, plus at most 2 rows read just before it in the same batch of 3
    assert 2 <= seen["held"] <= 2 + (0 if unordered else 2) + 2


def _strict(line: str):
    """json.loads that refuses the bare NaN / Infinity / -Infinity Python's json accepts."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(line, parse_constant=refuse)


def test_non_finite_numbers_are_written_as_strings(stories_path, tmp_path, capsys):
    # Python's json reads a bare NaN / Infinity in an input row; the output line stays strict JSON
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text('{"prompt": "Once upon a time", "score": NaN, "range": [-Infinity, 1.5, Infinity]}\n')
    rc, err = run_cli(capsys, *_base(stories_path, src, dst, "--logprobs", "2"))
    assert rc == 0, err
    row = _strict(dst.read_text())
    assert row["score"] == "NaN" and row["range"] == ["-Infinity", 1.5, "Infinity"]
    assert isinstance(row["completions"][0]["cumulative_logprob"], float)


def test_a_logprob_of_minus_infinity_is_the_string_minus_infinity():
    import numpy as np
    from pagedgen.cli import records
    line = records._dumps({"logprobs": [{"7": {"logprob": float("-inf"), "rank": 3}}], "cumulative_logprob": float("-inf"),
                           "x": (np.float32("nan"), 2.0), "ok": 0.5})
    assert _strict(line.decode()) == {"logprobs": [{"7": {"logprob": "-Infinity", "rank": 3}}],
                                      "cumulative_logprob": "-Infinity", "x": ["NaN", 2.0], "ok": 0.5}


def test_openai_batch_repeated_custom_id(stories_path, tmp_path, capsys, monkeypatch):
    # OpenAI's batch API rejects an input file that repeats a custom_id: a file is refused before any
    # work, naming both lines; on stdin (read once) the repeating request is a bad row
    good = {"method": "POST", "url": "/v1/completions", "body": {"prompt": "Hi"}}
    src, dst = tmp_path / "batch.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"custom_id": c, **good}) + "\n" for c in ("a", "b", "c", "b")))
    rc, err = run_cli(capsys, *_base(stories_path, src, dst))
    assert rc == 2 and f"pagedgen: error: {src}: line 4: custom_id 'b' repeats the one of line 2 (line 4)" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["batch.jsonl"]  # nothing written, nothing generated
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BufferedReader(io.BytesIO(src.read_bytes()))))
    rc, err = run_cli(capsys, *_base(stories_path, "-", dst, "--input-format", "openai", "--on-error", "skip"))
    assert rc == 0, err
    assert [r["custom_id"] for r in read_jsonl(dst)] == ["a", "b", "c"]
    (error,) = read_jsonl(tmp_path / "out.errors.jsonl")
    assert error["custom_id"] == "b" and "repeats the one of line 2 (line 4)" in error["response"]["body"]["error"]["message"]
