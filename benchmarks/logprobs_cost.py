"""What logprobs cost (issue 50): throughput with logprobs against without, and the peak memory of a
long prompt's prompt logprobs.

    python benchmarks/logprobs_cost.py                    # random-135m bf16: 256 TinyStories requests, 5 runs each; 2,048-token prompt
    python benchmarks/logprobs_cost.py --quick            # smoke run: stories260K, 32 requests, 2 runs each, a 500-token prompt
    python benchmarks/logprobs_cost.py --out /tmp/lp      # also logprobs_cost.json
    python benchmarks/logprobs_cost.py --skip throughput --skip memory   # the kernel part alone (seconds)

Throughput. The same requests (TinyStories openings, the throughput benchmark's workload: first
4..24 words, per-request max_tokens drawn once from 16..256, greedy, ignore_eos) run on one LLM with
``logprobs=5, prompt_logprobs=0`` and without logprobs, alternating run by run (off, on, off, on,
...) so that both see the same machine load; output tokens/s, medians compared. Target: on >= 0.9x
off. A logprob request never takes a [rows, vocab] log-softmax (one log-sum-exp per row,
sample/logprobs.py; on the CPU one kernel, pagedgen::logprob_topk, two passes over each row's
logits in their own dtype), but its prompt rows still go through the lm_head, which requests
without prompt logprobs skip.

Kernel. One decode step's logprobs on their own: ``ops.logprob_topk`` (on the CPU the kernel of
csrc/cpu/logprobs.cpp) against its reference (the PyTorch code it replaced: a float32 copy,
logsumexp, the rank count, topk and the ties' nonzero) on ``--kernel-rows`` rows of random logits
of the model's vocabulary in ``--dtype``, k = ``--logprobs``; calls alternated, medians, in
microseconds per row, beside one argmax over the same logits (a pass over them at memory speed).

Memory. One prompt of ``--long-prompt`` tokens (2,047 by default: a 2,048-token context with the
one sampled token), one step (``max_num_batched_tokens`` covers it), in a fresh process per setting:
no prompt logprobs, ``prompt_logprobs=0``, ``prompt_logprobs=5``. Each child reports its peak RSS
after a warm-up call (``ru_maxrss``) and after the measured call: the difference is what the call
added at its peak. Reported beside the size of one [prompt_len, vocab] float32 tensor, which the
call must not hold (prompt-logprob rows go through the lm_head ``PROMPT_LOGPROB_CHUNK_ROWS`` at a
time); the child also records the most rows any lm_head call saw.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
TARGET = 0.9  # logprob requests' throughput over the same requests without logprobs, at least


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random-135m", help="checkpoint folder or a random model name (benchmarks/_workload.py)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=256, help="largest per-request max_tokens (the smallest is 16)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs of each setting")
    ap.add_argument("--logprobs", type=int, default=5, help="top-k logprobs per generated token of the 'on' runs")
    ap.add_argument("--long-prompt", type=int, default=2047, help="tokens of the memory measurement's prompt")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--kernel-rows", type=int, default=256, help="logits rows of the kernel part (a decode step's)")
    ap.add_argument("--skip", choices=("throughput", "memory", "kernel"), action="append", default=[],
                    help="leave a part out (repeat to leave out several)")
    ap.add_argument("--quick", action="store_true", help="stories260K, 32 requests, 2 runs, a 500-token prompt: a smoke run")
    ap.add_argument("--out", default=None, help="folder for logprobs_cost.json")
    ap.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)  # internal: one setting, in a fresh process
    args = ap.parse_args(argv)
    if args.quick:
        shared = os.path.join(os.path.dirname(os.path.dirname(HERE)), "shared")
        args.model, args.dtype = os.path.join(shared, "models", "stories260K"), "float32"
        args.num_prompts, args.repeats, args.long_prompt = min(args.num_prompts, 32), min(args.repeats, 2), min(args.long_prompt, 500)
        args.kernel_rows = min(args.kernel_rows, 32)
    if min(args.num_prompts, args.repeats, args.long_prompt, args.kernel_rows) < 1 or args.max_tokens < 16 or args.logprobs < 0:
        ap.error("--num-prompts, --repeats, --long-prompt, --kernel-rows must be >= 1, --max-tokens >= 16, --logprobs >= 0")
    return args


def model_folder(args) -> str:
    from _workload import RANDOM_MODELS, ensure_random_model

    return ensure_random_model(args.model, args.dtype)[0] if args.model in RANDOM_MODELS else args.model


def throughput(args, folder: str) -> dict:
    import torch

    from _workload import fold_ids, load_workload
    from pagedgen import LLM, SamplingParams

    llm = LLM(folder, dtype=args.dtype, seed=0)
    vocab = llm.model_config.vocab_size
    prompts, limits = load_workload("tinystories", llm.tokenizer, num_prompts=args.num_prompts, min_tokens=16, max_tokens=args.max_tokens,
                                    max_prompt_tokens=None, max_model_len=llm.scheduler_config.max_model_len, seed=0)
    prompts, _ = fold_ids(prompts, vocab)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    settings = {
        "off": [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in limits],
        "on": [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=args.logprobs, prompt_logprobs=0) for m in limits],
    }
    useful = sum(limits)
    llm.generate([{"prompt_token_ids": p[::-1]} for p in prompts[:8]], settings["on"][:8], use_tqdm=False)  # warm-up
    import _roofline

    peak = _roofline.matmul_peak(args.dtype)  # the same run's matmul peak, before the timed runs
    with open(os.path.join(folder, "config.json")) as f:
        flops = _roofline.workload_flops(_roofline.gemm_shapes(json.load(f)), _roofline.workload_rows([len(p) for p in prompts], limits))
    runs: dict[str, list[float]] = {"off": [], "on": []}
    tokens = {}
    for _ in range(args.repeats):
        for name in ("off", "on"):
            start = time.perf_counter()
            out = llm.generate(inputs, settings[name], use_tqdm=False)
            runs[name].append(useful / (time.perf_counter() - start))
            tokens[name] = [o.outputs[0].token_ids for o in out]
    off, on = statistics.median(runs["off"]), statistics.median(runs["on"])
    return {"model": args.model, "dtype": args.dtype, "threads": torch.get_num_threads(), "requests": len(prompts),
            "output_tokens": useful, "logprobs": args.logprobs, "tok_s_off": runs["off"], "tok_s_on": runs["on"],
            "median_off": off, "median_on": on, "ratio": on / off, "target": TARGET,
            "same_tokens": tokens["off"] == tokens["on"], "peak_flops": peak["peak"], "peak_problems": peak["problems"],
            "machine": _roofline.describe_machine(_roofline.machine()),
            # the workload's matmul FLOPs (the lm_head on sampled rows only) per second, each setting
            "share": {name: flops * statistics.median(r) / useful / peak["peak"] for name, r in runs.items()}}


def kernel(args, folder: str) -> dict:
    """The kernel part: ops.logprob_topk against its reference on one step's rows (see the top)."""
    import torch

    from pagedgen import ops
    from pagedgen.ops import reference

    with open(os.path.join(folder, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    rows, k = args.kernel_rows, args.logprobs
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(getattr(torch, args.dtype))
    ids = torch.randint(0, vocab, (rows,), generator=gen)
    outs = {name: torch.empty(rows, 3 + 2 * k, dtype=torch.float64) for name in ("kernel", "reference")}
    calls = {
        "kernel": lambda: ops.logprob_topk(outs["kernel"], logits, ids, k),
        "reference": lambda: reference.logprob_topk(outs["reference"], logits, ids, k),
        "argmax": lambda: ops.argmax(torch.empty(rows, dtype=torch.int64), logits),
    }
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(max(3, 4 * args.repeats)):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    us = {name: statistics.median(t) / rows * 1e6 for name, t in times.items()}
    same = bool(torch.equal(outs["kernel"][:, [0, 2] + list(range(3 + k, 3 + 2 * k))],
                            outs["reference"][:, [0, 2] + list(range(3 + k, 3 + 2 * k))]))
    return {"rows": rows, "vocab": vocab, "dtype": args.dtype, "logprobs": k, "threads": torch.get_num_threads(),
            "kernel_loaded": ops.has_kernel("logprob_topk") and k <= ops.LOGPROB_TOPK_MAX, "us_per_row": us,
            "speedup": us["reference"] / us["kernel"], "same_ids_and_ranks": same}


def memory_child(args, folder: str, setting: str) -> dict:
    """One setting of the memory measurement, in this (fresh) process."""
    from pagedgen import LLM, SamplingParams

    n = args.long_prompt
    llm = LLM(folder, dtype=args.dtype, seed=0, max_model_len=n + 1, max_num_batched_tokens=max(n + 1, 4096), max_num_seqs=8,
              num_kv_blocks=(n + 1) // 16 + 4, enable_prefix_caching=False)
    vocab = llm.model_config.vocab_size
    k = {"none": None, "prompt_logprobs=0": 0, "prompt_logprobs=5": 5}[setting]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=k)
    rows = []
    real = llm.model.compute_logits
    llm.model.compute_logits = lambda h: rows.append(int(h.shape[0])) or real(h)  # instance attribute: this process only
    prompt = [(7 * j + 3) % vocab for j in range(n)]
    llm.generate([{"prompt_token_ids": prompt[::-1]}], params, use_tqdm=False)  # warm-up: the allocator's pools, the kernels
    rows.clear()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if k is not None and (len(out.prompt_logprobs) != n or any(e is None for e in out.prompt_logprobs[1:])):
        raise SystemExit(f"{setting}: the prompt logprobs are incomplete")
    return {"setting": setting, "prompt_tokens": n, "vocab": vocab, "peak_rss_before": before, "peak_rss_after": after,
            "added_at_peak": after - before, "max_lm_head_rows": max(rows, default=0), "seconds": seconds}


def memory(args) -> dict:
    results = []
    for setting in ("none", "prompt_logprobs=0", "prompt_logprobs=5"):
        cmd = [sys.executable, os.path.abspath(__file__), "--memory-child", setting, "--model", args.model, "--dtype", args.dtype,
               "--long-prompt", str(args.long_prompt), "--threads", str(args.threads)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(HERE), os.environ.get("PYTHONPATH")])))
        done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)  # this checkout's pagedgen
        if done.returncode:
            raise SystemExit(f"memory child {setting!r} failed:\n{done.stderr[-4000:]}")
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    vocab, n = results[0]["vocab"], results[0]["prompt_tokens"]
    return {"runs": results, "full_log_softmax_bytes": n * vocab * 4}


