"""``LLMPredictor(task=...)`` with a pooling model (docs/pooling.md), called on batches directly (the
map_batches mechanics with a Ray cluster are test_ray_data.py's): each row's embedding, class
probabilities and label, or per-token rewards equal ``LLM.embed`` / ``classify`` / ``reward``; a bad
row gets its error and None, the batch goes on."""
import numpy as np
import pytest
import torch

import tiny_checkpoints
from pagedgen import LLM
from pagedgen.integrations.ray import LLMPredictor

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_embed_rows(stories_path):
    predictor = LLMPredictor(stories_path, task="embed", convert="embed", num_kv_blocks=32)
    prompts = ["Once upon a time", 7, "The little dog"]  # the middle row is bad
    out = predictor({"prompt": np.array(prompts, dtype=object), "id": np.arange(3)})
    want = LLM(stories_path, convert="embed", num_kv_blocks=32).embed([prompts[0], prompts[2]], use_tqdm=False)
    assert list(out["id"]) == [0, 1, 2] and out["embedding"][1] is None and "must be a str" in out["error"][1]
    for i, w in zip((0, 2), want):
        assert out["error"][i] == "" and np.allclose(out["embedding"][i], w.outputs.embedding, atol=1e-6)
        assert out["num_prompt_tokens"][i] == len(w.prompt_token_ids)
    with pytest.raises(ValueError, match="sampling_params must be None"):
        LLMPredictor(stories_path, dict(temperature=0), task="embed", convert="embed", num_kv_blocks=32)


def test_classify_and_reward_rows(tmp_path):
    tiny_checkpoints.build_classifier("qwen2", str(tmp_path), num_labels=2)
    ids = [[1, 2, 3], [4, 5, 6, 7]]
    batch = {"prompt_token_ids": np.array([np.array(x) for x in ids], dtype=object)}
    llm = LLM(str(tmp_path), num_kv_blocks=32)
    out = LLMPredictor(str(tmp_path), task="classify", num_kv_blocks=32)(batch)
    for i, w in enumerate(llm.classify(ids, use_tqdm=False)):
        assert out["label"][i] == w.outputs.label and np.allclose(out["probs"][i], w.outputs.probs, atol=1e-6)
    out = LLMPredictor(str(tmp_path), task="reward", num_kv_blocks=32)(batch)
    for i, w in enumerate(llm.reward(ids, use_tqdm=False)):
        assert torch.allclose(torch.from_numpy(out["reward"][i]), w.outputs.data, atol=1e-6)


def test_score_rows(stories_path, tmp_path):
    """``task="score"``: text_1 / text_2 columns scored as ``LLM.score`` (an embedding model's cosine,
    a one-label classifier's sigmoid(logit)); a bad row gets its error and NaN; a batch without the
    pair's columns is a ValueError naming them."""
    firsts, seconds = ["Once upon a time", "Lily had a red ball", 3], ["The little dog", "Lily had a red ball", "x"]
    batch = {"text_1": np.array(firsts, dtype=object), "text_2": np.array(seconds, dtype=object)}
    out = LLMPredictor(stories_path, task="score", convert="embed", num_kv_blocks=32)(batch)
    want = LLM(stories_path, convert="embed", num_kv_blocks=32).score(firsts[:2], seconds[:2], use_tqdm=False)
    assert out["score"][:2] == pytest.approx([w.outputs.score for w in want], abs=1e-6) and out["score"][1] == pytest.approx(1.0, abs=1e-6)
    assert np.isnan(out["score"][2]) and "text_1 must be a str" in out["error"][2] and out["num_prompt_tokens"][0] > 0
    with pytest.raises(ValueError, match="'q' and 'd'"):
        LLMPredictor(stories_path, task="score", convert="embed", num_kv_blocks=32, prompt_column="q", pair_column="d")(batch)
    tiny_checkpoints.build_classifier("llama", str(tmp_path), num_labels=1)
    pairs = {"text_1": np.array(["it is", "and the"], dtype=object), "text_2": np.array(["the one", "a man"], dtype=object)}
    out = LLMPredictor(str(tmp_path), task="score", num_kv_blocks=32)(pairs)
    want = LLM(str(tmp_path), num_kv_blocks=32).score(list(pairs["text_1"]), list(pairs["text_2"]), use_tqdm=False)
    assert list(out["score"]) == pytest.approx([w.outputs.score for w in want], abs=1e-6)
