"""Tensor parallelism on the CPU: TP = 2 with one thread per rank against TP = 1 with two threads.

    python benchmarks/tensor_parallel.py                       # random-135m-tp bf16, TinyStories, 64 requests
    python benchmarks/tensor_parallel.py --num-prompts 8 --max-tokens 8   # a smoke run

The model: random-135m's shape (hidden 576, 30 layers, MLP 1536, vocab 49152) with 12 query / 4 KV
heads of 48 features (``random-135m-tp``): random-135m's own 3 KV heads do not divide by 2. The same
q/k/v sizes, so the same FLOPs. Reports tok/s of both, the share of a TP = 2 step spent in the
all-reduces / all-gathers (worker side) and in the step broadcast (driver's wall time of a step
minus rank 0's), which all-reduce ran ("shm" or "gloo"; ``PAGEDGEN_TP_ALLREDUCE``), and per worker
the weight bytes it holds and its peak RSS. One run, side by side: the ratio is the result.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _workload  # noqa: E402

_workload.RANDOM_MODELS["random-135m-tp"] = dict(_workload.RANDOM_MODELS["random-135m"], num_attention_heads=12, num_key_value_heads=4)


def _instrument(worker) -> None:
    """Time the rank's collectives and its steps (module level: run through collective_rpc)."""
    comm = worker.tp.comm
    worker.timing = {"comm_s": 0.0, "step_s": 0.0, "steps": 0}
    for name in ("all_reduce", "all_gather"):
        real = getattr(comm, name)

        def timed(x, _real=real):
            t = time.perf_counter()
            out = _real(x)
            worker.timing["comm_s"] += time.perf_counter() - t
            return out

        setattr(comm, name, timed)
    real_execute = worker.execute

    def execute(record):
        t = time.perf_counter()
        out = real_execute(record)
        worker.timing["step_s"] += time.perf_counter() - t
        worker.timing["steps"] += 1
        return out

    worker.execute = execute


def _report(worker) -> dict:
    weights = sum(p.numel() * p.element_size() for p in worker.runner.model.parameters())
    return dict(worker.timing, weight_bytes=weights, peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--min-tokens", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()

    import torch
    from pagedgen import LLM, SamplingParams

    folder, _ = _workload.ensure_random_model("random-135m-tp", args.dtype)
    from transformers import AutoTokenizer

    prompts, limits = _workload.load_workload("tinystories", AutoTokenizer.from_pretrained(folder), num_prompts=args.num_prompts,
                                              min_tokens=args.min_tokens, max_tokens=args.max_tokens, max_prompt_tokens=None,
                                              max_model_len=_workload.RANDOM_MAX_LEN, seed=0)
    prompts, _ = _workload.fold_ids(prompts, _workload.RANDOM_MODELS["random-135m"]["vocab_size"])  # GPT-2 ids past the vocabulary
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in limits]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    kw = dict(dtype=args.dtype, max_model_len=1024, kv_cache_memory_bytes=512 << 20)
    result = {"model": "random-135m-tp", "dtype": args.dtype, "requests": len(prompts), "output_tokens": sum(limits)}

    torch.set_num_threads(2)
    llm = LLM(folder, **kw)
    llm.generate(inputs[:4], params[:4], use_tqdm=False)  # warm-up
    t = time.perf_counter()
    llm.generate(inputs, params, use_tqdm=False)
    result["tp1_2threads_tok_s"] = sum(limits) / (time.perf_counter() - t)
    result["tp1_weight_bytes"] = sum(p.numel() * p.element_size() for p in llm.model.parameters())
    del llm

    with LLM(folder, tensor_parallel_size=2, **kw) as llm:  # one thread per rank (cores // 2 on 2 cores)
        executor = llm.llm_engine.executor
        llm.generate(inputs[:4], params[:4], use_tqdm=False)
        executor.collective_rpc(_instrument)
        driver_s = [0.0]
        real = executor.execute

        def execute(batch, seqs):
            t0 = time.perf_counter()
            out = real(batch, seqs)
            driver_s[0] += time.perf_counter() - t0
            return out

        executor.execute = execute
        t = time.perf_counter()
        llm.generate(inputs, params, use_tqdm=False)
        result["tp2_1thread_per_rank_tok_s"] = sum(limits) / (time.perf_counter() - t)
        ranks = executor.collective_rpc(_report)
        result["all_reduce"] = executor.communicator
        result["collectives_share_of_step"] = [r["comm_s"] / r["step_s"] for r in ranks]
        result["broadcast_share_of_step"] = (driver_s[0] - ranks[0]["step_s"]) / driver_s[0]
        result["tp2_weight_bytes_per_worker"] = [r["weight_bytes"] for r in ranks]
        result["tp2_peak_rss_bytes_per_worker"] = [r["peak_rss_bytes"] for r in ranks]
    result["tp2_over_tp1"] = result["tp2_1thread_per_rank_tok_s"] / result["tp1_2threads_tok_s"]
    result["weights_per_worker_over_tp1"] = max(result["tp2_weight_bytes_per_worker"]) / result["tp1_weight_bytes"]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
