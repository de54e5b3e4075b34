"""The command line's adapters: ``--lora NAME=PATH`` (repeatable) and ``--lora-field`` give each row
its adapter, the outputs equal ``LLM.generate`` with the same ``lora_request``s, an unknown name is a
bad row, and the sidecar binds the adapters' files (a rerun with a changed adapter is refused)."""
import json

import pytest

import lora_adapters as la
from cli_util import error_lines, read_jsonl, run_cli
from pagedgen import LLM, LoRARequest, SamplingParams

PROMPTS = ["Once upon a time", "The little dog", "Lily was", "One day, Tom", "The sun", "Mom said"]
NAMES = ["sql", None, "poem", "sql", "", "poem"]  # None: no field; "": the base model too


@pytest.fixture(scope="module")
def adapters(stories_path, tmp_path_factory, one_torch_thread):
    root = tmp_path_factory.mktemp("cli-loras")
    return {"sql": la.make_adapter(stories_path, str(root / "sql"), r=8, seed=11, std=0.1),
            "poem": la.make_adapter(stories_path, str(root / "poem"), r=4, seed=12, std=0.1, targets=("gate_proj", "down_proj"))}


def _input(tmp_path, names=NAMES):
    path = tmp_path / "in.jsonl"
    rows = [dict(prompt=p, **({} if n is None else {"adapter": n})) for p, n in zip(PROMPTS, names)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_rows_run_with_the_adapter_they_name(stories_path, adapters, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    flags = ["--model", stories_path, "--input", _input(tmp_path), "--output", out, "--max-tokens", 8, "--temperature", 0,
             "--lora", f"sql={adapters['sql']}", "--lora", f"poem={adapters['poem']}", "--lora-field", "adapter", "--max-loras", 2]
    rc, err = run_cli(capsys, *flags)
    assert rc == 0, err
    got = [r["completions"][0]["text"] for r in read_jsonl(out)]
    loras = {"sql": LoRARequest("sql", 1, adapters["sql"]), "poem": LoRARequest("poem", 2, adapters["poem"])}
    llm = LLM(stories_path, enable_lora=True, max_loras=2)
    want = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8), lora_request=[loras.get(n) for n in NAMES], use_tqdm=False)
    assert got == [o.outputs[0].text for o in want]
    assert got[0] != llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0].text

    rc, err = run_cli(capsys, *flags)  # a rerun resumes: nothing left to do
    assert rc == 0 and len(read_jsonl(out)) == len(PROMPTS)
    changed = la.make_adapter(stories_path, str(tmp_path / "other-sql"), r=8, seed=99)
    flags[flags.index(f"sql={adapters['sql']}")] = f"sql={changed}"
    rc, err = run_cli(capsys, *flags)
    assert rc == 2 and "the parameters differ from the run that started" in err and "lora" in err


def test_bad_rows_and_flags(stories_path, adapters, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    base = ["--model", stories_path, "--output", out, "--max-tokens", 4]
    rc, err = run_cli(capsys, *base, "--input", _input(tmp_path, ["sql", "nope", None, None, None, None]), "--lora", f"sql={adapters['sql']}",
                      "--lora-field", "adapter", "--on-error", "skip")
    assert rc == 0, err
    bad = read_jsonl(tmp_path / "out.errors.jsonl")
    assert len(bad) == 1 and "names adapter 'nope', not one of the --lora adapters (sql)" in json.dumps(bad[0])
    for extra, message in (
        (["--lora-field", "adapter"], "--lora-field needs the adapters it names"),
        (["--lora", "sql"], "expected NAME=PATH"),
        (["--lora", f"a={adapters['sql']}", "--lora", f"b={adapters['poem']}"], "no --lora-field"),
        (["--lora", f"a={tmp_path / 'missing'}"], "no such folder"),
        (["--lora", f"a={adapters['sql']}", "--max-lora-rank", "4"], "--lora a lora_request 'a'.*rank r=8 is over max_lora_rank=4"),
    ):
        rc, err = run_cli(capsys, *base, "--input", _input(tmp_path), "--overwrite", *extra)
        assert rc == 2 and len(error_lines(err)) == 1, err
        assert __import__("re").search(message, err), err
