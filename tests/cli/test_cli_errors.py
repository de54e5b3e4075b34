"""The CLI's bad rows (both --on-error modes, line numbers the file's own), its refusal to resume
from a changed input, model or parameters, and every user error as one `pagedgen: error:` line
with exit code 2 and no traceback (in-process)."""
import json
import os
import shutil

import pytest

from cli_util import error_lines, read_jsonl, run_cli
from conftest import story_openings

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPTS = story_openings(8)


def _base(stories_path, src, dst, *extra):
    return ("--model", stories_path, "--input", src, "--output", dst, "--temperature", "0", "--max-tokens", 4, *extra)


def _bad_file(path):
    lines = [json.dumps({"prompt": PROMPTS[0]}),
             "",  # blank lines count in line numbers but are not rows
             '{"prompt": "unterminated',  # line 3, row 1
             json.dumps({"prompt": PROMPTS[1]}),
             json.dumps({"text": "no prompt field"}),  # line 5, row 3
             json.dumps({"prompt": [5] * 600}),  # line 6, row 4: over max_model_len=512
             json.dumps({"prompt": 7}),  # line 7, row 5
             json.dumps({"prompt": PROMPTS[2]})]
    path.write_text("\n".join(lines) + "\n")


def test_bad_rows_stop_then_resume_after_the_fix(stories_path, tmp_path, capsys):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _bad_file(src)
    rc, err = run_cli(capsys, *_base(stories_path, src, dst))
    assert rc == 2 and error_lines(err) == [
        f"pagedgen: error: {src}: line 3: not valid JSON (Unterminated string starting at: column 12) (stopped there: "
        f"1 row is in {str(dst)!r}; fix the row and rerun the same command to resume, or pass --on-error skip)"]
    assert [r["index"] for r in read_jsonl(dst)] == [0]
    # fixing the bad line changes the input after the rows already done: the rerun resumes
    lines = src.read_text().splitlines()
    lines[2] = json.dumps({"prompt": "fixed"})
    src.write_text("\n".join(lines) + "\n")
    rc, err = run_cli(capsys, *_base(stories_path, src, dst))
    assert rc == 2 and "line 5: no field 'prompt' (fields: text); use --prompt-field" in err
    assert "1 skipped as already done" in err
    assert [r["index"] for r in read_jsonl(dst)] == [0, 1, 2]


def test_bad_rows_skip_to_errors_file(stories_path, tmp_path, capsys):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _bad_file(src)
    rc, err = run_cli(capsys, *_base(stories_path, src, dst, "--on-error", "skip"))
    assert rc == 0, err
    assert [r["index"] for r in read_jsonl(dst)] == [0, 2, 6]
    errors = read_jsonl(tmp_path / "out.errors.jsonl")
    assert [(r["index"], r["line"]) for r in errors] == [(1, 3), (3, 5), (4, 6), (5, 7)]
    assert errors[0]["error"].startswith("not valid JSON") and errors[0]["row"] == '{"prompt": "unterminated'
    assert errors[1]["row"] == {"text": "no prompt field"}
    assert "the prompt has 600 tokens" in errors[2]["error"] and "--truncate-prompt-tokens" in errors[2]["error"]
    assert "must be a string or a list of token ids" in errors[3]["error"]
    assert "7 rows: 3 generated, 0 skipped as already done, 4 bad" in err and "bad rows in" in err
    # a rerun finds every row done: nothing is generated or written twice
    rc, err = run_cli(capsys, *_base(stories_path, src, dst, "--on-error", "skip"))
    assert rc == 0 and "0 generated, 7 skipped as already done" in err
    assert len(read_jsonl(dst)) == 3 and len(read_jsonl(tmp_path / "out.errors.jsonl")) == 4


