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
    python benchmarks/embed.py --num-sentences 200 --dtypes float32 --batch-sizes 16,64 --repeats 1   # a quick check

The peer's batch size is swept first (one run each on --sweep-sentences sentences); then pagedgen,
the peer at its best batch size and vLLM run --repeats times each, interleaved (pagedgen, peer,
vLLM, pagedgen, ...), every system built once (vLLM's child process once per run, only its
``embed`` timed), and the medians are compared.

The tokenizer is GPT-2's (``../shared/models/gpt2-tokenizer``, vocabulary 50,257 rows): the only
one here; the compute is the model's. Timings are only meaningful on a quiet machine; say which
machine kind ran them.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _launch, _roofline
import _roofline  # noqa: E402
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


class Pagedgen:
    name = "pagedgen"

    def __init__(self, kind: str, folder: str, dtype: str, texts: list[str]) -> None:
        from pagedgen import LLM

        self.llm = LLM(folder, dtype=dtype, max_num_seqs=256, max_model_len=512, **({} if kind == "bert" else {"convert": "embed"}))
        self.llm.embed(texts[:64], use_tqdm=False)  # warm-up

    def run(self, texts: list[str]) -> tuple[float, torch.Tensor]:
        start = time.perf_counter()
        outs = self.llm.embed(texts, use_tqdm=False)
        elapsed = time.perf_counter() - start
        return len(texts) / elapsed, torch.tensor([o.outputs.embedding for o in outs])


class SentenceTransformers:
    name = "sentence-transformers"

    def __init__(self, folder: str, dtype: str, texts: list[str], batch_size: int) -> None:
        from sentence_transformers import SentenceTransformer

        self.model = SentenceTransformer(folder, device="cpu", model_kwargs={"dtype": getattr(torch, dtype)})
        self.batch_size = batch_size
        self.model.encode(texts[:64], batch_size=batch_size)  # warm-up

    @torch.inference_mode()
    def run(self, texts: list[str]) -> tuple[float, torch.Tensor]:
        start = time.perf_counter()
        vectors = self.model.encode(texts, batch_size=self.batch_size, convert_to_tensor=True)
        return len(texts) / (time.perf_counter() - start), vectors.float()


class Transformers:
    """transformers' padded batched forward, pooled as the model pools (CLS or LAST), normalised."""
    name = "transformers"

    def __init__(self, kind: str, folder: str, dtype: str, texts: list[str], batch_size: int) -> None:
        import transformers

        self.kind, self.batch_size = kind, batch_size
        self.tok = transformers.AutoTokenizer.from_pretrained(folder)
        self.tok.padding_side = "right"
        self.model = transformers.AutoModel.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
        self.run(texts[:64])  # warm-up

    @torch.inference_mode()
    def run(self, texts: list[str]) -> tuple[float, torch.Tensor]:
        vectors = []
        start = time.perf_counter()
        for i in range(0, len(texts), self.batch_size):
            enc = self.tok(texts[i : i + self.batch_size], return_tensors="pt", padding=True)
            h = self.model(**enc).last_hidden_state  # [B, L, hidden]
            pooled = h[:, 0] if self.kind == "bert" else h[torch.arange(h.shape[0]), enc["attention_mask"].sum(1) - 1]
            vectors.append(torch.nn.functional.normalize(pooled.float(), dim=-1))
        return len(texts) / (time.perf_counter() - start), torch.cat(vectors)