def main(argv=None):
    """Run the measurements; returns the report (``{"throughput": ..., "memory": ...}``)."""
    args = parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    folder = model_folder(args)
    if args.memory_child:
        report = memory_child(args, folder, args.memory_child)
        print(json.dumps(report))
        return report
    report = {}
    if "throughput" not in args.skip:
        t = report["throughput"] = throughput(args, folder)
        print(f"throughput, {t['model']} {t['dtype']}, {t['requests']} requests, {t['output_tokens']} output tokens, "
              f"{t['threads']} threads: without logprobs {t['median_off']:.0f} tok/s, with logprobs={t['logprobs']} and "
              f"prompt_logprobs=0 {t['median_on']:.0f} tok/s: {t['ratio']:.3f}x (target >= {TARGET}x: "
              f"{'met' if t['ratio'] >= TARGET else 'NOT met'}); same tokens: {t['same_tokens']}")
        print(f"  {t['machine']}")
        print(f"  share of the matmul peak {t['peak_flops'] / 1e9:,.1f} GFLOP/s: off {t['share']['off']:.1%}, on {t['share']['on']:.1%}"
              + (f" (peak not to be trusted: {'; '.join(t['peak_problems'])})" if t["peak_problems"] else ""))
    if "kernel" not in args.skip:
        kr = report["kernel"] = kernel(args, folder)
        print(f"kernel, {kr['rows']} rows of {kr['vocab']} {kr['dtype']} logits, k = {kr['logprobs']}, {kr['threads']} threads: "
              f"logprob_topk {kr['us_per_row']['kernel']:.1f} us/row ({'the CPU kernel' if kr['kernel_loaded'] else 'NO kernel: the reference'}), "
              f"its reference {kr['us_per_row']['reference']:.1f} us/row ({kr['speedup']:.1f}x), one argmax "
              f"{kr['us_per_row']['argmax']:.1f} us/row; same ids and ranks: {kr['same_ids_and_ranks']}")
    if "memory" not in args.skip:
        m = report["memory"] = memory(args)
        mib = 1 << 20
        print(f"memory, a {m['runs'][0]['prompt_tokens']}-token prompt in one step (one [prompt_len, vocab] float32 tensor: "
              f"{m['full_log_softmax_bytes'] / mib:.0f} MiB):")
        for r in m["runs"]:
            print(f"  {r['setting']:<18} peak RSS {r['peak_rss_after'] / mib:7.0f} MiB, added by the call {r['added_at_peak'] / mib:6.0f} MiB, "
                  f"most lm_head rows at once {r['max_lm_head_rows']}, {r['seconds']:.2f} s")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "logprobs_cost.json"), "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
