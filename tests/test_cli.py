"""python -m pagedgen as a subprocess: prompts file in, completions .jsonl out, summary on stderr; a
user error is one `pagedgen: error:` line and exit code 2 (more in test_cli_formats.py,
test_cli_errors.py and test_cli_interrupt.py)."""
import json
import os
import subprocess
import sys

from conftest import ROOT


def _run(*args):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "pagedgen", *args], capture_output=True, text=True, env=env, timeout=300)


def test_cli_jsonl_roundtrip(stories_path, tmp_path, llm):
    prompts = ["Once upon a time", "The little dog", "Lily had a red ball"]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": p, "id": i}) + "\n" for i, p in enumerate(prompts)))
    dst = tmp_path / "out.jsonl"
    proc = _run("--model", stories_path, "--input", str(src), "--output", str(dst), "--temperature", "0",
                "--max-tokens", "12", "--n", "2", "--no-tqdm")
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["prompt"] for r in records] == prompts and [r["index"] for r in records] == [0, 1, 2]
    assert [r["id"] for r in records] == [0, 1, 2] and list(records[0]) == ["index", "prompt", "id", "completions"]
    from pagedgen import SamplingParams

    expected = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    for r, e in zip(records, expected):
        assert len(r["completions"]) == 2
        assert all(c["token_ids"] == e.outputs[0].token_ids and c["text"] == e.outputs[0].text for c in r["completions"])
    assert "3 rows: 3 generated, 0 skipped as already done, 0 bad" in proc.stderr
    assert "72 output tokens" in proc.stderr and "KV cache utilization" in proc.stderr and "prefix-cache hit rate" in proc.stderr
    sidecar = json.loads((tmp_path / "out.pagedgen.json").read_text())
    assert sidecar["input"]["rows"] == 3 and sidecar["params"]["max_tokens"] == 12


def test_cli_text_file_and_bad_input(stories_path, tmp_path):
    txt = tmp_path / "in.txt"
    txt.write_text("Once upon a time\nThe cat\n")
    ok = _run("--model", stories_path, "--input", str(txt), "--output", str(tmp_path / "o.jsonl"), "--max-tokens", "4", "--no-tqdm")
    assert ok.returncode == 0, ok.stderr
    assert len((tmp_path / "o.jsonl").read_text().splitlines()) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    proc = _run("--model", stories_path, "--input", str(bad), "--output", str(tmp_path / "x.jsonl"), "--no-tqdm")
    # the row before the bad one is generated and kept; the message names the line and says how to go on
    assert proc.returncode == 2 and f"{bad}: line 2: no field 'prompt' (fields: text); use --prompt-field" in proc.stderr
    assert "1 rows are in" in proc.stderr and "--on-error skip" in proc.stderr and "Traceback" not in proc.stderr
    assert len((tmp_path / "x.jsonl").read_text().splitlines()) == 1
    proc = _run("--model", stories_path, "--input", str(tmp_path / "missing.jsonl"), "--output", str(tmp_path / "y.jsonl"))
    assert proc.returncode == 2 and "No such file" in proc.stderr
    proc = _run("--model", stories_path, "--input", str(txt), "--output", str(tmp_path / "y.jsonl"), "--temperature", "-1")
    assert proc.returncode == 2 and "temperature must be in [0, inf)" in proc.stderr
    assert not (tmp_path / "y.jsonl").exists()


def test_cli_unwritable_output_fails_before_generating(stories_path, tmp_path):
    txt = tmp_path / "in.txt"
    txt.write_text("Once upon a time\n")
    proc = _run("--model", stories_path, "--input", str(txt), "--output", str(tmp_path / "no" / "dir" / "o.jsonl"))
    assert proc.returncode == 2 and "cannot write --output" in proc.stderr and "No such file" in proc.stderr
    # a failing run (bad model folder) leaves an existing output file as it was
    old = tmp_path / "old.jsonl"
    old.write_text("earlier results\n")
    proc = _run("--model", str(tmp_path / "missing-model"), "--input", str(txt), "--output", str(old))
    assert proc.returncode == 2 and "model folder not found" in proc.stderr
    assert old.read_text() == "earlier results\n"
    # ... and so does a run that finds it was not written by a resumable pagedgen run
    proc = _run("--model", stories_path, "--input", str(txt), "--output", str(old))
    assert proc.returncode == 2 and "has no sidecar" in proc.stderr and "--overwrite" in proc.stderr
    assert old.read_text() == "earlier results\n"