class VLLM:
    """vLLM's CPU backend in a child process of its venv (the LLM built anew per run; only ``embed`` is timed)."""
    name = "vllm"

    def __init__(self, venv: str, folder: str, dtype: str, threads: int) -> None:
        from _launch import vllm_env, vllm_venv_problem

        problem = vllm_venv_problem(venv)
        if problem:
            raise SystemExit(problem)
        self.venv, self.folder, self.dtype = venv, folder, dtype
        self.env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_ENABLE_V1_MULTIPROCESSING="0", **vllm_env(4, f"0-{threads - 1}"))
        self.env.pop("PYTHONPATH", None)

    def run(self, texts: list[str]) -> tuple[float, torch.Tensor]:
        with tempfile.TemporaryDirectory() as tmp:
            texts_file, out_file = os.path.join(tmp, "texts.json"), os.path.join(tmp, "out.json")
            json.dump(texts, open(texts_file, "w"))
            subprocess.run([os.path.join(self.venv, "bin", "python"), "-c", _VLLM_SNIPPET, self.folder, self.dtype, texts_file, out_file],
                           check=True, env=self.env, stdout=subprocess.DEVNULL)
            result = json.load(open(out_file))
        return result["rate"], torch.tensor(result["vectors"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bert", choices=("bert", "decoder"))
    ap.add_argument("--num-sentences", type=int, default=10_000)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batch-sizes", default="16,32,64,128,256",
                    help="the peer's batch sizes, each timed once on --sweep-sentences; its best runs the repeats")
    ap.add_argument("--sweep-sentences", type=int, default=2000, help="sentences of the peer's batch-size sweep")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each system, interleaved; medians reported")
    ap.add_argument("--vllm-venv", default=None, help="a venv with vLLM's CPU build (benchmarks/setup_vllm.sh)")
    args = ap.parse_args(argv)
    texts = sentences(args.num_sentences)
    try:
        import sentence_transformers  # noqa: F401
        peer = "sentence-transformers" if args.model == "bert" else "transformers"
    except ImportError:
        peer = "transformers"
    threads = torch.get_num_threads()
    print(f"{len(texts)} sentences, torch threads {threads}, model {args.model} {SHAPE}, peer {peer}, "
          f"median of {args.repeats} interleaved runs")
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        make_checkpoint(args.model, folder)
        from transformers import AutoTokenizer

        cfg = json.load(open(os.path.join(folder, "config.json")))
        tokens = sum(len(ids) for ids in AutoTokenizer.from_pretrained(folder)(texts)["input_ids"])
        flops_per_sentence = 2 * _roofline.layer_weights_per_token(cfg) * tokens / len(texts)
        print(_roofline.describe_machine(_roofline.machine()))
        print(f"{tokens:,} tokens ({tokens / len(texts):.1f} per sentence); model matmuls {flops_per_sentence / 1e6:,.1f} MFLOP per sentence")
        for dtype in args.dtypes.split(","):
            peak = _roofline.matmul_peak(dtype)
            best, best_bs = 0.0, None
            for bs in (int(b) for b in args.batch_sizes.split(",")):  # the peer at its best batch size
                p = (SentenceTransformers(folder, dtype, texts, bs) if peer == "sentence-transformers"
                     else Transformers(args.model, folder, dtype, texts, bs))
                rate, _ = p.run(texts[: args.sweep_sentences])
                print(f"  {dtype} {peer} batch {bs}: {rate:,.1f} sentences/s (sweep, {min(len(texts), args.sweep_sentences)} sentences)")
                if rate > best:
                    best, best_bs = rate, bs
                del p
            systems = [Pagedgen(args.model, folder, dtype, texts),
                       SentenceTransformers(folder, dtype, texts, best_bs) if peer == "sentence-transformers"
                       else Transformers(args.model, folder, dtype, texts, best_bs)]
            if args.vllm_venv:
                systems.append(VLLM(args.vllm_venv, folder, dtype, threads))
            rates = {s.name: [] for s in systems}
            vectors = {}
            for _ in range(args.repeats):
                for system in systems:
                    rate, vec = system.run(texts)
                    rates[system.name].append(rate)
                    vectors[system.name] = vec
            medians = {name: statistics.median(r) for name, r in rates.items()}
            ours = medians["pagedgen"]
            for name in medians:
                if name == "pagedgen":
                    continue
                cosine = torch.nn.functional.cosine_similarity(vectors["pagedgen"], vectors[name], dim=-1).min().item()
                extra = f" (batch {best_bs})" if name != "vllm" else ""
                print(f"{dtype}: pagedgen {ours:,.1f} sentences/s, {name}{extra} {medians[name]:,.1f}: {ours / medians[name]:.2f}x; "
                      f"min cosine {cosine:.6f}; runs {', '.join(f'{r:,.1f}' for r in rates[name])} vs "
                      f"{', '.join(f'{r:,.1f}' for r in rates['pagedgen'])}")
            for name, rate in medians.items():
                print(_roofline.share_line(f"{dtype} {name}", flops_per_sentence * rate, 1.0, peak))
            if peak["problems"]:
                print(f"  matmul peak not to be trusted: {'; '.join(peak['problems'])}")
            results[dtype] = dict(rates=rates, peer_batch_size=best_bs, peak_flops=peak["peak"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
