"""Pooling models (``LLM.embed``, ``classify``, ``score``, ``reward``, ``encode``) against
transformers on the same checkpoints: stories260K with ``convert="embed"`` (its final normalised
hidden states, LAST and MEAN pooled) and random-weight ``LlamaForSequenceClassification`` /
``Qwen2ForSequenceClassification`` checkpoints (tiny_checkpoints.build_classifier): cosine >=
0.99999 and logits within 1e-4 in float32, over batches mixing lengths, with chunked prefill and
the prefix cache on; results are bitwise the same whatever the batch; bad input raises before any
work."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tiny_checkpoints
from pagedgen import LLM, PoolingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

_GEN = torch.Generator().manual_seed(0)
PROMPTS = [torch.randint(1, 400, (n,), generator=_GEN).tolist() for n in (3, 17, 40, 9, 33, 1, 64)]
SHARED = PROMPTS[2][:32]  # two full blocks of 16 shared by the next prompts: prefix-cache hits
PROMPTS += [SHARED + [5, 6, 7], SHARED + [8]]


def _cosine(a, b) -> float:
    return float(F.cosine_similarity(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64), dim=0))


@pytest.fixture(scope="module")
def stories_hidden(stories_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(stories_path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model.model(torch.tensor([p])).last_hidden_state[0] for p in PROMPTS]  # [n, hidden] after the final norm


@pytest.fixture(scope="module")
def stories_embed(stories_path):
    # 16 tokens a step: the long prompts are prefilled in chunks; the prefix cache is on (the default)
    return LLM(stories_path, convert="embed", dtype="float32", num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=16)


def test_embed_last_equals_transformers(stories_embed, stories_hidden):
    outs = stories_embed.embed(PROMPTS, use_tqdm=False)
    for out, h, p in zip(outs, stories_hidden, PROMPTS):
        assert out.outputs.hidden_size == h.shape[1] and out.prompt_token_ids == p
        assert _cosine(out.outputs.embedding, h[-1]) >= 0.99999
        assert abs(torch.tensor(out.outputs.embedding).norm().item() - 1.0) < 1e-5  # normalised by default
    assert outs[-1].num_cached_tokens == 32  # LAST pooling reuses the prefix cache
    raw = stories_embed.embed(PROMPTS[:2], PoolingParams(normalize=False), use_tqdm=False)
    assert torch.allclose(torch.tensor(raw[1].outputs.embedding), stories_hidden[1][-1], atol=1e-5)


def test_bf16_embeddings_close_to_float32(stories_path, stories_hidden):
    llm = LLM(stories_path, convert="embed", dtype="bfloat16", num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=16)
    for out, h in zip(llm.embed(PROMPTS, use_tqdm=False), stories_hidden):
        assert _cosine(out.outputs.embedding, h[-1]) >= 0.999


def test_batch_invariant(stories_embed):
    together = stories_embed.encode(PROMPTS, use_tqdm=False)
    for i in (0, 4, 6):
        alone = stories_embed.encode([PROMPTS[i]], use_tqdm=False)[0]
        assert torch.equal(alone.outputs.data, together[i].outputs.data)


@pytest.mark.parametrize("pooling_type", ["MEAN", "CLS", "ALL"])
def test_other_poolers_equal_transformers(stories_path, stories_hidden, pooling_type):
    llm = LLM(stories_path, convert="embed", dtype="float32", num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=16,
              pooler_config={"pooling_type": pooling_type})
    task = "token_embed" if pooling_type == "ALL" else "embed"
    outs = llm.encode(PROMPTS, PoolingParams(normalize=False), pooling_task=task, use_tqdm=False)
    for out, h in zip(outs, stories_hidden):
        want = {"MEAN": h.mean(dim=0), "CLS": h[0], "ALL": h}[pooling_type]
        assert out.outputs.data.shape == want.shape
        assert torch.allclose(out.outputs.data, want, atol=1e-5)
        assert out.num_cached_tokens == 0  # every row is needed: no prefix-cache hits
    if pooling_type == "ALL":  # one vector per prompt from a per-token pooler: refused, naming the way out
        with pytest.raises(ValueError, match="pooling_type is 'ALL'.*token_embed"):
            llm.embed(["x"], use_tqdm=False)


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral", "qwen3", "gemma"])
def classifier(request, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp(f"cls-{request.param}"))
    hf = tiny_checkpoints.build_classifier(request.param, folder, num_labels=3)
    with torch.no_grad():
        logits = [hf(torch.tensor([p])).logits[0] for p in PROMPTS]  # [3] each, the last token's
        token_logits = [hf.score(hf.model(torch.tensor([p])).last_hidden_state)[0] for p in PROMPTS[:3]]  # [n, 3]
    llm = LLM(folder, dtype="float32", num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=16)
    return llm, logits, token_logits


def test_classify_equals_transformers(classifier):
    llm, logits, token_logits = classifier
    raw = llm.encode(PROMPTS, PoolingParams(use_activation=False), pooling_task="classify", use_tqdm=False)
    for out, want in zip(raw, logits):
        assert torch.allclose(out.outputs.data, want, atol=1e-4)
    outs = llm.classify(PROMPTS, use_tqdm=False)
    for out, want in zip(outs, logits):
        assert out.outputs.num_classes == 3
        assert torch.allclose(torch.tensor(out.outputs.probs), want.softmax(-1), atol=1e-5)
        assert out.outputs.label == ("neg", "pos", "label_2")[int(want.argmax())]
    rewards = llm.reward(PROMPTS[:3], use_tqdm=False)  # per token, raw
    for out, want in zip(rewards, token_logits):
        assert torch.allclose(out.outputs.data, want, atol=1e-4)


def test_cross_encoder_score(tmp_path):
    hf = tiny_checkpoints.build_classifier("llama", str(tmp_path), num_labels=1)
    llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=32, max_num_seqs=4)
    queries, docs = "it is", ["the one", "and the", "a man"]  # words inside the first 4096 GPT-2 ids
    outs = llm.score(queries, docs, use_tqdm=False)
    for out, doc in zip(outs, docs):
        ids = llm.tokenizer(queries, text_pair=doc)["input_ids"]
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0, 0].sigmoid().item()
        assert abs(out.outputs.score - want) < 1e-5
    with pytest.raises(ValueError, match="same length"):
        llm.score(["a", "b"], ["c", "d", "e"], use_tqdm=False)
    with pytest.raises(ValueError, match="cannot run task 'embed'|dimensions"):
        llm.embed(["x"], PoolingParams(dimensions=4), use_tqdm=False)


def test_embedding_score_is_cosine(stories_embed):
    outs = stories_embed.score("Once upon a time", ["The little dog", "Once upon a time"], use_tqdm=False)
    a, b, c = (o.outputs.embedding for o in stories_embed.embed(["Once upon a time", "The little dog", "Once upon a time"], use_tqdm=False))
    assert abs(outs[0].outputs.score - _cosine(a, b)) < 1e-6
    assert abs(outs[1].outputs.score - 1.0) < 1e-6


def test_bad_input_before_any_work(stories_path, stories_embed):
    gen = LLM(stories_path, num_kv_blocks=32)
    with pytest.raises(ValueError, match="needs a pooling model.*runner='pooling'"):
        gen.embed(["hello"], use_tqdm=False)
    with pytest.raises(ValueError, match="matryoshka"):
        stories_embed.embed(["hello"], PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(ValueError, match="cannot run task 'classify'"):
        stories_embed.classify(["hello"], use_tqdm=False)
    with pytest.raises(ValueError, match="pooling_params\\[1\\].task"):
        stories_embed.embed(["a", "b"], [PoolingParams(), PoolingParams(task="classify")], use_tqdm=False)
    with pytest.raises(ValueError, match="runs a pooling model"):
        stories_embed.generate(["hello"], use_tqdm=False)
    with pytest.raises(ValueError, match="convert='classify'"):
        LLM(stories_path, convert="classify", num_kv_blocks=32)
    with pytest.raises(ValueError, match="pooling_type"):
        LLM(stories_path, convert="embed", pooler_config={"pooling_type": "MAX"})
    with pytest.raises(ValueError, match="in process only"):
        LLM(stories_path, convert="embed", distributed_executor_backend="pickle", num_kv_blocks=32)
    with pytest.raises(ValueError, match="add_request generates"):
        stories_embed.llm_engine.add_request("a", "hello")
    assert stories_embed.embed([], use_tqdm=False) == [] and stories_embed.score([], [], use_tqdm=False) == []
    assert len(stories_embed.embed(["still usable"], use_tqdm=False)) == 1


def test_matryoshka_dimensions(stories_path, tmp_path):
    import json
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(stories_path, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["matryoshka_dimensions"] = [16, 32]
    (folder / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(folder), convert="embed", dtype="float32", num_kv_blocks=32)
    full = llm.embed(["Once upon a time"], PoolingParams(normalize=False), use_tqdm=False)[0].outputs.embedding
    cut = llm.embed(["Once upon a time"], PoolingParams(dimensions=16), use_tqdm=False)[0].outputs.embedding
    assert len(cut) == 16 and _cosine(cut, full[:16]) >= 0.99999
    with pytest.raises(ValueError, match="one of the model's matryoshka_dimensions"):
        llm.embed(["x"], PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(ValueError, match="\\[1, 64\\]"):
        llm.embed(["x"], PoolingParams(dimensions=65), use_tqdm=False)


def test_tight_cache_and_interrupt_leave_results_unchanged(stories_path):
    """MEAN pooling keeps every prefill chunk's rows: under a KV cache of 6 blocks for prompts of up
    to 4 (sequences wait for blocks, chunks of 16 tokens) the vectors equal a roomy cache's, bit
    for bit; an interrupted call leaves the LLM giving what a fresh one gives."""
    kwargs = dict(convert="embed", dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
                  pooler_config={"pooling_type": "MEAN"})
    roomy = LLM(stories_path, num_kv_blocks=64, **kwargs).encode(PROMPTS, use_tqdm=False)
    tight = LLM(stories_path, num_kv_blocks=6, **kwargs)
    for a, b in zip(tight.encode(PROMPTS, use_tqdm=False), roomy):
        assert torch.equal(a.outputs.data, b.outputs.data)

    engine, calls = tight.llm_engine, [0]
    real_step = engine.step

    def failing_step():  # the third step of the call raises, mid-prefill
        calls[0] += 1
        if calls[0] == 3:
            raise KeyboardInterrupt
        return real_step()

    engine.step = failing_step
    with pytest.raises(KeyboardInterrupt):
        tight.encode(PROMPTS, use_tqdm=False)
    engine.step = real_step
    for a, b in zip(tight.encode(PROMPTS, use_tqdm=False), roomy):
        assert torch.equal(a.outputs.data, b.outputs.data)


def test_token_classification_reward(tmp_path):
    """``LlamaForTokenClassification`` (a score head with a bias over every token): ``reward`` equals
    transformers' logits; ``classify`` (one vector per prompt) is refused, naming the way out."""
    import transformers

    torch.manual_seed(0)
    hf = transformers.LlamaForTokenClassification(tiny_checkpoints.hf_config("llama", num_labels=3)).eval()
    hf.save_pretrained(str(tmp_path))
    tiny_checkpoints.copy_tokenizer(str(tmp_path))
    llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16)
    for out, p in zip(llm.reward(PROMPTS, use_tqdm=False), PROMPTS):
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0]  # [n, 3]
        assert torch.allclose(out.outputs.data, want, atol=1e-4)
    with pytest.raises(ValueError, match="pooling_type is 'ALL'"):
        llm.classify(PROMPTS[:1], use_tqdm=False)
