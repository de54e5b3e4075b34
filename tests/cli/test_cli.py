"""The command line: prompts file in, completions .jsonl out, summary on stderr (in-process here;
``python -m pagedgen`` runs as a subprocess in test_cli_interrupt.py); a user error is one
`pagedgen: error:` line and exit code 2 (more in test_cli_formats.py and test_cli_errors.py)."""
import gc
import json
import os

import pytest

from cli_util import run_cli
from conftest import ROOT


@pytest.mark.usefixtures("one_torch_thread")
def test_cli_jsonl_roundtrip(stories_path, tmp_path, llm, capsys):
    prompts = ["Once upon a time", "The little dog", "Lily had a red ball"]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": p, "id": i}) + "\n" for i, p in enumerate(prompts)))
    dst = tmp_path / "out.jsonl"
    rc, err = run_cli(capsys, "--model", stories_path, "--input", src, "--output", dst, "--temperature", "0", "--max-tokens", "12", "--n", "2")
    assert rc == 0, err
    records = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["prompt"] for r in records] == prompts and [r["index"] for r in records] == [0, 1, 2]
    assert [r["id"] for r in records] == [0, 1, 2] and list(records[0]) == ["index", "prompt", "id", "completions"]
    from pagedgen import SamplingParams

    expected = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    for r, e in zip(records, expected):
        assert len(r["completions"]) == 2
        assert all(c["token_ids"] == e.outputs[0].token_ids and c["text"] == e.outputs[0].text for c in r["completions"])
    assert "3 rows: 3 generated, 0 skipped as already done, 0 bad" in err
    assert "72 output tokens" in err and "KV cache utilization" in err and "prefix-cache hit rate" in err
    sidecar = json.loads((tmp_path / "out.pagedgen.json").read_text())
    assert sidecar["input"]["rows"] == 3 and sidecar["params"]["max_tokens"] == 12


@pytest.mark.usefixtures("one_torch_thread")
def test_cli_text_file_and_bad_input(stories_path, tmp_path, capsys):
    txt = tmp_path / "in.txt"
    txt.write_text("Once upon a time\nThe cat\n")
    rc, err = run_cli(capsys, "--model", stories_path, "--input", txt, "--output", tmp_path / "o.jsonl", "--max-tokens", "4")
    assert rc == 0, err
    assert len((tmp_path / "o.jsonl").read_text().splitlines()) == 2
    assert gc.get_freeze_count() == 0  # the run freezes the heap (full collections skip the model) and unfreezes it after
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    rc, err = run_cli(capsys, "--model", stories_path, "--input", bad, "--output", tmp_path / "x.jsonl")
    # the row before the bad one is generated and kept; the message names the line and says how to go on
    assert rc == 2 and f"{bad}: line 2: no field 'prompt' (fields: text); use --prompt-field" in err
    assert "1 row is in" in err and "--on-error skip" in err and "Traceback" not in err
    assert len((tmp_path / "x.jsonl").read_text().splitlines()) == 1
    assert gc.get_freeze_count() == 0  # also when the run stops at a bad row
    rc, err = run_cli(capsys, "--model", stories_path, "--input", tmp_path / "missing.jsonl", "--output", tmp_path / "y.jsonl")
    assert rc == 2 and "No such file" in err
    rc, err = run_cli(capsys, "--model", stories_path, "--input", txt, "--output", tmp_path / "y.jsonl", "--temperature", "-1")
    assert rc == 2 and "temperature must be in [0, inf)" in err
    assert not (tmp_path / "y.jsonl").exists()


def test_cli_unwritable_output_fails_before_generating(stories_path, tmp_path, capsys):
    txt = tmp_path / "in.txt"
    txt.write_text("Once upon a time\n")
    rc, err = run_cli(capsys, "--model", stories_path, "--input", txt, "--output", tmp_path / "no" / "dir" / "o.jsonl")
    assert rc == 2 and "cannot write --output" in err and "No such file" in err
    # a failing run (bad model folder) leaves an existing output file as it was
    old = tmp_path / "old.jsonl"
    old.write_text("earlier results\n")
    rc, err = run_cli(capsys, "--model", tmp_path / "missing-model", "--input", txt, "--output", old)
    assert rc == 2 and "model folder not found" in err
    assert old.read_text() == "earlier results\n"
    # ... and so does a run that finds it was not written by a resumable pagedgen run
    rc, err = run_cli(capsys, "--model", stories_path, "--input", txt, "--output", old)
    assert rc == 2 and "has no sidecar" in err and "--overwrite" in err
    assert old.read_text() == "earlier results\n"


@pytest.mark.usefixtures("one_torch_thread")
def test_progress_bar_counts_rows_with_a_total(stories_path, tmp_path, capsys):
    from pagedgen.cli import main

    src = tmp_path / "in.txt"
    src.write_text("".join(f"Once upon a time {i}\n" for i in range(12)))
    capsys.readouterr()
    assert main(["--model", stories_path, "--input", str(src), "--output", str(tmp_path / "o.jsonl"), "--max-tokens", "3"]) == 0
    err = capsys.readouterr().err
    assert "| 12/12 [" in err and "<00:00" in err and "output tok/s" in err  # the total, the ETA and the rate
    assert "12 rows: 12 generated" in err


def test_old_flags_and_console_script():
    """The first CLI's flags are still accepted; ``pagedgen`` (the console script) is this main."""
    from importlib.metadata import entry_points

    from pagedgen.cli import build_parser, main

    ns = build_parser().parse_args([
        "--model", "m", "--input", "i", "--output", "o", "--prompt-field", "text", "--max-tokens", "8", "--temperature", "0.5",
        "--top-p", "0.9", "--top-k", "4", "--n", "2", "--seed", "1", "--stop", "x", "--ignore-eos", "--dtype", "float32",
        "--device", "cpu", "--max-num-seqs", "4", "--num-kv-blocks", "32", "--no-prefix-caching", "--no-tqdm"])
    assert (ns.prompt_field, ns.max_tokens, ns.temperature, ns.top_p, ns.top_k, ns.n, ns.seed, ns.stop) == ("text", 8, 0.5, 0.9, 4, 2, 1, ["x"])
    assert (ns.ignore_eos, ns.dtype, ns.device, ns.max_num_seqs, ns.num_kv_blocks, ns.enable_prefix_caching, ns.no_tqdm) == (
        True, "float32", "cpu", 4, 32, False, True)
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        assert tomllib.load(f)["project"]["scripts"]["pagedgen"] == "pagedgen.cli:main"
    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "pagedgen"] or [None]
    if script is not None:  # installed (editable): it resolves to the same function
        assert script.value == "pagedgen.cli:main" and script.load() is main
