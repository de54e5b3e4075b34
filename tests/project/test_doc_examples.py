"""Every output README.md and docs/*.md show is produced by the code and compared here (issue 53), so
that no page can show a text the code no longer gives.

What counts as a shown output, and how each is checked:

- **A python block with shown values**: a line ``<expression>   # <Python string literal>`` shows
  what the expression gives, and an ``assert`` states what holds. Such a block is run as written,
  statement by statement, from the repository root, and each shown value is compared exactly.
  Blocks with neither are illustrations (they read files the reader has) and are not run.
- **A quoted error message** (``pagedgen: error: ...``, inline or on a line of its own; and the
  messages of the Python API that ``PY_MESSAGES`` lists): a scenario below makes the code print it,
  and the quote must equal one message printed. ``...`` in a quote stands for text left out (any
  text, with the spaces around it; the pid of another run for one); nothing else is masked. Every
  scenario's message must be quoted somewhere, so that none is left checking nothing.
- **An example output** (a ``json`` or ``text`` block) carries a marker comment,
  ``<!-- doc-output: NAME -->``, on the line before its block; the scenario NAME runs the command the
  page gives for it and the block must equal what it writes, except ``"created"`` of the OpenAI
  format (the time the output was started) and a summary's seconds and tokens/s. Such a block
  without a marker is refused, unless it is marked ``<!-- doc-input: NAME -->`` (the input a
  scenario reads from the page).

The texts depend on the model (stories260K, float32) and on the CPU kind's last bits only through
greedy ties and seeded draws near a boundary: the examples are greedy or seeded, written on the
AMD EPYC AVX2 kind, and give the same texts there with the PyTorch reference ops
(``PAGEDGEN_CPU_ISA=none``); on a failure the message gives the text this machine produced.
"""
import ast
import glob
import json
import os
import re
import textwrap

import pytest

from cli_util import error_lines, run_cli
from conftest import ROOT, STORIES

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
TEMPLATE = os.path.join(ROOT, "examples", "chat_template.jinja")


def _text(page: str) -> str:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


def _prose(page: str) -> str:
    """The page without its fenced blocks, whitespace collapsed (a quote may wrap across lines)."""
    return " ".join(re.sub(r"^\s*```.*?^\s*```", "", _text(page), flags=re.S | re.M).split())


