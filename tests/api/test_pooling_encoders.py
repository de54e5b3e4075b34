"""Encoder embedding models (model/bert.py): random-weight ``BertModel`` and ``XLMRobertaModel``
checkpoints made here from transformers configs (the shapes of all-MiniLM / e5, scaled down), saved
in sentence-transformers' folder layout (``modules.json``, ``1_Pooling/config.json``, a Normalize
module) or bare, against transformers' ``last_hidden_state`` pooled as sentence-transformers'
``encode`` pools it (mean over the tokens, or the CLS row; then L2): cosine >= 0.99999 and within
1e-5 in float32, >= 0.999 in bfloat16, over a batch mixing lengths; bitwise the same alone or in a
batch; a prompt longer than max_num_batched_tokens runs whole (the budget covers max_model_len)."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from conftest import GPT2_TOKENIZER
from pagedgen import LLM, PoolingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

_GEN = torch.Generator().manual_seed(1)
PROMPTS = [torch.randint(3, 4000, (n,), generator=_GEN).tolist() for n in (2, 9, 31, 5, 60, 1, 17)]


def _save_random(model_cls, config, folder: str):
    """A seeded random ``model_cls(config)`` saved in ``folder`` with the GPT-2 tokenizer's files; returns the model."""
    torch.manual_seed(0)
    model = model_cls(config).eval()
    model.save_pretrained(str(folder), safe_serialization=True)
    for f in os.listdir(GPT2_TOKENIZER):
        if f.endswith((".json", ".txt")):
            shutil.copy(os.path.join(GPT2_TOKENIZER, f), folder)
    return model


