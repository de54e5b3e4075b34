"""The W8A8 int8 GEMM per path and M (issue 46/47): int8_linear (AVX2 tiles) against int8_linear_amx
(AMX-INT8 tiles) on the random-135m and random-1b weight shapes, to set INT8_AMX_MIN_ROWS
(pagedgen/layers/matmul/int8_amx.py): the smallest M from which the AMX path is faster at every shape;
and both against the GEMM a bf16 model runs on this CPU (``choose_matmul``'s path, weights prepared as
the engine prepares them): the kernel-level bound of issue 46's W8A8 / bf16 speed target.

    python benchmarks/int8_gemm.py                                   # both models, M = 1 .. 512, all threads
    python benchmarks/int8_gemm.py --models random-135m --rows 1,8,16,32 --threads 1

Per shape [N, K] and M: median GFLOP/s of each path over --rounds interleaved rounds (one call of each
in turn, so a shared machine's drift hits both alike), the weight out of the caches when --cold weights
of the shape are cycled through (a model's layers are). Every output is also checked bit for bit against
int8_linear's. Needs a CPU with AMX-INT8 and the amx level's kernels for the AMX column (else only the
AVX2 one is timed). Quiet machines only; name the kind the figures come from.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import _roofline
import _workload
from pagedgen import ops
from pagedgen.layers import matmul as lin


def timed(fn, reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="random-135m,random-1b")
    ap.add_argument("--rows", default="1,2,4,8,12,16,24,32,64,128,256,512")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: as set)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--cold", type=int, default=8, help="weights of each shape cycled through (cold caches)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    amx = lin.cpu_has_amx_int8()
    if amx:
        lin.int8_amx_self_check()
    print(_roofline.describe_machine(_roofline.machine()), f"| CPU kernels {ops.cpu_isa()}, AMX-INT8 {amx}, {torch.get_num_threads()} threads")
    paths = {"avx2": torch.ops.pagedgen.int8_linear}
    if amx:
        paths["amx"] = torch.ops.pagedgen.int8_linear_amx
    bf16 = lin.choose_matmul(torch.bfloat16, torch.device("cpu"), batch_invariant=True)  # the bf16 model's GEMM here
    print(f"bf16 baseline: {bf16.reason}")
    results, g = [], torch.Generator().manual_seed(0)
    for model in args.models.split(","):
        src = _workload.ensure_random_model(model, "bfloat16")[0]
        shapes = _roofline.gemm_shapes(json.load(open(f"{src}/config.json")))
        for n, k in sorted({(s["n"], s["k"]) for s in shapes if not s["lm_head"]}):  # the lm_head stays bf16 in int8 models
            ws = torch.rand(n, generator=g) * 0.01
            weights = [lin.pack_int8(torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)) for _ in range(args.cold)]
            floats = []  # the bf16 weights, prepared as the engine prepares a bf16 model's
            for _ in range(args.cold):
                layer = torch.nn.Module()
                layer.weight, layer.bias, layer.matmul = torch.nn.Parameter(torch.randn(n, k, generator=g).bfloat16(), requires_grad=False), None, None
                lin.prepare_matmuls(layer, bf16)
                floats.append(layer.weight)
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k, generator=g).bfloat16()
                outs = {p: torch.empty(m, n, dtype=torch.bfloat16) for p in paths}
                turn = {p: 0 for p in [*paths, "bf16"]}

                def call(p):
                    turn[p] = (turn[p] + 1) % len(weights)
                    if p == "bf16":
                        lin.linear(x, floats[turn[p]], None, bf16, n)
                    else:
                        paths[p](outs[p], x, weights[turn[p]], ws, None, None)

                times = {p: [] for p in [*paths, "bf16"]}
                reps = max(1, int(2e8 // (2 * m * n * k)))
                for _ in range(args.rounds):
                    for p in times:
                        times[p].append(timed(lambda: call(p), reps))
                for p in paths:  # the same weight: the same bits
                    paths[p](outs[p], x, weights[0], ws, None, None)
                same = all(torch.equal(outs[p].view(torch.int16), outs["avx2"].view(torch.int16)) for p in paths)
                row = {"model": model, "n": n, "k": k, "m": m, "same_bits": same,
                       **{f"{p}_gflops": 2 * m * n * k / statistics.median(t) / 1e9 for p, t in times.items()}}
                results.append(row)
                ratio = f", amx / avx2 {row['amx_gflops'] / row['avx2_gflops']:.2f}x" if amx else ""
                best = max(row[f"{p}_gflops"] for p in paths)
                print(f"{model} N={n} K={k} M={m}: " + ", ".join(f"{p} {row[f'{p}_gflops']:.1f} GFLOP/s" for p in times)
                      + ratio + f", int8 / bf16 {best / row['bf16_gflops']:.2f}x" + ("" if same else "  BITS DIFFER"), flush=True)
    if amx:
        faster = {m for m in {r["m"] for r in results} if all(r["amx_gflops"] > r["avx2_gflops"] for r in results if r["m"] == m)}
        slower = [m for m in {r["m"] for r in results} if m not in faster]
        print(f"AMX faster at every shape from M = {min((m for m in faster if m > max(slower, default=0)), default=None)} "
              f"(INT8_AMX_MIN_ROWS is {lin.INT8_AMX_MIN_ROWS})")
    if args.out:
        json.dump({"cpu": _roofline.machine(), "threads": torch.get_num_threads(), "results": results}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