def test_truncate_prompt_tokens_keeps_the_last_tokens(stories_path, tmp_path, capsys, llm):
    from pagedgen import SamplingParams

    ids = [int(t) for t in (list(range(3, 400)) * 2)[:700]]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"prompt": ids}) + "\n")
    rc, err = run_cli(capsys, *_base(stories_path, src, dst, "--truncate-prompt-tokens", 100))
    assert rc == 0, err
    want = llm.generate([ids[-100:]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids
    assert read_jsonl(dst)[0]["completions"][0]["token_ids"] == want
    # a long text prompt: the engine's length check, with the hint; cut, its last tokens are kept
    text = " ".join(PROMPTS * 40)
    src.write_text(json.dumps({"prompt": text}) + "\n")
    rc, err = run_cli(capsys, *_base(stories_path, src, dst, "--overwrite"))
    assert rc == 2 and "max_model_len=512" in err and "pass --truncate-prompt-tokens N" in err
    rc, err = run_cli(capsys, *_base(stories_path, src, dst, "--overwrite", "--truncate-prompt-tokens", -1))
    assert rc == 0, err
    ids = llm.tokenizer(text)["input_ids"][-512:]
    want = llm.generate([ids], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids
    assert read_jsonl(dst)[0]["completions"][0]["token_ids"] == want


@pytest.mark.parametrize("on_error", ["stop", "skip"])
def test_broken_json_array_keeps_the_rows_before_and_resumes_after_the_fix(on_error, stories_path, tmp_path, capsys):
    """A syntax error between a JSON array's elements cannot be skipped: the rows read before it are
    finished and written, the message says how many, and a rerun after the fix finishes the rest."""
    src, dst = tmp_path / "in.json", tmp_path / "out.jsonl"
    elements = [json.dumps({"prompt": p}) for p in PROMPTS[:4]]
    src.write_text("[" + ",\n".join(elements[:3]) + "\n" + elements[3] + "]")  # no comma before the last element
    rc, err = run_cli(capsys, *_base(stories_path, src, dst, "--on-error", on_error))
    assert rc == 2 and error_lines(err) == [
        f"pagedgen: error: {src}:4: expected ',' or ']' after an array element, found '{{' (stopped there: 3 rows are in "
        f"{str(dst)!r}; rerun the same command to resume once the input is fixed)"]
    assert [r["index"] for r in read_jsonl(dst)] == [0, 1, 2]
    src.write_text("[" + ",\n".join(elements) + "]")
    rc, err = run_cli(capsys, *_base(stories_path, src, dst, "--on-error", on_error))
    assert rc == 0 and "1 generated, 3 skipped as already done" in err, err
    assert [r["prompt"] for r in read_jsonl(dst)] == PROMPTS[:4]


def test_changed_input_model_or_params_are_refused(stories_path, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(stories_path, model)
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    rc, err = run_cli(capsys, *_base(model, src, dst))
    assert rc == 0, err
    first = dst.read_bytes()
    rc, err = run_cli(capsys, *_base(model, src, dst, "--max-tokens", 5))
    assert rc == 2 and "the parameters differ" in err and "max_tokens: 4 -> 5" in err and "--overwrite" in err
    rc, err = run_cli(capsys, *_base(model, src, dst, "--max-num-seqs", 3, "--no-enable-prefix-caching"))
    assert rc == 0 and "8 skipped as already done" in err  # performance flags may change
    src.write_text(src.read_text().replace(PROMPTS[3], PROMPTS[3] + " changed"))
    rc, err = run_cli(capsys, *_base(model, src, dst))
    assert rc == 2 and "changed since" in err and "differ" in err
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-6}))
    rc, err = run_cli(capsys, *_base(model, src, dst))
    assert rc == 2 and "the model differs" in err and "config.json" in err
    assert dst.read_bytes() == first
    rc, err = run_cli(capsys, *_base(model, src, dst, "--overwrite"))
    assert rc == 0 and "8 generated" in err


def test_output_is_the_input(stories_path, tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "a"}) + "\n")
    os.link(src, tmp_path / "same.jsonl")
    for out in (src, tmp_path / "same.jsonl", tmp_path / "." / "in.jsonl"):
        rc, err = run_cli(capsys, *_base(stories_path, src, out))
        assert rc == 2 and "is the input file" in err
    assert src.read_text() == json.dumps({"prompt": "a"}) + "\n"


def _broken_model(tmp_path, stories_path, how):
    """A copy of stories260K broken in one way (issue 15 item 4); returns (folder, the file at fault)."""
    model = tmp_path / f"model-{how}"
    shutil.copytree(stories_path, model)
    weights = model / "model.safetensors"
    at_fault = weights
    if how == "corrupt-safetensors":
        weights.write_bytes(os.urandom(4096))
    elif how == "truncated-safetensors":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif how in ("config-not-json", "config-incomplete"):
        at_fault = model / "config.json"
        config = json.loads(at_fault.read_text())
        del config["hidden_size"]
        at_fault.write_text(json.dumps(config) if how == "config-incomplete" else '{"architectures": ["LlamaForCausalLM"],')
    elif how == "no-tokenizer":
        for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
            (model / name).unlink()
        at_fault = model
    elif how == "garbage-tokenizer":
        (model / "tokenizer.json").write_text("garbage")
        at_fault = model
    elif how == "no-weights":
        weights.unlink()
        at_fault = model
    elif how in ("missing-shard", "index-not-json"):
        from safetensors.torch import load_file, save_file

        tensors = load_file(weights)
        weights.unlink()
        names = sorted(tensors)
        shards = {f"model-0000{k + 1}-of-00002.safetensors": names[k::2] for k in range(2)}
        for shard, keys in shards.items():
            save_file({k: tensors[k] for k in keys}, model / shard)
        index = model / "model.safetensors.index.json"
        index.write_text(json.dumps({"metadata": {}, "weight_map": {k: s for s, keys in shards.items() for k in keys}}))
        if how == "missing-shard":
            at_fault = model / "model-00002-of-00002.safetensors"
            at_fault.unlink()
        else:
            index.write_text('{"weight_map": ')
            at_fault = index
    return model, at_fault


