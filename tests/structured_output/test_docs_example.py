"""docs/structured_outputs.md's first example, run as written: every line of the form
``<expression>   # <Python string literal>`` must evaluate to that string, so the texts the page
shows cannot go stale (they are the CPU build's, stories260K, seeded sampling, written on the
AMD EPYC AVX2 kind; the failure message gives the text this machine draws, should another CPU
kind's last bits ever move a draw across a boundary)."""
import ast
import os
import re

import pytest

pytest.importorskip("llguidance")

from conftest import ROOT

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DOC = os.path.join(ROOT, "docs", "structured_outputs.md")


def _first_python_block(path: str) -> str:
    text = open(path, encoding="utf-8").read()
    match = re.search(r"```python\n(.*?)```", text, re.S)
    assert match, f"{path} has no python block"
    return match.group(1)


def _split_shown(line: str):
    """(expression, shown value) for ``expr   # 'literal'``, else None."""
    if "#" not in line:
        return None
    for cut in [m.start() for m in re.finditer("#", line)]:
        code, comment = line[:cut].rstrip(), line[cut + 1 :].strip()
        if comment[:1] in "'\"":
            try:
                return code, ast.literal_eval(comment)
            except (ValueError, SyntaxError):
                continue
    return None


def test_structured_outputs_doc_example_shows_what_the_code_gives(stories_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the example's model path is relative to the repository root
    block = _first_python_block(DOC)
    lines = block.splitlines()
    scope: dict = {}
    checked = 0
    for stmt in ast.parse(block).body:  # statement by statement; a shown value is a comment on its last line
        source = ast.get_source_segment(block, stmt)
        shown = _split_shown(lines[stmt.end_lineno - 1]) if isinstance(stmt, ast.Expr) else None
        if shown is None:
            exec(compile(source, DOC, "exec"), scope)
            continue
        got = eval(compile(source, DOC, "eval"), scope)
        assert got == shown[1], f"docs/structured_outputs.md shows {shown[1]!r} for {source!r}; the code gives {got!r}"
        checked += 1
    assert checked >= 2
