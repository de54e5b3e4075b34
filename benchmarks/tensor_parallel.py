"""Tensor parallelism on the CPU: TP = 2 with one thread per rank against TP = 1 with two threads.

    python benchmarks/tensor_parallel.py                       # random-135m-tp bf16, TinyStories, 64 requests
    python benchmarks/tensor_parallel.py --num-prompts 8 --max-tokens 8   # a smoke run
    python benchmarks/tensor_parallel.py --tensor-parallel-size 1 --pipeline-parallel-size 2   # two stages instead

The model: random-135m's shape (hidden 576, 30 layers, MLP 1536, vocab 49152) with 12 query / 4 KV
heads of 48 features (``random-135m-tp``): random-135m's own 3 KV heads do not divide by 2. The same
q/k/v sizes, so the same FLOPs. Reports tok/s of both, the share of a TP = 2 step spent in the
all-reduces / all-gathers (worker side) and in the step broadcast (driver's wall time of a step
minus rank 0's), which all-reduce ran ("shm" or "gloo"; ``PAGEDGEN_TP_ALLREDUCE``), and per worker
the weight bytes it holds and its peak RSS. One run, side by side: the ratio is the result.
With ``--pipeline-parallel-size P`` the parallel run is ``--tensor-parallel-size`` (default 2) x P
ranks (its keys then start ``tp{T}pp{P}``); a rank's communication time then includes its stage's
activation sends and receives (a receive also waits for the previous stage: the pipeline bubble).
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
    """Time the rank's collectives, activation transfers and steps (module level: run through
    collective_rpc)."""
    worker.timing = {"comm_s": 0.0, "step_s": 0.0, "steps": 0}
    targets = [(worker.tp.comm, ("all_reduce", "all_gather"))] if worker.tp is not None else []
    if worker.pp is not None:
        targets += [(ch, (name,)) for ch, name in ((worker.pp.prev, "recv"), (worker.pp.next, "send")) if ch is not None]
    for obj, names in targets:
        for name in names:
            real = getattr(obj, name)

            def timed(*a, _real=real):
                t = time.perf_counter()
                out = _real(*a)
                worker.timing["comm_s"] += time.perf_counter() - t
                return out

            setattr(obj, name, timed)
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
    ap.add_argument("--tensor-parallel-size", type=int, default=2)
    ap.add_argument("--pipeline-parallel-size", type=int, default=1)
    args = ap.parse_args()
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    label = "tp2" if (tp, pp) == (2, 1) else f"tp{tp}pp{pp}"

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

    with LLM(folder, tensor_parallel_size=tp, pipeline_parallel_size=pp, **kw) as llm:  # cores // (tp x pp) threads per rank
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
        result[f"{label}_1thread_per_rank_tok_s"] = sum(limits) / (time.perf_counter() - t)
        ranks = executor.collective_rpc(_report)
        result["all_reduce"] = executor.communicator
        if pp > 1:
            result["activation_transfer"] = executor.transfer
        result["collectives_share_of_step"] = [r["comm_s"] / r["step_s"] for r in ranks]
        out = executor.output_rank
        result["broadcast_share_of_step"] = (driver_s[0] - ranks[out]["step_s"]) / driver_s[0]
        result[f"{label}_weight_bytes_per_worker"] = [r["weight_bytes"] for r in ranks]
        result[f"{label}_peak_rss_bytes_per_worker"] = [r["peak_rss_bytes"] for r in ranks]
    result[f"{label}_over_tp1"] = result[f"{label}_1thread_per_rank_tok_s"] / result["tp1_2threads_tok_s"]
    result["weights_per_worker_over_tp1"] = max(result[f"{label}_weight_bytes_per_worker"]) / result["tp1_weight_bytes"]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
