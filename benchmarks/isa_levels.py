"""The CPU kernels' instruction-set levels against a -march=native build of the same sources (issue 53):
generation speed of each level this CPU runs (pagedgen/ops/isa.py, PAGEDGEN_CPU_ISA) and of the native
build, side by side.

A native build of the CPU kernels (``PAGEDGEN_CPU_LEVELS=native``, setup.py; objects kept in
build/isa-bench-native-<CPU flags' hash>) is put beside the checkout's levels for the run as pagedgen/_C_cpu_native*.so and
removed afterwards. Every (round, level) is a fresh process (one level is loaded per process) that
builds the LLM, warms it up and times one ``generate`` of the workload (greedy, EOS ignored, each request
its own max_tokens: benchmarks/_workload.py); rounds interleave the levels (rotated), medians are
reported. Each process also times a large float32 ``torch.mm`` before and after, the machine's matmul
rate in the same run (a drop between the two, or between rounds, says the machine was busy).

    PYTHONPATH=. .venv/bin/python benchmarks/isa_levels.py --out /tmp/isa          # stories260K + random-135m
    PYTHONPATH=. .venv/bin/python benchmarks/isa_levels.py --models stories260K --repeats 5
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import _workload  # noqa: E402



def _native_temp() -> str:
    """The native build's object folder, one per CPU kind: ninja would find the objects of another kind
    up to date (the command line, -march=native, is the same) and link code this CPU may not run."""
    import hashlib

    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return os.path.join(ROOT, "build", "isa-bench-native-" + hashlib.sha256(flags.encode()).hexdigest()[:12])


def build_native() -> list[str]:
    """Build the native level (CPU kernels only) and put its module into pagedgen/; returns the files put."""
    env = dict(os.environ, PAGEDGEN_CPU_LEVELS="native", PAGEDGEN_NO_CUDA="1", MAX_JOBS=os.environ.get("MAX_JOBS", "2"))
    lib = tempfile.mkdtemp(prefix="isa-bench-lib-")
    try:
        proc = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib", lib, "--build-temp", _native_temp()],
                              cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"the native build failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        placed = []
        for so in glob.glob(os.path.join(lib, "pagedgen", "_C_cpu_native*.so")):
            dst = os.path.join(ROOT, "pagedgen", os.path.basename(so))
            shutil.copy2(so, dst)
            placed.append(dst)
        if not placed:
            raise SystemExit("the native build made no _C_cpu_native module")
        return placed
    finally:
        shutil.rmtree(lib, ignore_errors=True)


def mm_gflops() -> float:
    """float32 torch.mm of 1024 x 1024 x 1024, best of 5, GFLOP/s."""
    import torch

    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * 1024 ** 3 / best / 1e9


def child(args) -> None:
    """One timed run at the level PAGEDGEN_CPU_ISA names; prints one JSON line."""
    import torch

    from pagedgen import LLM, SamplingParams, ops

    torch.manual_seed(0)
    mm_before = mm_gflops()
    model, dtype = model_dir(args.model, args.dtype)
    llm = LLM(model, dtype=dtype, seed=0)
    from transformers import AutoTokenizer

    prompts, limits = _workload.load_workload(args.workload, AutoTokenizer.from_pretrained(model), num_prompts=args.num_prompts,
                                              min_tokens=16, max_tokens=args.max_tokens, max_prompt_tokens=None,
                                              max_model_len=llm.llm_engine.scheduler_config.max_model_len, seed=0)
    prompts = [{"prompt_token_ids": p} for p in prompts]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in limits]
    llm.generate([{"prompt_token_ids": p["prompt_token_ids"][::-1]} for p in prompts[:8]],
                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(json.dumps({"level": ops.cpu_isa(), "features": sorted(ops.cpu_isa_features()), "seconds": seconds,
                      "tok_s": tokens / seconds, "tokens": tokens, "mm_gflops": [mm_before, mm_gflops()],
                      "token_ids_hash": hash(tuple(tuple(o.outputs[0].token_ids) for o in outs)) & 0xFFFFFFFF}))


def model_dir(name: str, dtype: str) -> tuple[str, str]:
    if name == "stories260K":
        return _workload.asset("models/stories260K", "stories260K"), dtype
    folder, _ = _workload.ensure_random_model(name, dtype)
    return folder, dtype


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    ap.add_argument("--models", default="stories260K,random-135m", help="comma-separated: stories260K, random-135m, random-1b")
    ap.add_argument("--dtype", default=None, help="default: float32 for stories260K, bfloat16 for the random models")
    ap.add_argument("--workload", default="tinystories", choices=list(_workload.WORKLOADS))
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-native", action="store_true", help="the levels only, no -march=native build")
    ap.add_argument("--out", default=None, help="folder for isa_levels.json and isa_levels.txt")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)

    import pagedgen.ops as ops
    from pagedgen.ops import isa

    levels = [lv for lv in isa.supported_levels() if lv in isa.built_levels()]
    placed = [] if args.no_native else build_native()
    lines, results = [], []
    try:
        if placed:
            levels.append("native")
        lines.append(f"CPU: {_cpu_name()}; levels this CPU runs and built: {', '.join(levels)}; loaded by default: {ops.cpu_isa()}")
        for model in args.models.split(","):
            dtype = args.dtype or ("float32" if model == "stories260K" else "bfloat16")
            runs = {lv: [] for lv in levels}
            for r in range(args.repeats):
                order = levels[r % len(levels):] + levels[:r % len(levels)]
                for lv in order:
                    env = dict(os.environ, PAGEDGEN_CPU_ISA=lv, PYTHONPATH=ROOT)
                    proc = subprocess.run([sys.executable, __file__, "--child", "--model", model, "--dtype", dtype,
                                           "--workload", args.workload, "--num-prompts", str(args.num_prompts),
                                           "--max-tokens", str(args.max_tokens)], env=env, capture_output=True, text=True)
                    if proc.returncode != 0:
                        raise SystemExit(f"{model} at {lv} failed:\n{proc.stderr[-3000:]}")
                    got = json.loads(proc.stdout.strip().splitlines()[-1])
                    assert got["level"] == lv, got
                    runs[lv].append(got)
                    print(f"{model} {dtype} round {r + 1} {lv:12s} {got['tok_s']:9.1f} tok/s  mm {got['mm_gflops'][0]:.0f}/{got['mm_gflops'][1]:.0f} GFLOP/s", flush=True)
            ref = statistics.median(g["tok_s"] for g in runs[levels[-1]])
            lines.append(f"\n{model} {dtype}, {args.workload} {args.num_prompts} requests, greedy, medians of {args.repeats} "
                         f"(ratio to {levels[-1]}); float32 torch.mm 1024^3 GFLOP/s before/after each run:")
            for lv in levels:
                med = statistics.median(g["tok_s"] for g in runs[lv])
                mm = [round(x) for g in runs[lv] for x in g["mm_gflops"]]
                lines.append(f"  {lv:12s} {med:9.1f} tok/s  {med / ref:5.3f}x   rounds {[round(g['tok_s'], 1) for g in runs[lv]]}  mm {mm}")
                results.append(dict(model=model, dtype=dtype, level=lv, median_tok_s=med, runs=runs[lv]))
    finally:
        for f in placed:
            os.remove(f)
    text = "\n".join(lines)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "isa_levels.txt"), "w") as f:
            f.write(text + "\n")
        with open(os.path.join(args.out, "isa_levels.json"), "w") as f:
            json.dump(results, f, indent=1)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    main()
