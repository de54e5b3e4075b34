"""Matmul choices on this CPU (issue 9 item 6, issue 13): speed of the candidates and bitwise batch invariance.

    python benchmarks/matmul_choices.py --part speed                 # both random models, bf16 + fp32
    python benchmarks/matmul_choices.py --part speed --models random-135m --rows 1,64 --threads 1
    python benchmarks/matmul_choices.py --part speed --models random-135m --candidates onednn,fp32,panels --cold 30
    python benchmarks/matmul_choices.py --part bits                  # row bits vs M, position, threads
    python benchmarks/matmul_choices.py --out /tmp/mm                # both parts, JSON + text

speed: for every fused weight shape [N, K] of the model (benchmarks/_roofline.py; the lm_head only up
to 256 rows, since it runs on sampled rows), x: [M, K] in the dtype, at M = --rows and each thread
count, the candidates below are timed round-robin (one short run of each in turn, --runs rounds, so
that a shared machine's drift hits all alike); the median GFLOP/s and each one's ratio to F.linear are
printed. A candidate whose call is predicted (from the previous M) to take over --max-call-seconds is
skipped and marked so. --cold N: each candidate gets N different random weights of the shape and the
timed calls cycle through them, so that each call finds its weight out of the caches, as a model's
layers do (weights over 32 MB, the lm_head's, are cold already and get one).
  linear      F.linear(x, W), W: [N, K] (what pagedgen's model calls)
  mm_t        torch.mm(x, Wt), Wt = W.t().contiguous(): [K, N], transposed once
  onednn      torch.ops.mkldnn._linear_pointwise(x, P, None, "none", [], "") with
              P = torch.ops.mkldnn._reorder_linear_weight(W, M) (oneDNN's blocked layout, packed once)
  mkl         torch.ops.mkl._mkl_linear(x, P, W, None, M), P = torch.ops.mkl._mkl_reorder_linear_weight(W, M)
              (MKL's packed GEMM; float32 only)
  fp32        bf16 only: F.linear(x.float(), W32).to(bf16) with W32 = W.float() kept (2x the weight bytes)
  panels      pagedgen.ops.packed_linear(out, x, P, None), P = pagedgen.layers.matmul.pack_panels(W) in
              the dtype (pagedgen's own GEMM, csrc/cpu/linear.cpp; where the extension has the kernel)
  pairs       bf16 only: pagedgen.ops.packed_linear_bf16(out, x, P, None), P = pagedgen.layers.matmul.pack_pairs(W)
              (pagedgen's AVX512-BF16 GEMM, vdpbf16ps on bf16 pairs, csrc/cpu/linear_avx512.cpp; where built)
  amx         bf16 only, CPUs with AMX: the same pairs run by pagedgen's AMX GEMM (packed_linear_bf16_amx,
              tdpbf16ps, csrc/cpu/linear_amx.cpp) after its self-check; compare with "blocked" (oneDNN
              row-blocked, the batch-invariant default there) and "onednn" (unblocked) in one run:
              python benchmarks/matmul_choices.py --dtypes bfloat16 --candidates onednn,blocked,pairs,amx
  blocked     the oneDNN path as pagedgen's engine runs it in batch-invariant mode: W prepacked
              (pagedgen.layers.matmul.prepack), run by pagedgen.layers.matmul.linear in the row blocks of
              the batch-invariant config (bf16: bf16_row_blocks(); float32: PACKED_MIN_ROWS..MAX_ROWS)
  compiled    torch.compile of a one-layer nn.Linear with inductor freezing (weights constant-folded and
              packed where inductor can), one compile per M (dynamic=False); --compile-shapes only
bits: for the candidates that run, and each dtype and thread count, whether an output row's bits depend
on M (rows computed in blocks of M vs alone, M = 1) and on the row's position inside a block (the block
rolled by a few rows), on the 135M shapes.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

import _roofline
import _workload

CANDIDATES = ("linear", "mm_t", "onednn", "blocked", "mkl", "fp32", "panels", "pairs", "amx", "compiled")
BITS_M = (*range(1, 41), 48, 63, 64, 65, 100, 127, 128, 129, 255, 256, 300, 512, 1024)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", default="speed,bits", help="speed, bits or both (comma-separated)")
    ap.add_argument("--models", default="random-135m,random-1b")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--rows", default="1,16,64,256,1024", help="M values of the speed part")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--candidates", default=",".join(CANDIDATES))
    ap.add_argument("--compile-shapes", default="gate_up_proj", help="shapes (by name) that get the compiled candidate")
    ap.add_argument("--runs", type=int, default=9, help="round-robin rounds; the median counts")
    ap.add_argument("--min-seconds", type=float, default=0.01, help="each timed run repeats a call for at least this long")
    ap.add_argument("--max-call-seconds", type=float, default=3.0)
    ap.add_argument("--cold", type=int, default=1, help="speed part: distinct weights per shape, cycled (1: one weight, hot in cache)")
    ap.add_argument("--clock", default="wall", choices=["wall", "thread"],
                    help="thread: CPU time of the calling thread (time.thread_time), much less disturbed by other "
                         "processes on a shared machine; needs --threads 1 (torch then computes on that thread)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    for key in ("part", "models", "dtypes", "candidates", "compile_shapes"):
        setattr(args, key, [s for s in getattr(args, key).split(",") if s])
    args.rows = [int(m) for m in args.rows.split(",")]
    args.threads = [int(t) for t in args.threads.split(",")]
    if not set(args.candidates) <= set(CANDIDATES):
        ap.error(f"--candidates must name some of {', '.join(CANDIDATES)}")
    if args.clock == "thread" and args.threads != [1]:
        ap.error("--clock thread measures one thread: use it with --threads 1")
    args.clock = time.thread_time if args.clock == "thread" else time.perf_counter
    return args


def make(candidate: str, w: torch.Tensor, m: int):
    """A callable x -> y for ``candidate`` with the weight ``w`` [N, K] prepared once, or a reason it cannot run."""
    try:
        if candidate == "linear":
            return lambda x: F.linear(x, w)
        if candidate == "mm_t":
            wt = w.t().contiguous()  # [K, N]
            return lambda x: torch.mm(x, wt)
        if candidate == "onednn":
            packed = torch.ops.mkldnn._reorder_linear_weight(w, m)
            return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        if candidate == "mkl":
            if w.dtype != torch.float32:
                return "float32 only"
            packed = torch.ops.mkl._mkl_reorder_linear_weight(w, m)
            return lambda x: torch.ops.mkl._mkl_linear(x, packed, w, None, m)
        if candidate == "fp32":
            if w.dtype == torch.float32:
                return "bf16/fp16 only"
            w32 = w.float()
            return lambda x: F.linear(x.float(), w32).to(w.dtype)
        if candidate == "panels":
            from pagedgen import ops
            from pagedgen.layers.matmul import linear, pack_panels

            if not ops.has_kernel("packed_linear"):
                return "pagedgen._C has no packed_linear kernel here"
            panels, n = pack_panels(w), w.shape[0]
            return lambda x: linear(x, panels, None, None, n)
        if candidate == "pairs":
            from pagedgen import ops
            from pagedgen.layers.matmul import linear, pack_pairs

            if w.dtype != torch.bfloat16:
                return "bf16 only"
            if not ops.has_kernel("packed_linear_bf16"):
                return "pagedgen._C has no packed_linear_bf16 kernel here (needs AVX512-BF16)"
            pairs, n = pack_pairs(w), w.shape[0]
            return lambda x: linear(x, pairs, None, None, n)
        if candidate == "amx":
            from pagedgen.layers import matmul as lin

            if w.dtype != torch.bfloat16:
                return "bf16 only"
            if not lin.cpu_has_amx():
                return "no AMX on this CPU (or no packed_linear_bf16_amx kernel in pagedgen._C)"
            try:
                lin.amx_self_check()
            except RuntimeError as e:
                return f"AMX self-check failed: {e}"
            config, pairs, n = lin.MatmulConfig(w.dtype, pairs=True, amx=True), lin.pack_pairs(w), w.shape[0]
            return lambda x: lin.linear(x, pairs, None, config, n)
        if candidate == "blocked":
            from pagedgen.layers import matmul as lin

            if w.dtype == torch.bfloat16:
                lo, hi = lin.bf16_row_blocks()
                config = lin.MatmulConfig(w.dtype, lo, hi, packed_min_rows=lo, packed_max_rows=hi, prepack_min_numel=1)
            elif w.dtype == torch.float32:
                config = lin.MatmulConfig(w.dtype, lin.MIN_ROWS, lin.MAX_ROWS, packed_min_rows=lin.PACKED_MIN_ROWS,
                                          packed_max_rows=lin.MAX_ROWS, long_k_max_rows=lin.LONG_K_MAX_ROWS, prepack_min_numel=1)
            else:
                return "float32 / bf16 only"
            packed = lin.prepack(w)
            return lambda x: lin.linear(x, packed, None, config)
        return compiled_linear(w, m)
    except RuntimeError as e:
        return str(e).splitlines()[0][:120]


def cycling(fns: list):
    """x -> fns[i](x) with i = 0, 1, ..., len(fns) - 1, 0, ... on successive calls."""
    it = itertools.cycle(fns)
    return lambda x: next(it)(x)


def compiled_linear(w: torch.Tensor, m: int):
    """torch.compile(freezing) of a one-layer nn.Linear holding ``w``, compiled for M = m rows."""
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()  # one graph per (shape, M): past dynamo's recompile limit it would fall back to eager
    layer = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
    layer.weight = torch.nn.Parameter(w, requires_grad=False)
    layer.eval()
    with inductor_config.patch(freezing=True), torch.no_grad():
        fn = torch.compile(layer, dynamic=False)
        fn(torch.zeros(m, w.shape[1], dtype=w.dtype))  # compile now, not inside a timed run
    return fn


def timed_run(fn, x, reps: int, clock=time.perf_counter) -> float:
    """Seconds per call of fn(x), over ``reps`` calls, by ``clock``."""
    start = clock()
    for _ in range(reps):
        fn(x)
    return (clock() - start) / reps


def speed(args, say) -> list[dict]:
    """Round-robin timings of the candidates at every shape, M, dtype and thread count."""
    rows_out = []
    gen = torch.Generator().manual_seed(0)
    for model in args.models:
        shapes = _roofline.gemm_shapes(_workload.RANDOM_MODELS[model])
        for dtype in args.dtypes:
            dt = getattr(torch, dtype)
            for s in shapes:
                cold = 1 if s["n"] * s["k"] * dt.itemsize > 32 << 20 else args.cold
                ws = [torch.randn(s["n"], s["k"], generator=gen).to(dt) for _ in range(cold)]  # [N, K] each
                name = "/".join(s["names"])
                for threads in args.threads:
                    torch.set_num_threads(threads)
                    last_rate: dict[str, float] = {}
                    said_na: set[str] = set()
                    for m in (m for m in args.rows if not (s["lm_head"] and m > 256)):
                        x = torch.randn(m, s["k"], generator=gen).to(dt)  # [M, K]
                        flops = 2 * m * s["n"] * s["k"]
                        fns, notes = {}, {}
                        for c in args.candidates:
                            if c == "compiled" and name not in args.compile_shapes:
                                continue
                            if c in last_rate and flops / last_rate[c] > args.max_call_seconds:
                                notes[c] = f"skipped: ~{flops / last_rate[c]:.0f} s per call"
                                continue
                            made = [make(c, w, m) for w in ws]
                            if isinstance(made[0], str):
                                notes[c] = f"n/a: {made[0]}"
                                continue
                            fn = made[0] if cold == 1 else cycling(made)
                            with torch.no_grad():
                                fn(x)
                                one = max(timed_run(fn, x, 1, args.clock), 1e-7)
                            fns[c] = (fn, max(1, int(args.min_seconds / one)))
                        rates = {c: [] for c in fns}
                        with torch.no_grad():
                            for _ in range(args.runs):
                                for c, (fn, reps) in fns.items():
                                    rates[c].append(flops / max(timed_run(fn, x, reps, args.clock), 1e-9))
                        med = {c: statistics.median(r) for c, r in rates.items()}
                        last_rate.update(med)
                        base = med.get("linear")
                        cells = [f"{c} {g / 1e9:.3g}" + (f" ({g / base:.2f}x)" if base and c != "linear" else "")
                                 for c, g in med.items()] + [f"{c} {n}" for c, n in notes.items() if c not in said_na]
                        said_na |= {c for c, n in notes.items() if n.startswith("n/a")}  # a reason once per shape
                        say(f"{model} {dtype} {name} [{s['n']}, {s['k']}] M={m} threads={threads}: GFLOP/s " + "; ".join(cells))
                        rows_out.append(dict(model=model, dtype=dtype, shape=name, n=s["n"], k=s["k"], m=m, threads=threads,
                                             gflops={c: g / 1e9 for c, g in med.items()}, notes=notes))
    return rows_out


def row_bits_report(fn, x: torch.Tensor, ms) -> tuple[dict, dict]:
    """Per M, the rows of fn(x[:M]) compared bitwise with the same rows computed alone (M = 1), with the
    same rows inside the largest block (M = max(ms)), and after rolling the block by a few rows (position)."""
    alone = torch.cat([fn(x[i:i + 1]) for i in range(x.shape[0])])  # [R, N], each row with M = 1
    ys = {m: fn(x[:m]) for m in ms}  # [m, N] each
    big = ys[max(ms)]
    out = {}
    for m, y in ys.items():
        k = min(3, m - 1)
        rolled = torch.roll(fn(torch.roll(x[:m], k, 0)), -k, 0)  # every row at another position of the block
        out[m] = dict(same_as_alone=(y == alone[:m]).all(dim=1).float().mean().item(),
                      same_as_big=(y == big[:m]).all(dim=1).float().mean().item(),
                      same_after_roll=(rolled == y).all(dim=1).float().mean().item())
    return out, ys


def spans(ms: list[int]) -> str:
    """[1, 2, 3, 5, 7, 8] -> '1-3, 5, 7-8'."""
    parts, start = [], None
    for i, m in enumerate(ms):
        if start is None:
            start = m
        if i + 1 == len(ms) or BITS_M.index(ms[i + 1]) != BITS_M.index(m) + 1:
            parts.append(str(start) if start == m else f"{start}-{m}")
            start = None
    return ", ".join(parts) or "none"


def bits(args, say) -> list[dict]:
    """Bitwise invariance of output rows to M, to position and to the thread count, per candidate and dtype."""
    gen = torch.Generator().manual_seed(1)
    shapes = [s for s in _roofline.gemm_shapes(_workload.RANDOM_MODELS["random-135m"]) if s["names"][0] in ("qkv_proj", "down_proj")]
    say(f"bits: M in {spans(list(BITS_M))} (ranges list consecutive entries of that set)")
    results = []
    for dtype in args.dtypes:
        dt = getattr(torch, dtype)
        for s in shapes:
            w = torch.randn(s["n"], s["k"], generator=gen).to(dt)
            x = torch.randn(max(BITS_M), s["k"], generator=gen).to(dt)
            for c in (c for c in args.candidates if c not in ("compiled", "onednn", "mkl")):  # packed per M: not one op
                fn = make(c, w, 1)
                if isinstance(fn, str) or (c == "mm_t" and dtype != "float32"):
                    continue  # mm_t in bf16 is a scalar path: minutes for 1,024 rows alone
                first = None
                for threads in args.threads:
                    torch.set_num_threads(threads)
                    with torch.no_grad():
                        rep, ys = row_bits_report(fn, x, BITS_M)
                    where = {key: spans([m for m, r in rep.items() if r[key] == 1.0])
                             for key in ("same_as_alone", "same_as_big", "same_after_roll")}
                    vs_first = "" if first is None else (
                        f"; same bits as threads={args.threads[0]} at M in {spans([m for m in ys if torch.equal(ys[m], first[m])])}")
                    first = first or ys
                    say(f"bits {dtype} {'/'.join(s['names'])} [{s['n']}, {s['k']}] {c} threads={threads}: every row equal to "
                        f"its M=1 result at M in {where['same_as_alone']}; to its M={max(BITS_M)} result at M in "
                        f"{where['same_as_big']}; position-independent at M in {where['same_after_roll']}{vs_first}")
                    results.append(dict(dtype=dtype, shape="/".join(s["names"]), candidate=c, threads=threads, per_m=rep))
    return results


def main(argv=None) -> None:
    args = parse_args(argv)
    lines = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    say(_roofline.describe_machine(_roofline.machine()) + f"; torch {torch.__version__}")
    say("figures are medians of round-robin runs on a possibly shared machine: read the ratios, not the GFLOP/s")
    data = dict(machine=_roofline.machine())
    threads0 = torch.get_num_threads()
    if "speed" in args.part:
        data["speed"] = speed(args, say)
    if "bits" in args.part:
        data["bits"] = bits(args, say)
    torch.set_num_threads(threads0)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "matmul_choices.json"), "w") as f:
            json.dump(data, f, indent=1)
        with open(os.path.join(args.out, "matmul_choices.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
