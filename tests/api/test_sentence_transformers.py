"""pagedgen against sentence-transformers itself (issue 49's target): folders written by
sentence-transformers' own ``save`` (its current layout: ``modules.json``, ``1_Pooling/config.json``
with one ``pooling_mode``, ``2_Normalize``) from random-weight BERT checkpoints, embedded by
``SentenceTransformer.encode`` and by ``LLM.embed`` on the same texts (cosine >= 0.99999 in float32,
>= 0.999 in bfloat16, in a batch mixing lengths); a ``CrossEncoder``'s ``predict`` against
``LLM.score``. The tokenizer is GPT-2's (the only one here; its pad token set to EOS so that
sentence-transformers can pad a batch)."""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from conftest import GPT2_TOKENIZER
from pagedgen import LLM

st = pytest.importorskip("sentence_transformers", reason="sentence-transformers is in requirements-extras.txt")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXTS = ["Once upon a time there was a little cat.", "Tom ran.", "The sun was hot and the children played in the park all day long.",
         "She smiled", "A big red ball rolled down the hill, and the dog chased it until it stopped by the tree."]
SHAPE = dict(vocab_size=50257, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, max_position_embeddings=128)


def _hf_folder(model_cls, config, folder: str) -> str:
    """A seeded random ``model_cls(config)`` and GPT-2's tokenizer (pad = EOS) saved in ``folder``."""
    import transformers

    torch.manual_seed(0)
    model_cls(config).eval().save_pretrained(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(GPT2_TOKENIZER)
    tokenizer.pad_token = tokenizer.eos_token
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=["mean", "cls"])
def st_folder(request, tmp_path_factory):
    """A SentenceTransformer (BERT, ``pooling_mode`` mean or cls, Normalize) saved by sentence-transformers."""
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    root = tmp_path_factory.mktemp(f"st-{request.param}")
    hf = _hf_folder(transformers.BertModel, transformers.BertConfig(**SHAPE), str(root / "hf"))
    modules = [Transformer(hf), Pooling(SHAPE["hidden_size"], pooling_mode=request.param), Normalize()]
    SentenceTransformer(modules=modules, device="cpu").save(str(root / "st"))
    return str(root / "st")


def test_embed_equals_sentence_transformers_encode(st_folder):
    from sentence_transformers import SentenceTransformer

    with open(os.path.join(st_folder, "1_Pooling", "config.json")) as f:
        assert "pooling_mode" in json.load(f)  # the layout of this release, read as it is
    want = torch.from_numpy(SentenceTransformer(st_folder, device="cpu").encode(TEXTS, batch_size=8))  # [5, 64], normalised
    for dtype, floor in (("float32", 0.99999), ("bfloat16", 0.999)):
        llm = LLM(st_folder, dtype=dtype, num_kv_blocks=64, max_num_batched_tokens=64)
        got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
        cosine = F.cosine_similarity(got.double(), want.double(), dim=1)
        assert cosine.min() >= floor, (dtype, cosine)
        if dtype == "float32":
            assert torch.allclose(got, want, atol=1e-5)
            assert torch.allclose(got.norm(dim=1), torch.ones(len(TEXTS)), atol=1e-5)
            cos = llm.score(TEXTS[0], TEXTS[1:], use_tqdm=False)  # an embedding model scores by cosine
            assert [o.outputs.score for o in cos] == pytest.approx((want[1:] @ want[0]).tolist(), abs=1e-5)


def test_unsupported_pooling_modes_are_refused(st_folder, tmp_path):
    import shutil

    for config, match in (({"embedding_dimension": 64, "pooling_mode": "max"}, "not supported"),
                          ({"embedding_dimension": 64, "pooling_mode": ["cls", "mean"]}, "not supported"),
                          ({"embedding_dimension": 64, "pooling_mode": "mean", "include_prompt": False}, "include_prompt")):
        copy = tmp_path / f"copy{len(os.listdir(tmp_path))}"
        shutil.copytree(st_folder, copy)
        (copy / "1_Pooling" / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=match):
            LLM(str(copy), num_kv_blocks=64)


def test_score_equals_cross_encoder_predict(tmp_path):
    """A one-label ``BertForSequenceClassification`` read by sentence-transformers' ``CrossEncoder``
    (sigmoid of the logit, its default for one label) and by ``LLM.score`` on the same pairs."""
    import transformers
    from sentence_transformers import CrossEncoder

    folder = _hf_folder(transformers.BertForSequenceClassification, transformers.BertConfig(**SHAPE, num_labels=1), str(tmp_path / "ce"))
    query = "Where did the cat go?"
    want = CrossEncoder(folder, device="cpu").predict([(query, t) for t in TEXTS], batch_size=8)
    llm = LLM(folder, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=64)
    got = [o.outputs.score for o in llm.score(query, TEXTS, use_tqdm=False)]
    assert got == pytest.approx(want.tolist(), abs=1e-5)
    assert len(set(round(g, 4) for g in got)) > 1  # the pairs score differently: the second text matters
