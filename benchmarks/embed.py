"""Embedding throughput, side by side in one run, on the same random-weight checkpoint and the same
sentences: pagedgen's ``LLM.embed`` against sentence-transformers' ``encode`` (when it is installed)
or transformers' padded batched forward pooled the same way, each at its best batch size, and
optionally vLLM's CPU backend (``LLM(runner="pooling").embed`` in its own venv); sentences/s per
system, the ratios, and the vectors' agreement (min cosine over sentences).

Models (``--model``):
    bert      issue 49's target: a bge-small-shaped ``BertModel`` (384 features, 12 layers, 12 heads,
              MLP 1536) in a sentence-transformers folder (CLS pooling + Normalize, as bge)
    decoder   a ``LlamaForCausalLM`` of the same width and depth, ``convert="embed"`` (LAST pooling)

    python benchmarks/embed.py --model bert                       # 10,000 TinyStories sentences, fp32 and bf16
    python benchmarks/embed.py --model bert --vllm-venv benchmarks/.vllm-venv
    python benchmarks/embed.py --num-sentences 200 --dtypes float32 --batch-sizes 16,64   # a quick check

The tokenizer is GPT-2's (``../shared/models/gpt2-tokenizer``, vocabulary 50,257 rows): the only
one here; the compute is the model's. Timings are only meaningful on a quiet machine; say which
machine kind ran them.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.environ.get("PAGEDGEN_SHARED", os.path.join(os.path.dirname(ROOT), "shared"))
TINYSTORIES = os.path.join(SHARED, "data", "tinystories_valid_first1000", "tinystories_valid_first1000.jsonl")
GPT2_TOKENIZER = os.path.join(SHARED, "models", "gpt2-tokenizer")
SHAPE = dict(hidden_size=384, num_hidden_layers=12, num_attention_heads=12, intermediate_size=1536, vocab_size=50257,
             max_position_embeddings=512)

_VLLM_SNIPPET = """
import json, sys, time
from vllm import LLM
folder, dtype, texts_file, out_file = sys.argv[1:5]
texts = json.load(open(texts_file))
llm = LLM(folder, runner="pooling", dtype=dtype, enforce_eager=True)
llm.embed(texts[:64], use_tqdm=False)
start = time.perf_counter()
outs = llm.embed(texts, use_tqdm=False)
elapsed = time.perf_counter() - start
json.dump({"rate": len(texts) / elapsed, "vectors": [o.outputs.embedding for o in outs]}, open(out_file, "w"))
"""


def sentences(n: int) -> list[str]:
    rows = [json.loads(line) for line in open(TINYSTORIES)]
    texts = [s.strip() + "." for r in rows for s in (r.get("text") or "").split(".") if len(s.split()) >= 3]
    return (texts * (n // len(texts) + 1))[:n]


def make_checkpoint(kind: str, folder: str) -> None:
    import transformers

    torch.manual_seed(0)
    if kind == "bert":
        model = transformers.BertModel(transformers.BertConfig(**SHAPE, hidden_act="gelu"), add_pooling_layer=False)
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE, num_key_value_heads=12, tie_word_embeddings=True))
    model.save_pretrained(folder, safe_serialization=True)
    tok = transformers.AutoTokenizer.from_pretrained(GPT2_TOKENIZER)
    tok.pad_token = tok.eos_token  # the peers pad their batches
    tok.save_pretrained(folder)
    if kind == "bert":  # sentence-transformers' layout: Transformer, Pooling (CLS), Normalize (bge's)
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                   {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
        json.dump(modules, open(os.path.join(folder, "modules.json"), "w"))
        os.makedirs(os.path.join(folder, "1_Pooling"))
        os.makedirs(os.path.join(folder, "2_Normalize"))
        json.dump({"word_embedding_dimension": SHAPE["hidden_size"], "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False},
                  open(os.path.join(folder, "1_Pooling", "config.json"), "w"))
        json.dump({"max_seq_length": 512, "do_lower_case": False}, open(os.path.join(folder, "sentence_bert_config.json"), "w"))


def run_pagedgen(kind: str, folder: str, texts: list[str], dtype: str) -> tuple[float, torch.Tensor]:
    from pagedgen import LLM

    llm = LLM(folder, dtype=dtype, max_num_seqs=256, max_model_len=512, **({} if kind == "bert" else {"convert": "embed"}))
    llm.embed(texts[:64], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.embed(texts, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return len(texts) / elapsed, torch.tensor([o.outputs.embedding for o in outs])


def run_sentence_transformers(folder: str, texts: list[str], dtype: str, batch_size: int) -> tuple[float, torch.Tensor]:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(folder, device="cpu", model_kwargs={"dtype": getattr(torch, dtype)})
    model.encode(texts[:64], batch_size=batch_size)
    start = time.perf_counter()
    vectors = model.encode(texts, batch_size=batch_size, convert_to_tensor=True)
    return len(texts) / (time.perf_counter() - start), vectors.float()


@torch.inference_mode()
def run_transformers(kind: str, folder: str, texts: list[str], dtype: str, batch_size: int) -> tuple[float, torch.Tensor]:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    tok.padding_side = "right"
    model = transformers.AutoModel.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    vectors = []
    start = time.perf_counter()
    for i in range(0, len(texts), batch_size):
        enc = tok(texts[i : i + batch_size], return_tensors="pt", padding=True)
        h = model(**enc).last_hidden_state  # [B, L, hidden]
        pooled = h[:, 0] if kind == "bert" else h[torch.arange(h.shape[0]), enc["attention_mask"].sum(1) - 1]
        vectors.append(torch.nn.functional.normalize(pooled.float(), dim=-1))
    return len(texts) / (time.perf_counter() - start), torch.cat(vectors)


def run_vllm(venv: str, folder: str, texts: list[str], dtype: str) -> tuple[float, torch.Tensor]:
    with tempfile.TemporaryDirectory() as tmp:
        texts_file, out_file = os.path.join(tmp, "texts.json"), os.path.join(tmp, "out.json")
        json.dump(texts, open(texts_file, "w"))
        subprocess.run([os.path.join(venv, "bin", "python"), "-c", _VLLM_SNIPPET, folder, dtype, texts_file, out_file], check=True)
        result = json.load(open(out_file))
    return result["rate"], torch.tensor(result["vectors"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bert", choices=("bert", "decoder"))
    ap.add_argument("--num-sentences", type=int, default=10_000)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batch-sizes", default="16,32,64,128,256", help="the peer's batch sizes; its best is compared")
    ap.add_argument("--vllm-venv", default=None, help="a venv with vLLM's CPU build (benchmarks/setup_vllm.sh)")
    args = ap.parse_args(argv)
    texts = sentences(args.num_sentences)
    try:
        import sentence_transformers  # noqa: F401
        peer = "sentence-transformers" if args.model == "bert" else "transformers"
    except ImportError:
        peer = "transformers"
    print(f"{len(texts)} sentences, torch threads {torch.get_num_threads()}, model {args.model} {SHAPE}, peer {peer}")
    with tempfile.TemporaryDirectory() as folder:
        make_checkpoint(args.model, folder)
        for dtype in args.dtypes.split(","):
            ours, ours_vec = run_pagedgen(args.model, folder, texts, dtype)
            best, best_bs, peer_vec = 0.0, None, None
            for bs in (int(b) for b in args.batch_sizes.split(",")):
                if peer == "sentence-transformers":
                    rate, vec = run_sentence_transformers(folder, texts, dtype, bs)
                else:
                    rate, vec = run_transformers(args.model, folder, texts, dtype, bs)
                print(f"  {dtype} {peer} batch {bs}: {rate:,.1f} sentences/s")
                if rate > best:
                    best, best_bs, peer_vec = rate, bs, vec
            cosine = torch.nn.functional.cosine_similarity(ours_vec, peer_vec, dim=-1).min().item()
            print(f"{dtype}: pagedgen {ours:,.1f} sentences/s, {peer} {best:,.1f} (batch {best_bs}): {ours / best:.2f}x; "
                  f"min cosine {cosine:.6f}")
            if args.vllm_venv:
                rate, vec = run_vllm(args.vllm_venv, folder, texts, dtype)
                cosine = torch.nn.functional.cosine_similarity(ours_vec, vec, dim=-1).min().item()
                print(f"{dtype}: vLLM {rate:,.1f} sentences/s: pagedgen {ours / rate:.2f}x; min cosine {cosine:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
