"""The command line's ``--task embed|classify|reward`` (docs/cli.md, docs/pooling.md): each row's
embedding, class probabilities with the top label, or per-token rewards, equal to ``LLM.embed`` /
``classify`` / ``reward``; a rerun resumes (rows done are skipped), another task on the same output
is refused, and a task that does not fit the model is one `pagedgen: error:` line."""
import json

import pytest
import torch

import tiny_checkpoints
from cli_util import run_cli
from pagedgen import LLM

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPTS = ["Once upon a time", "The little dog", "Lily had a red ball"]


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_embed_rows_and_resume(stories_path, tmp_path, capsys):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    args = ["--model", stories_path, "--convert", "embed", "--task", "embed", "--input", src, "--output", dst, "--num-kv-blocks", "64"]
    rc, err = run_cli(capsys, *args)
    assert rc == 0, err
    rows = _rows(dst)
    want = LLM(stories_path, convert="embed", num_kv_blocks=64).embed(PROMPTS, use_tqdm=False)
    assert [r["index"] for r in rows] == [0, 1, 2] and list(rows[0]) == ["index", "prompt", "embedding"]
    for r, w in zip(rows, want):
        assert torch.allclose(torch.tensor(r["embedding"]), torch.tensor(w.outputs.embedding), atol=1e-6)
    src.write_text(src.read_text() + json.dumps({"prompt": "A new row"}) + "\n")
    rc, err = run_cli(capsys, *args)  # resumed: the three rows done are skipped, the new one added
    assert rc == 0 and "1 generated, 3 skipped as already done" in err, err
    assert [r["index"] for r in _rows(dst)] == [0, 1, 2, 3]
    rc, err = run_cli(capsys, "--model", stories_path, "--convert", "embed", "--task", "reward", "--input", src, "--output", dst,
                      "--num-kv-blocks", "64")
    assert rc == 2 and "task" in err, err  # another task on the same output: refused (the sidecar's record)
    rc, err = run_cli(capsys, "--model", stories_path, "--task", "embed", "--input", src, "--output", tmp_path / "x.jsonl")
    assert rc == 2 and "needs a pooling model" in err
    rc, err = run_cli(capsys, "--model", stories_path, "--convert", "embed", "--task", "classify", "--input", src, "--output", tmp_path / "y.jsonl")
    assert rc == 2 and "needs a classification head" in err


def test_classify_and_reward_rows(tmp_path, capsys):
    folder = tmp_path / "cls"
    tiny_checkpoints.build_classifier("llama", str(folder), num_labels=2)
    src = tmp_path / "in.jsonl"
    prompts = [[1, 2, 3], [7, 8, 9, 10, 11]]
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    llm = LLM(str(folder), num_kv_blocks=32)
    rc, err = run_cli(capsys, "--model", folder, "--task", "classify", "--input", src, "--output", tmp_path / "c.jsonl", "--num-kv-blocks", "32")
    assert rc == 0, err
    for r, w in zip(_rows(tmp_path / "c.jsonl"), llm.classify(prompts, use_tqdm=False)):
        assert r["classification"]["label"] == w.outputs.label
        assert torch.allclose(torch.tensor(r["classification"]["probs"]), torch.tensor(w.outputs.probs), atol=1e-6)
    rc, err = run_cli(capsys, "--model", folder, "--task", "reward", "--input", src, "--output", tmp_path / "r.jsonl", "--num-kv-blocks", "32")
    assert rc == 0, err
    for r, w in zip(_rows(tmp_path / "r.jsonl"), llm.reward(prompts, use_tqdm=False)):
        assert torch.allclose(torch.tensor(r["reward"]), w.outputs.data, atol=1e-6)  # [num_tokens, num_labels]