BROKEN_CHECKPOINTS = ("corrupt-safetensors", "truncated-safetensors", "config-not-json", "config-incomplete", "no-tokenizer",
                      "garbage-tokenizer", "no-weights", "missing-shard", "index-not-json")


@pytest.mark.parametrize("case", ["missing-input", "input-is-a-folder", "bad-flag-value", "bad-sampling-value", "missing-model",
                                  *BROKEN_CHECKPOINTS, "output-folder-missing", "output-is-a-folder",
                                  "missing-chat-template", "messages-from-csv", "bad-engine-value"])
def test_user_errors_are_one_line(case, stories_path, tmp_path, capsys):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"prompt": "a"}) + "\n")
    model, extra, at_fault = stories_path, [], None
    if case == "missing-input":
        src = tmp_path / "nope.jsonl"
    elif case == "input-is-a-folder":
        src = tmp_path
    elif case == "bad-flag-value":
        extra = ["--max-num-seqs", "many"]
    elif case == "bad-sampling-value":
        extra = ["--top-p", "0"]
    elif case == "bad-engine-value":
        extra = ["--max-num-seqs", "0"]
    elif case == "missing-model":
        model = tmp_path / "nope"
    elif case in BROKEN_CHECKPOINTS:
        model, at_fault = _broken_model(tmp_path, stories_path, case)
    elif case == "output-folder-missing":
        dst = tmp_path / "no" / "out.jsonl"
    elif case == "output-is-a-folder":
        dst = tmp_path
    elif case == "missing-chat-template":
        extra = ["--chat-template", tmp_path / "nope.jinja"]
    elif case == "messages-from-csv":
        src = tmp_path / "in.csv"
        src.write_text("prompt\na\n")
        extra = ["--messages-field", "prompt"]
    rc, err = run_cli(capsys, *_base(model, src, dst, *extra))
    assert rc == 2, err
    (line,) = error_lines(err)
    assert "Traceback" not in err, err
    if at_fault is not None:  # a broken checkpoint: the message names the file (or the folder) at fault
        assert str(at_fault) in line, line
    assert not dst.is_file() or dst.stat().st_size == 0


def test_out_of_memory_at_load_is_a_user_error(stories_path, tmp_path, capsys, monkeypatch):
    """A KV cache too big for the machine (the CPU allocator's RuntimeError, torch.OutOfMemoryError on
    CUDA) says what to lower; another RuntimeError stays an internal error (exit code 1)."""
    import torch

    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"prompt": "a"}) + "\n")
    for exc, code in ((RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1000000000000 bytes"), 2),
                      (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB"), 2), (RuntimeError("a bug"), 1)):
        def fail(**kwargs):
            raise exc

        monkeypatch.setattr("pagedgen.engine_args.LLM", fail)
        rc, err = run_cli(capsys, *_base(stories_path, src, dst, "--kv-cache-memory-bytes", "1TB"))
        (line,) = error_lines(err)
        assert rc == code and "Traceback" not in err, err
        if code == 2:
            assert line.startswith("pagedgen: error: out of memory while loading the model") and "lower --kv-cache-memory-bytes" in line
        else:
            assert "internal error: RuntimeError: a bug" in line and "--debug" in line


def test_debug_shows_the_traceback(stories_path, tmp_path):
    from pagedgen.cli import main

    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "a"}) + "\n")
    from pagedgen.cli.errors import CLIError

    with pytest.raises(CLIError, match="model folder not found") as info:
        main(["--model", str(tmp_path / "nope"), "--input", str(src), "--output", str(tmp_path / "o.jsonl"), "--debug", "--no-tqdm"])
    assert isinstance(info.value.__cause__, FileNotFoundError)
