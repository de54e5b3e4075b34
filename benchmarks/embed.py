"""Embedding throughput, side by side in one run: pagedgen's ``LLM.embed`` against transformers'
batched forward (padded batches, the same pooling, at its best batch size) on the same random-weight
checkpoint and the same sentences; sentences/s per system and the ratio, and the cosine agreement
of the vectors (min over sentences).

The model is a decoder (``LlamaForCausalLM`` of a small embedding model's shape, pooled with
``convert="embed"``, LAST or MEAN); issue 49's BERT target (a bge-small-shaped ``BertModel``
against sentence-transformers) needs the encoder family, which pagedgen does not have yet.

    python benchmarks/embed.py                                   # 10,000 TinyStories sentences, fp32 and bf16
    python benchmarks/embed.py --num-sentences 200 --dtypes float32 --hf-batch-sizes 16,64   # a quick check

Timings are only meaningful on a quiet machine; say which machine kind ran them.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.environ.get("PAGEDGEN_SHARED", os.path.join(os.path.dirname(ROOT), "shared"))
TINYSTORIES = os.path.join(SHARED, "data", "tinystories_valid_first1000", "tinystories_valid_first1000.jsonl")
GPT2_TOKENIZER = os.path.join(SHARED, "models", "gpt2-tokenizer")
# bge-small's width and depth on a decoder: 384 features, 12 layers, 12 heads, MLP 1536
SHAPE = dict(hidden_size=384, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12, intermediate_size=1536,
             vocab_size=50257, max_position_embeddings=512, tie_word_embeddings=True)


def sentences(n: int) -> list[str]:
    rows = [json.loads(line) for line in open(TINYSTORIES)]
    texts = [s.strip() + "." for r in rows for s in (r.get("text") or r.get("prompt") or "").split(".") if len(s.split()) >= 3]
    return (texts * (n // len(texts) + 1))[:n]


def make_checkpoint(folder: str) -> None:
    import shutil

    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE, initializer_range=0.02))
    model.save_pretrained(folder, safe_serialization=True)
    for f in os.listdir(GPT2_TOKENIZER):
        if f.endswith((".json", ".txt")):
            shutil.copy(os.path.join(GPT2_TOKENIZER, f), folder)


def run_pagedgen(folder: str, texts: list[str], dtype: str, pooling: str) -> tuple[float, torch.Tensor]:
    from pagedgen import LLM, PoolingParams

    llm = LLM(folder, convert="embed", dtype=dtype, pooler_config={"pooling_type": pooling}, max_num_seqs=256, max_model_len=512)
    llm.embed(texts[:64], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.embed(texts, PoolingParams(normalize=True), use_tqdm=False)
    elapsed = time.perf_counter() - start
    return len(texts) / elapsed, torch.tensor([o.outputs.embedding for o in outs])


@torch.inference_mode()
def run_transformers(folder: str, texts: list[str], dtype: str, pooling: str, batch_size: int) -> tuple[float, torch.Tensor]:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    tok.pad_token = tok.eos_token
    tok.padding_side = "right"
    model = transformers.AutoModel.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    vectors = []
    start = time.perf_counter()
    for i in range(0, len(texts), batch_size):
        enc = tok(texts[i : i + batch_size], return_tensors="pt", padding=True)
        h = model(**enc).last_hidden_state  # [B, L, hidden]
        mask = enc["attention_mask"]
        if pooling == "LAST":
            pooled = h[torch.arange(h.shape[0]), mask.sum(1) - 1]
        else:
            pooled = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        vectors.append(torch.nn.functional.normalize(pooled.float(), dim=-1))
    elapsed = time.perf_counter() - start
    return len(texts) / elapsed, torch.cat(vectors)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-sentences", type=int, default=10_000)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--pooling", default="LAST", choices=("LAST", "MEAN"))
    ap.add_argument("--hf-batch-sizes", default="16,32,64,128,256")
    args = ap.parse_args(argv)
    texts = sentences(args.num_sentences)
    print(f"{len(texts)} sentences, torch threads {torch.get_num_threads()}, shape {SHAPE}, pooling {args.pooling}")
    with tempfile.TemporaryDirectory() as folder:
        make_checkpoint(folder)
        for dtype in args.dtypes.split(","):
            ours, ours_vec = run_pagedgen(folder, texts, dtype, args.pooling)
            best, best_bs, hf_vec = 0.0, None, None
            for bs in (int(b) for b in args.hf_batch_sizes.split(",")):
                rate, vec = run_transformers(folder, texts, dtype, args.pooling, bs)
                print(f"  {dtype} transformers batch {bs}: {rate:,.1f} sentences/s")
                if rate > best:
                    best, best_bs, hf_vec = rate, bs, vec
            cosine = torch.nn.functional.cosine_similarity(ours_vec, hf_vec, dim=-1).min().item()
            print(f"{dtype}: pagedgen {ours:,.1f} sentences/s, transformers {best:,.1f} (batch {best_bs}): "
                  f"{ours / best:.2f}x; min cosine {cosine:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