def test_score_rows_embedding_model_and_cross_encoder(stories_path, tmp_path, capsys):
    """``--task score``: an embedding model's cosine of each row's text_1 and text_2 (two requests a
    row) and a one-label classifier's sigmoid(logit) of the pair, equal to ``LLM.score``; a resumed
    run skips the rows done; a bad row (missing or non-string text) is refused with its flag named."""
    pairs = [("Once upon a time", "The little dog"), ("Lily had a red ball", "Lily had a red ball"), ("Tom ran", "The sun was hot")]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"text_1": a, "text_2": b}) + "\n" for a, b in pairs))
    args = ["--model", stories_path, "--convert", "embed", "--task", "score", "--input", src, "--output", dst,
            "--num-kv-blocks", "64", "--max-num-seqs", "2"]
    rc, err = run_cli(capsys, *args)
    assert rc == 0, err
    rows = _rows(dst)
    want = LLM(stories_path, convert="embed", num_kv_blocks=64).score([a for a, _ in pairs], [b for _, b in pairs], use_tqdm=False)
    assert list(rows[0]) == ["index", "text_1", "text_2", "score"]
    assert [r["score"] for r in rows] == pytest.approx([w.outputs.score for w in want], abs=1e-6)
    assert rows[1]["score"] == pytest.approx(1.0, abs=1e-6)  # a text with itself
    src.write_text(src.read_text() + json.dumps({"text_1": "A", "text_2": 7}) + "\n" + json.dumps({"q": "A", "d": "B"}) + "\n")
    rc, err = run_cli(capsys, *args, "--on-error", "skip")
    assert rc == 0 and "3 skipped as already done, 2 bad" in err, err
    errors = _rows(tmp_path / "out.errors.jsonl")
    assert "text_2 must be a string" in errors[0]["error"] and "--prompt-field" in errors[1]["error"]
    renamed = tmp_path / "renamed.jsonl"  # the fields named by the flags
    renamed.write_text(json.dumps({"q": pairs[0][0], "d": pairs[0][1]}) + "\n")
    rc, err = run_cli(capsys, *args[:-8], "--input", renamed, "--output", tmp_path / "o2.jsonl", "--prompt-field", "q", "--pair-field", "d",
                      "--num-kv-blocks", "64")
    assert rc == 0, err
    assert _rows(tmp_path / "o2.jsonl")[0]["score"] == pytest.approx(want[0].outputs.score, abs=1e-6)
    rc, err = run_cli(capsys, "--model", stories_path, "--convert", "embed", "--task", "embed", "--pair-field", "d", "--input", src,
                      "--output", tmp_path / "o3.jsonl")
    assert rc == 2 and "--pair-field" in err

    folder = tmp_path / "ce"
    tiny_checkpoints.build_classifier("llama", str(folder), num_labels=1)
    ce_src = tmp_path / "ce.jsonl"
    ce_pairs = [("it is", "the one"), ("and the", "a man"), ("it is", "a man")]  # words inside the tiny vocabulary (4096 GPT-2 ids)
    ce_src.write_text("".join(json.dumps({"text_1": a, "text_2": b}) + "\n" for a, b in ce_pairs))
    rc, err = run_cli(capsys, "--model", folder, "--task", "score", "--input", ce_src, "--output", tmp_path / "ce.out.jsonl", "--num-kv-blocks", "32")
    assert rc == 0, err
    want = LLM(str(folder), num_kv_blocks=32).score([a for a, _ in ce_pairs], [b for _, b in ce_pairs], use_tqdm=False)
    assert [r["score"] for r in _rows(tmp_path / "ce.out.jsonl")] == pytest.approx([w.outputs.score for w in want], abs=1e-6)
    ce_src.write_text(json.dumps({"text_1": [1, 2], "text_2": "x"}) + "\n")
    rc, err = run_cli(capsys, "--model", folder, "--task", "score", "--input", ce_src, "--output", tmp_path / "ce_bad.jsonl", "--num-kv-blocks", "32")
    assert rc != 0 and "text_1 must be a string" in err, err
    folder2 = tmp_path / "cls2"
    tiny_checkpoints.build_classifier("llama", str(folder2), num_labels=2)
    rc, err = run_cli(capsys, "--model", folder2, "--task", "score", "--input", ce_src, "--output", tmp_path / "ce2.jsonl", "--num-kv-blocks", "32")
    assert rc == 2 and "has 2 labels" in err, err
