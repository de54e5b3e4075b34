"""Ray Data's map_batches over LLMPredictor actors (pagedgen.integrations.ray) and examples/ray_data.py.

One local cluster for the module (``ray.init(num_cpus=2)``), two actors of half a CPU each, so a CPU
is left for Ray Data's read tasks. The row-level checks (bad rows get an ``error``, the input kinds)
call LLMPredictor directly, without Ray.
"""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, load_example, story_openings
from pagedgen import SamplingParams
from pagedgen.integrations.ray import OUTPUT_COLUMNS, LLMPredictor

MAX_TOKENS = 12


def _column(values) -> np.ndarray:
    """A 1-D object column (numpy would make equal-length lists a 2-D array)."""
    col = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        col[i] = v
    return col
SAMPLING = dict(temperature=0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray", reason="ray is not installed: pip install -e .[ray] (scripts/setup.sh installs it)")
    pytest.importorskip("ray.data", reason="ray is installed without Ray Data: pip install 'ray[data]'")
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, before) if p)  # the actors import this checkout's pagedgen
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        yield ray
        ray.shutdown()
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = before


@pytest.fixture(scope="module")
def predictor(stories_path):
    return LLMPredictor(stories_path, SAMPLING, chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}")


def test_200_rows_on_two_actors_match_single_process(ray_cluster, stories_path, llm):
    ray = ray_cluster
    prompts = story_openings(200)
    rows = [{"id": i, "prompt": p, "source": f"story-{i}", "score": i * 0.5} for i, p in enumerate(prompts)]
    rows[37]["prompt"] = "word " * 600  # over max_model_len=512: refused, the rest goes on
    out = ray.data.from_items(rows).map_batches(
        LLMPredictor,
        fn_constructor_kwargs=dict(model=stories_path, sampling_params=SAMPLING, max_num_seqs="32"),
        batch_size=25,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=2),
        num_cpus=0.5,
    ).take_all()
    assert sorted(r["id"] for r in out) == list(range(200))  # every row exactly once
    expected = llm.generate([p for i, p in enumerate(prompts) if i != 37], SamplingParams(**SAMPLING), use_tqdm=False)
    by_id = {int(r["id"]): r for r in out}
    bad = by_id.pop(37)
    assert bad["error"].startswith("ValueError: the prompt has ") and "max_model_len=512" in bad["error"]
    assert (bad["generated_text"], bad["num_generated_tokens"], bad["source"]) == ("", 0, "story-37")
    for (i, row), ref in zip(sorted(by_id.items()), expected):
        assert (row["source"], row["score"], row["prompt"]) == (f"story-{i}", i * 0.5, prompts[i])
        assert row["generated_text"] == ref.outputs[0].text, i
        assert (row["num_prompt_tokens"], row["num_generated_tokens"]) == (len(ref.prompt_token_ids), len(ref.outputs[0].token_ids))
        assert (row["finish_reason"], row["error"]) == (ref.outputs[0].finish_reason, "")


def test_bad_rows_get_an_error_and_the_batch_goes_on(predictor, llm):
    batch = {"prompt": _column(["Once upon a time", None, "word " * 600, "The little dog", 7]), "k": np.arange(5)}
    out = predictor(batch)
    assert list(out) == ["prompt", "k", *OUTPUT_COLUMNS] and list(out["k"]) == [0, 1, 2, 3, 4]
    assert [bool(e) for e in out["error"]] == [False, True, True, False, True]
    assert out["error"][1] == "TypeError: the prompt must be a str, got NoneType"
    assert re.match(r"ValueError: the prompt has \d+ tokens; the prompt must fit max_model_len=512", out["error"][2])
    assert out["error"][4] == "TypeError: the prompt must be a str, got int"
    ref = llm.generate(["Once upon a time", "The little dog"], SamplingParams(**SAMPLING), use_tqdm=False)
    assert [out["generated_text"][0], out["generated_text"][3]] == [r.outputs[0].text for r in ref]
    assert list(out["generated_text"][[1, 2, 4]]) == ["", "", ""] and list(out["num_generated_tokens"][[1, 2, 4]]) == [0, 0, 0]


def test_messages_and_token_id_columns(predictor, llm):
    ids = llm.tokenizer("Once upon a time")["input_ids"]
    out = predictor({"prompt_token_ids": _column([np.array(ids), np.array([5, 9999]), np.array([], dtype=np.int64)])})
    assert out["error"][0] == "" and "token id 9999 outside the vocabulary [0, 512)" in out["error"][1]
    assert out["generated_text"][0] == llm.generate([ids], SamplingParams(**SAMPLING), use_tqdm=False)[0].outputs[0].text
    assert out["error"][2] == "" and out["num_prompt_tokens"][2] == 1  # an empty prompt starts from BOS, as LLM.generate
    conversations = [[{"role": "user", "content": "Once upon a time"}], [{"role": "user"}], "not a conversation"]
    out = predictor({"messages": _column(conversations)})
    chat = llm.chat(conversations[0], SamplingParams(**SAMPLING), chat_template=predictor.chat_template, use_tqdm=False)[0]
    assert out["generated_text"][0] == chat.outputs[0].text and out["num_prompt_tokens"][0] == len(chat.prompt_token_ids)
    assert "message 0 must be a dict with str 'role' and 'content'" in out["error"][1]
    assert out["error"][2].startswith("TypeError: the messages must be a non-empty list")


def test_batch_and_constructor_errors(predictor, stories_path):
    with pytest.raises(ValueError, match=r"exactly one input column .* the batch has none"):
        predictor({"text": np.array(["a"])})
    with pytest.raises(ValueError, match=r"the batch has \['prompt', 'messages'\]"):
        predictor({"prompt": np.array(["a"]), "messages": _column([[]])})
    with pytest.raises(ValueError, match=r"would overwrite the batch's column\(s\) \['error'\]"):
        predictor({"prompt": np.array(["a"]), "error": np.array([""])})
    with pytest.raises(ValueError, match=r"sampling_params.n must be 1"):
        LLMPredictor(stories_path, dict(n=2))
    with pytest.raises(ValueError, match=r"unknown LLMPredictor sampling_params key\(s\) 'temp'"):
        LLMPredictor(stories_path, dict(temp=0))
    with pytest.raises(ValueError, match=r"unknown EngineArgs key\(s\) 'max_batch'"):
        LLMPredictor(stories_path, SAMPLING, max_batch=4)


def test_example_jsonl_in_jsonl_out(ray_cluster, stories_path, tmp_path):
    example = load_example("ray_data")
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [{"prompt": p, "n": i} for i, p in enumerate(story_openings(20, seed=3))] + [{"prompt": "word " * 600, "n": 20}]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert example.main(["--input", str(src), "--output", str(dst), "--model", stories_path, "--max-tokens", "8",
                         "--num-actors", "1", "--batch-size", "8", "--preserve-order"]) == 0
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["n"] for r in out] == list(range(21)) and [r["prompt"] for r in out] == [r["prompt"] for r in rows]
    assert all(r["error"] == "" and r["num_generated_tokens"] >= 1 for r in out[:20]) and out[20]["error"]


def test_example_help_runs_without_ray_started():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "ray_data.py"), "--help"], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert proc.returncode == 0 and "--num-actors" in proc.stdout
