"""The 1-byte KV cache (issue 46 item 3, docs/kv_cache_dtype.md): blocks and throughput of each
``kv_cache_dtype`` in the same memory, against the model-dtype cache ("auto").

    python benchmarks/kv_cache_dtype.py                                  # random-135m bf16, 256MiB of cache
    python benchmarks/kv_cache_dtype.py --kv-cache-memory-bytes 64MiB    # a cache that preempts with "auto"
    python benchmarks/kv_cache_dtype.py --quick                          # smoke run: seconds after the model is built

One LLM per ``kv_cache_dtype``, all built in this process on the same model with the same
``kv_cache_memory_bytes``; each runs the throughput benchmark's workload (benchmarks/_workload.py:
TinyStories openings, per-request max_tokens, greedy, EOS ignored) in alternation (auto, int8, fp8,
auto, ...), so that a shared machine's drift hits all alike. Reported per dtype: the blocks the
memory holds (and their ratio to "auto"; target of issue 46: 2x), the wall time's median over
``--repeats`` and the output tokens/s (target: no lower than "auto"), the preemptions of the last
run, and how many completions equal "auto"'s token for token, and each dtype's model-matmul FLOP/s as
a share of this run's matmul peak (benchmarks/_roofline.py, measured before the timed runs; a random
model: the Llama shapes of its config.json). Target figures need a quiet machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import _roofline
import _workload


def parse_args(argv=None) -> argparse.Namespace:
    from pagedgen.arg_utils import parse_bytes

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random-135m", help="a checkpoint folder, stories260K or a random model name")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-cache-dtypes", default="auto,int8,fp8", help="comma-separated kv_cache_dtype values; the first is the base")
    ap.add_argument("--kv-cache-memory-bytes", type=parse_bytes, default=parse_bytes("256MiB"))
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--min-tokens", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--quick", action="store_true", help="8 prompts, 8-16 tokens, 8MiB of cache, 1 run: checks that it runs")
    ap.add_argument("--out", default=None, help="folder for kv_cache_dtype.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.num_prompts, args.min_tokens, args.max_tokens, args.repeats = 8, 8, 16, 1
        args.kv_cache_memory_bytes, args.max_model_len = 8 << 20, 256
    args.kv_cache_dtypes = [x.strip() for x in args.kv_cache_dtypes.split(",") if x.strip()]
    if min(args.num_prompts, args.repeats, args.min_tokens) < 1 or args.max_tokens < args.min_tokens or not args.kv_cache_dtypes:
        ap.error("--num-prompts, --repeats and --min-tokens must be >= 1, --max-tokens >= --min-tokens, one kv_cache_dtype at least")
    return args


def model_path(name: str, dtype: str) -> str:
    if name == "stories260K":
        return os.path.join(_workload.SHARED, "models", "stories260K")
    if name in _workload.RANDOM_MODELS:
        return _workload.ensure_random_model(name, dtype)[0]
    return name


def measure(args) -> tuple[list[dict], dict, int]:
    """(one result dict per kv_cache_dtype, the matmul peak of this run, the workload's model-matmul FLOPs)."""
    from transformers import AutoTokenizer

    from pagedgen import LLM, SamplingParams

    path = model_path(args.model, args.dtype)
    tok = AutoTokenizer.from_pretrained(path)
    prompts, limits = _workload.load_workload("tinystories", tok, num_prompts=args.num_prompts, min_tokens=args.min_tokens,
                                              max_tokens=args.max_tokens, max_prompt_tokens=None,
                                              max_model_len=args.max_model_len, seed=0)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in limits]
    with open(os.path.join(path, "config.json")) as f:
        flops = _roofline.workload_flops(_roofline.gemm_shapes(json.load(f)),
                                         _roofline.workload_rows([len(p) for p in prompts], limits))
    peak = _roofline.matmul_peak(args.dtype)  # before the timed runs, in this process
    llms = {name: LLM(path, dtype=args.dtype, kv_cache_dtype=name, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                      max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len) for name in args.kv_cache_dtypes}
    warm = _workload.warmup_prompts(prompts)
    for llm in llms.values():
        llm.generate(warm, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    seconds = {name: [] for name in llms}
    tokens, preemptions = {}, {}
    for _ in range(args.repeats):
        for name, llm in llms.items():
            before = llm.get_stats().num_preemptions
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds[name].append(time.perf_counter() - start)
            preemptions[name] = llm.get_stats().num_preemptions - before
            tokens[name] = [list(o.outputs[0].token_ids) for o in outs]
    base = args.kv_cache_dtypes[0]
    results = []
    for name, llm in llms.items():
        blocks = llm.get_stats().num_kv_blocks
        wall = statistics.median(seconds[name])
        results.append(dict(
            kv_cache_dtype=name, num_kv_blocks=blocks, blocks_vs_base=blocks / llms[base].get_stats().num_kv_blocks,
            wall_seconds=seconds[name], output_tokens_per_s=sum(limits) / wall, preemptions_last_run=preemptions[name],
            same_tokens_as_base=f"{sum(a == b for a, b in zip(tokens[name], tokens[base]))}/{len(prompts)}",
        ))  # fmt: skip
    return results, peak, flops


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results, peak, flops = measure(args)
    base = results[0]
    print(f"{args.model} {args.dtype}, kv_cache_memory_bytes={args.kv_cache_memory_bytes}, {args.num_prompts} prompts, "
          f"{torch.get_num_threads()} thread(s), medians of {args.repeats}")
    print(f"{'kv_cache_dtype':<15}{'blocks':>8}{'x base':>8}{'tok/s':>10}{'x base':>8}{'preempt':>9}  same tokens")
    for r in results:
        print(f"{r['kv_cache_dtype']:<15}{r['num_kv_blocks']:>8}{r['blocks_vs_base']:>8.2f}{r['output_tokens_per_s']:>10.1f}"
              f"{r['output_tokens_per_s'] / base['output_tokens_per_s']:>8.2f}{r['preemptions_last_run']:>9}  {r['same_tokens_as_base']}")
    print(_roofline.describe_machine(_roofline.machine()))
    for r in results:
        print(_roofline.share_line(r["kv_cache_dtype"], flops, statistics.median(r["wall_seconds"]), peak))
    if peak.get("problems"):
        print("matmul peak:", "; ".join(peak["problems"]))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "kv_cache_dtype.json"), "w") as f:
            json.dump(dict(args={k: v for k, v in vars(args).items()}, results=results, model_matmul_flops=flops,
                           matmul_peak_flops=peak["peak"]), f, indent=1)


if __name__ == "__main__":
    main()