def _save(kind: str, folder: str, sentence_transformers: bool):
    import transformers

    common = dict(vocab_size=4096, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    if kind == "bert":
        config = transformers.BertConfig(**common, max_position_embeddings=128, hidden_act="gelu")
        model_cls = transformers.BertModel
    else:  # XLM-R: positions start at pad_token_id + 1 = 2, so 130 rows hold 128 positions
        config = transformers.XLMRobertaConfig(**common, max_position_embeddings=130, pad_token_id=1, type_vocab_size=1)
        model_cls = transformers.XLMRobertaModel
    model = _save_random(model_cls, config, folder)
    if sentence_transformers:  # the layout sentence-transformers' save() writes: Transformer, Pooling (mean), Normalize
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
        ]
        with open(os.path.join(folder, "modules.json"), "w") as f:
            json.dump(modules, f)
        os.makedirs(os.path.join(folder, "1_Pooling"))
        os.makedirs(os.path.join(folder, "2_Normalize"))
        with open(os.path.join(folder, "1_Pooling", "config.json"), "w") as f:
            json.dump({"word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
                       "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}, f)
    return model


@pytest.fixture(scope="module", params=["bert", "xlm-roberta"])
def encoder(request, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp(request.param))
    hf = _save(request.param, folder, sentence_transformers=True)
    with torch.no_grad():
        hidden = [hf(torch.tensor([p])).last_hidden_state[0] for p in PROMPTS]  # [n, hidden]
    llm = LLM(folder, dtype="float32", num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=64)
    return folder, llm, hidden


def test_sentence_transformers_folder_equals_mean_pooling(encoder):
    _, llm, hidden = encoder
    for out, h in zip(llm.embed(PROMPTS, use_tqdm=False), hidden):
        want = F.normalize(h.mean(dim=0), dim=0)  # sentence-transformers: mean pooling, then Normalize
        got = torch.tensor(out.outputs.embedding)
        assert F.cosine_similarity(got.double(), want.double(), dim=0) >= 0.99999
        assert torch.allclose(got, want, atol=1e-5)
    batched = llm.encode(PROMPTS, use_tqdm=False)  # lengths 1-60: several share a padded attention bucket
    for p, out in zip(PROMPTS, batched):  # batch-invariant: bitwise the same alone
        assert torch.equal(llm.encode([p], use_tqdm=False)[0].outputs.data, out.outputs.data)


def test_bare_folder_pools_cls_and_bf16(encoder, tmp_path):
    folder, _, hidden = encoder
    shutil.copytree(folder, tmp_path / "bare", ignore=shutil.ignore_patterns("modules.json", "1_Pooling", "2_Normalize"))
    llm = LLM(str(tmp_path / "bare"), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=64)
    for out, h in zip(llm.encode(PROMPTS, PoolingParams(normalize=False), use_tqdm=False), hidden):
        assert torch.allclose(out.outputs.data, h[0], atol=1e-5)  # CLS, vLLM's default for BERT
    bf16 = LLM(folder, dtype="bfloat16", num_kv_blocks=64, max_num_batched_tokens=64)
    for out, h in zip(bf16.embed(PROMPTS, use_tqdm=False), hidden):
        assert F.cosine_similarity(torch.tensor(out.outputs.embedding).double(), h.mean(dim=0).double(), dim=0) >= 0.999


def test_encoder_errors_before_any_work(encoder):
    folder, llm, _ = encoder
    roomy = LLM(folder, num_kv_blocks=64, max_num_batched_tokens=256)
    with pytest.raises(ValueError, match="max_model_len=128"):
        roomy.embed([list(range(3, 132))], use_tqdm=False)
    with pytest.raises(ValueError, match="runs a pooling model"):
        llm.generate([PROMPTS[0]], use_tqdm=False)
    with pytest.raises(ValueError, match="runner='generate'"):
        LLM(folder, runner="generate", num_kv_blocks=64)
    with pytest.raises(ValueError, match="cannot run task 'classify'"):
        llm.classify([PROMPTS[0]], use_tqdm=False)
    full = roomy.embed([list(range(3, 131))], use_tqdm=False)  # every usable position (128)
    assert len(full[0].outputs.embedding) == 64


def test_encoder_prompt_longer_than_the_step_budget_runs_whole(encoder):
    """max_num_batched_tokens=64 is raised to max_model_len=128 for an encoder (vLLM's rule): a
    127-token prompt (one step, alone) gives the same vector as transformers, with short prompts around it."""
    folder, llm, _ = encoder
    assert llm.llm_engine.scheduler_config.max_num_batched_tokens == 128
    long = torch.randint(3, 4000, (127,), generator=torch.Generator().manual_seed(2)).tolist()
    outs = llm.encode([PROMPTS[0], long, PROMPTS[1]], PoolingParams(normalize=False), use_tqdm=False)
    import transformers

    hf = transformers.AutoModel.from_pretrained(folder).eval()
    with torch.no_grad():
        want = hf(torch.tensor([long])).last_hidden_state[0].mean(dim=0)
    assert torch.allclose(outs[1].outputs.data, want, atol=1e-5)


def test_unsupported_sentence_transformers_module(encoder, tmp_path):
    folder, _, _ = encoder
    copy = tmp_path / "dense"
    shutil.copytree(folder, copy)
    modules = json.loads((copy / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (copy / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="Dense"):
        LLM(str(copy), num_kv_blocks=64)


def test_xlm_roberta_cross_encoder(tmp_path):
    """``XLMRobertaForSequenceClassification`` with one label (bge-reranker's head: CLS, dense, tanh,
    out_proj): ``score`` equals sigmoid of transformers' logit on the pair, ``classify`` the logit."""
    import transformers

    config = transformers.XLMRobertaConfig(vocab_size=4096, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                           intermediate_size=128, max_position_embeddings=130, pad_token_id=1, type_vocab_size=1, num_labels=1)
    hf = _save_random(transformers.XLMRobertaForSequenceClassification, config, tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=64)
    query, docs = "it is", ["the one", "and the", "a man"]  # words inside the first 4096 GPT-2 ids
    for out, doc in zip(llm.score(query, docs, use_tqdm=False), docs):
        with torch.no_grad():
            logit = hf(torch.tensor([llm.tokenizer(query, text_pair=doc)["input_ids"]])).logits[0, 0]
        assert abs(out.outputs.score - logit.sigmoid().item()) < 1e-5
    raw = llm.encode([PROMPTS[2]], PoolingParams(use_activation=False), pooling_task="classify", use_tqdm=False)[0].outputs.data
    with torch.no_grad():
        assert torch.allclose(raw, hf(torch.tensor([PROMPTS[2]])).logits[0], atol=1e-4)


def test_bert_cross_encoder_with_token_types(tmp_path):
    """``BertForSequenceClassification`` with one label (ms-marco MiniLM cross-encoders: CLS, BERT's
    pooler, classifier): ``score`` gives each pair token type 1 from where the tokenizer's
    ``token_type_ids`` say its second segment starts, and equals transformers given the same types."""
    import transformers

    config = transformers.BertConfig(vocab_size=4096, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, max_position_embeddings=128, num_labels=1, initializer_range=0.3)
    hf = _save_random(transformers.BertForSequenceClassification, config, tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=64)
    words = {"q": [101, 3, 4, 5, 102], "d1": [6, 7, 102], "d2": [8, 9, 10, 11, 102]}  # BERT's layout: [CLS] q [SEP] d [SEP]

    class PairTokenizer:  # the GPT-2 tokenizer of these folders returns no token types: BERT's, on these ids
        def __call__(self, first, text_pair):
            return {"input_ids": [words[a] + words[b] for a, b in zip(first, text_pair)],
                    "token_type_ids": [[0] * len(words[a]) + [1] * len(words[b]) for a, b in zip(first, text_pair)]}

    llm.llm_engine.processor.tokenizer = PairTokenizer()
    typed = llm.score("q", ["d1", "d2"], PoolingParams(use_activation=False), use_tqdm=False)
    probs = llm.score("q", ["d1", "d2"], use_tqdm=False)
    for raw, prob, d in zip(typed, probs, ("d1", "d2")):
        types = torch.tensor([[0] * len(words["q"]) + [1] * len(words[d])])
        with torch.no_grad():
            want = hf(torch.tensor([words["q"] + words[d]]), token_type_ids=types).logits[0, 0]
            untyped = hf(torch.tensor([words["q"] + words[d]])).logits[0, 0]
        assert abs(raw.outputs.score - want.item()) < 1e-4 and abs(raw.outputs.score - untyped.item()) > 1e-3
        assert abs(prob.outputs.score - want.sigmoid().item()) < 1e-5