def _blocks(page: str):
    """(language, first line number, dedented body, the line before the fence) of each fenced block."""
    lines = _text(page).splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^(\s*)```(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        body = textwrap.dedent("\n".join(lines[i + 1 : end])) + "\n"
        yield fence.group(2), i + 2, body, lines[i - 1].strip() if i else ""
        i = end + 1


def _split_shown(line: str):
    """(expression, shown value) for ``expr   # 'literal'``, else None."""
    for cut in [m.start() for m in re.finditer("#", line)]:
        code, comment = line[:cut].rstrip(), line[cut + 1 :].strip()
        if code and comment[:1] in "'\"":
            try:
                return code, ast.literal_eval(comment)
            except (ValueError, SyntaxError):
                continue
    return None


def _python_examples():
    for page in PAGES:
        for lang, line, body, _ in _blocks(page):
            stmts = ast.parse(body).body if lang == "python" else []
            lines = body.splitlines()
            if any(isinstance(s, ast.Assert) or (isinstance(s, ast.Expr) and _split_shown(lines[s.end_lineno - 1]))
                   for s in stmts):
                yield pytest.param(page, line, body, id=f"{page}:{line}")


@pytest.mark.parametrize("page,line,body", list(_python_examples()))
def test_python_examples_show_what_the_code_gives(page, line, body, stories_path, monkeypatch):
    if "StructuredOutputsParams" in body:
        pytest.importorskip("llguidance")
    monkeypatch.chdir(ROOT)  # the examples' paths are relative to the repository root
    lines = body.splitlines()
    scope: dict = {}
    for stmt in ast.parse(body).body:  # statement by statement; a shown value is a comment on its last line
        source = ast.get_source_segment(body, stmt)
        shown = _split_shown(lines[stmt.end_lineno - 1]) if isinstance(stmt, ast.Expr) else None
        if shown is None:
            exec(compile(source, f"{page}:{line}", "exec"), scope)
            continue
        got = eval(compile(source, f"{page}:{line}", "eval"), scope)
        assert got == shown[1], f"{page}:{line + stmt.lineno - 1} shows {shown[1]!r} for {source!r}; the code gives {got!r}"


def test_the_shown_python_outputs_are_found():
    """The collector above finds the pages' examples (a changed comment style would silently skip them)."""
    found = {p.values[0] for p in _python_examples()}
    assert {"README.md", "docs/structured_outputs.md", "docs/determinism.md"} <= found, found


# --- the command line's messages and outputs ------------------------------------------------------

def _quoted_errors() -> list[tuple[str, str]]:
    """(page, message) for every ``pagedgen: error: <text>`` a page quotes, whitespace collapsed."""
    found = []
    for page in PAGES:
        for lang, _, body, _ in _blocks(page):
            found += [(page, ln.strip()) for ln in body.splitlines() if ln.startswith("pagedgen: error: ")]
        found += [(page, quote) for quote in re.findall(r"`(pagedgen: error: [^`]+)`", _prose(page))]
    return found


def _matches(quote: str, message: str) -> bool:
    parts = quote.split("...")  # the spaces around an ellipsis are the page's layout, not the message's
    parts = [p.rstrip() if i == 0 else p.lstrip() if i == len(parts) - 1 else p.strip() for i, p in enumerate(parts)]
    pattern = ".*?".join(re.escape(part) for part in parts)
    return re.fullmatch(pattern, message, re.S) is not None


def _marked_block(page: str, kind: str, name: str) -> str:
    (body,) = [b for lang, _, b, before in _blocks(page) if before == f"<!-- {kind}: {name} -->"]
    return body


def _cli(capsys, *argv):
    return run_cli(capsys, "--model", STORIES, "--output", "out.jsonl", *argv)


def _write(name: str, text: str):
    with open(name, "w", encoding="utf-8") as f:
        f.write(text)


def _bad_json(capsys):
    _write("data.jsonl", '{"id": 1, "prompt": "Once upon a time"}\n{"id": 2, "prompt": "The dog"}\n'
                         '{"prompt": "Hi!" "id": 3}\n')
    return _cli(capsys, "--input", "data.jsonl", "--max-tokens", 4)


def _no_prompt_field(capsys):
    _write("data.jsonl", '{"id": 1, "text": "Once upon a time"}\n')
    return _cli(capsys, "--input", "data.jsonl")


def _repeated_custom_id(capsys):
    request = {"method": "POST", "url": "/v1/completions", "body": {"prompt": "Hi"}}
    _write("batch.jsonl", "".join(json.dumps({"custom_id": c, **request}) + "\n" for c in "abcb"))
    return _cli(capsys, "--input", "batch.jsonl")


def _locked_output(capsys):
    from pagedgen.cli.lock import OutputLock

    _write("data.jsonl", '{"prompt": "Once upon a time"}\n')
    with OutputLock("out.jsonl"):  # another open file description: flock refuses the run as it would another process
        return _cli(capsys, "--input", "data.jsonl")


def _deleted_row(capsys):
    _write("data.jsonl", '{"prompt": "Once upon a time"}\n' * 12)
    rc, err = _cli(capsys, "--input", "data.jsonl", "--max-tokens", 1)
    assert rc == 0, err
    with open("out.jsonl", encoding="utf-8") as f:
        lines = f.readlines()
    _write("out.jsonl", "".join(lines[:10] + lines[11:]))  # row 10's line deleted by hand
    return _cli(capsys, "--input", "data.jsonl", "--max-tokens", 1)


def _mistyped_flag(capsys):
    return _cli(capsys, "--input", "data.jsonl", "--max-token", 10)


ERROR_SCENARIOS = [_mistyped_flag, _bad_json, _no_prompt_field, _repeated_custom_id, _locked_output, _deleted_row]


def test_every_quoted_error_message_is_what_the_cli_prints(stories_path, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the pages' names: data.jsonl, out.jsonl, relative
    printed = []
    for scenario in ERROR_SCENARIOS:
        for name in os.listdir(tmp_path):
            os.remove(name)
        rc, err = scenario(capsys)
        assert rc == 2 and len(error_lines(err)) == 1, (scenario.__name__, err)
        printed.append(error_lines(err)[0])
    quotes = _quoted_errors()
    assert len(quotes) >= len(ERROR_SCENARIOS)
    for page, quote in quotes:
        assert any(_matches(quote, m) for m in printed), f"{page} quotes {quote!r}; the command line prints:\n" + "\n".join(printed)
    for message in printed:  # every scenario stands for a quote: none is left checking nothing
        assert any(_matches(q, message) for _, q in quotes), f"no page quotes {message!r}"


def _cli_row(capsys):
    _write("data.jsonl", '{"id": 7, "prompt": "Once upon a time"}\n')
    rc, err = _cli(capsys, "--input", "data.jsonl", "--temperature", 0, "--max-tokens", 5)
    assert rc == 0, err
    return open("out.jsonl", encoding="utf-8").read(), err


def _openai_batch(capsys):
    _write("batch.jsonl", _marked_block("docs/cli.md", "doc-input", "openai-batch"))
    rc, err = _cli(capsys, "--input", "batch.jsonl", "--temperature", 0, "--chat-template", TEMPLATE)
    assert rc == 0, err
    return open("out.jsonl", encoding="utf-8").readline(), err  # the page shows r1's answer


OUTPUT_SCENARIOS = {"cli-row": lambda capsys: _cli_row(capsys)[0],
                    "cli-summary": lambda capsys: _cli_row(capsys)[1],
                    "openai-batch": lambda capsys: _openai_batch(capsys)[0]}
TIMING = re.compile(r"[\d.,]+(?= s \(| output tok/s| tok/s in all)")  # a summary's seconds and rates


def _comparable(text: str, shown: str):
    """The JSON lines of a json block; the lines of a text block with its timings masked."""
    if shown.lstrip().startswith("{"):
        rows = [json.loads(line) for line in text.splitlines()]
        for row, want in zip(rows, [json.loads(line) for line in shown.splitlines()]):
            if "response" in row:  # the OpenAI format's "created": the time the output was started
                row["response"]["body"]["created"] = want["response"]["body"]["created"]
        return rows
    return TIMING.sub("N", text).splitlines()


@pytest.mark.parametrize("name", sorted(OUTPUT_SCENARIOS))
def test_example_outputs_are_what_the_cli_writes(name, stories_path, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shown = _marked_block("docs/cli.md", "doc-output", name)
    got = OUTPUT_SCENARIOS[name](capsys)
    assert _comparable(got, shown) == _comparable(shown, shown), f"docs/cli.md ({name}) shows\n{shown}\nthe command line writes\n{got}"


def test_the_summary_phrases_the_page_quotes_are_printed(stories_path, tmp_path, capsys, monkeypatch):
    """docs/cli.md's "Summary" quotes two lines a run prints instead of its figures."""
    monkeypatch.chdir(tmp_path)
    text = _prose("docs/cli.md")
    rc, err = _no_prompt_field(capsys)
    assert rc == 2 and "`no row was written to OUTPUT`" in text and "pagedgen: no row was written to out.jsonl" in err, err
    os.remove("data.jsonl")
    _cli_row(capsys)
    rc, err = _cli(capsys, "--input", "data.jsonl", "--temperature", 0, "--max-tokens", 5)
    said = "nothing was left to generate (every row was done by an earlier run)"
    assert rc == 0 and f"`{said}`" in text and said in err, err


def test_every_json_example_is_marked():
    """A ``json`` or ``text`` block is an output some scenario checks, or an input one reads."""
    for page in PAGES:
        for lang, line, _, before in _blocks(page):
            if lang in ("json", "text"):
                marker = re.fullmatch(r"<!-- doc-(output|input): ([\w-]+) -->", before)
                assert marker, f"{page}:{line}: a json or text block without <!-- doc-output: NAME --> or <!-- doc-input: NAME -->"
                if marker.group(1) == "output":
                    assert marker.group(2) in OUTPUT_SCENARIOS, f"{page}:{line}: no scenario {marker.group(2)!r}"


#: The messages of the Python API a page quotes (the page, how the quote starts): one scenario each below.
PY_MESSAGES = [("docs/structured_outputs.md", "sampling_params[2].structured_outputs: "),
               ("docs/structured_outputs.md", "request '1': ")]


def test_quoted_python_messages_are_what_the_code_says(stories_path, tmp_path, caplog):
    pytest.importorskip("llguidance")
    import tiny_checkpoints
    from pagedgen import LLM, SamplingParams, StructuredOutputsParams

    quotes = [(page, q) for page, start in PY_MESSAGES
              for q in re.findall(r"`([^`]+)`", _prose(page)) if q.startswith(start)]
    assert len(quotes) == len(PY_MESSAGES), quotes
    said = []
    plain = SamplingParams(max_tokens=4)
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "foo"}))
    with pytest.raises(ValueError) as refused:  # a schema the backend refuses, named by its request
        LLM(stories_path).generate(["a", "b", "c"], [plain, plain, bad], use_tqdm=False)
    said.append(str(refused.value))
    tiny_checkpoints.build("llama", str(tmp_path))  # GPT-2's first 4,096 ids; EOS is "!", so no token writes "!"
    dead_end = SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[ab]!"))
    with caplog.at_level("WARNING", logger="pagedgen"):
        LLM(str(tmp_path)).generate([[300, 400, 500], [301, 401, 501]], [plain, dead_end], use_tqdm=False)
    said += [r.getMessage() for r in caplog.records if r.name == "pagedgen"]
    for page, quote in quotes:
        assert any(_matches(quote, m) for m in said), f"{page} quotes {quote!r}; the code says:\n" + "\n".join(said)
