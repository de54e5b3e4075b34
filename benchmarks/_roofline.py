"""The matmul roofline of a throughput run: this machine's FLOP/s at the model's own GEMM shapes.

A decoder forward is, in FLOPs, almost all weight matmuls. For a Llama with L layers, hidden size h,
H query heads and KV key/value heads of size d, intermediate size I and vocabulary V, the weight
shapes [N, K] (``F.linear(x, W)`` with x: [M, K], W: [N, K]) are taken in the fused layout that both
pagedgen and vLLM run (vLLM's QKVParallelLinear / MergedColumnParallelLinear): per layer qkv_proj
[(H + 2·KV)·d, h], o_proj [h, H·d], gate_up_proj [2·I, h], down_proj [h, I]; then lm_head [V, h].
Parameters touched per token row: W = L · Σ_layer N·K (the embedding lookup is a gather, no FLOPs);
the lm_head's W_head = V·h runs only on the rows that sample a token.

For a workload of requests i with prompt p_i tokens and m_i output tokens (exact, ignore_eos):

    prefill rows  P = Σ p_i            decode rows  D = Σ (m_i - 1)       sampled rows  O = Σ m_i
    FLOPs         = 2·W·(P + D) + 2·W_head·O                       (attention scores not counted)
    roofline time = Σ_shapes 2·N·K·c·(P / F(N,K; M_prefill) + D / F(N,K; M_decode))
                    + 2·W_head·O / F(V,h; M_decode)
    roofline tok/s = O / roofline time;  share = measured output tok/s / roofline tok/s

with c the shape's count per token row (layers × uses per layer) and F(N, K; M) the FLOP/s measured
here at M rows for the run's dtype (median of several timed runs), the best of the matmul paths
available for it (``matmul_paths``: ``F.linear`` in the dtype, for bf16/fp16 also a multiply
in fp32 with fp32 weights kept, which is ~8x faster on CPUs without AVX-512 BF16 or AMX, on x86
CPUs oneDNN's inner product on prepacked fp32 weights, 1.2-4x ``F.linear`` at 4-64 rows, and where
pagedgen._C has it, pagedgen's own GEMM on weights packed in panels). The path
each shape's figure came from is reported with it. M_decode is
the decode batch (min(max_num_seqs, requests)); M_prefill a prefill chunk (min(step token budget,
P, 1,024): FLOP/s barely change past 1,024 rows). The last output token of a request is never fed back, so
it costs no forward row. Prefix-cache hits are not subtracted (an upper bound on the work).

That figure charges every decode row at the full batch M_decode, but a workload whose requests
have different max_tokens cannot keep the batch full: as requests finish, fewer rows exist (with 48
requests of 16-256 tokens the last steps run a handful of rows, where a CPU GEMM is bound by reading
the weights, not by FLOPs). The second figure, the batch-profile roofline, runs the same matmuls at
the batches the workload itself allows: ideal continuous batching (``decode_batch_profile``: every
free slot refilled at once, prefill free of steps) gives the number of decode steps at each batch
M, and each step costs each shape's product at M rows, measured at powers of two up to M_decode
(``decode_grid``) and interpolated between them. Both are printed; the full-batch one is an upper
bound no engine reaches on such a workload, the batch-profile one is what a perfect engine with
these matmuls would do.

Trust (issue 36 item 3): a rate measured while another process takes the cores is too low, and a
roofline built on it too low, so a share of it too high (a run with another process on the machine
once printed 0.10 GFLOP/s for a [576, 576] product and shares of 82-112%). So ``measure`` runs with
the thread count fixed for the whole measurement, warms each (shape, M, path) up for
``warmup_seconds`` before timing it, keeps the spread of its timed runs (max / min), times the large
``torch.mm`` before and after the shapes (and in float32 too for a reduced-precision run: the peak a
GEMM that computes in float32 can reach), and reads the machine's load (load average, and the CPU
use of the other processes) before and after. ``problems`` lists what makes the run implausible: a
rate far above the large-mm peak or far below it, a huge spread on the path the roofline takes, the
two mm timings far apart, other processes busy on the machine. throughput.py prints them and no roofline share when there are any.
"""
from __future__ import annotations

import heapq
import math
import os
import statistics
import subprocess
import time

FORMULA = ("roofline: FLOPs = 2*W*(P + D) + 2*W_head*O, W = weights per token row, W_head = vocab*hidden, "
           "P = prompt tokens, D = sum(max_tokens - 1), O = output tokens; time = each GEMM shape's FLOPs / its "
           "measured FLOP/s on the best matmul path for the dtype (M_prefill rows for P, M_decode rows for D and the lm_head); "
           "roofline tok/s = O / time; batch-profile roofline: decode steps at the batches of ideal continuous "
           "batching of the workload (requests leave as their max_tokens run out), each GEMM at its step's rows")
#: a run is implausible (``problems``) when: a shape's rate is over MAX_OVER_PEAK x the large-mm peak or
#: under the peak / MIN_UNDER_PEAK; its timed runs spread over MAX_SPREAD (max / min); the mm before and
#: after differ by more than MAX_MM_DRIFT (ratio); the other processes took over MAX_OTHERS_BUSY of the
#: machine's CPU time (the 1-minute load average is printed only: it lags, counting the run before)
MAX_OVER_PEAK, MIN_UNDER_PEAK, MAX_SPREAD, MAX_MM_DRIFT, MAX_OTHERS_BUSY = 1.5, 1000.0, 2.0, 1.5, 0.25
PREFILL_CHUNK = 1024  # rows: the largest M measured for prefill
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


def gemm_shapes(cfg: dict) -> list[dict]:
    """Distinct fused weight shapes of a Llama config: [dict(names, n, k, count, lm_head)], count per token row."""
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    d = cfg.get("head_dim") or h // heads
    inter = cfg["intermediate_size"]
    per_layer = [("qkv_proj", (heads + 2 * kv) * d, h), ("o_proj", h, heads * d), ("gate_up_proj", 2 * inter, h),
                 ("down_proj", h, inter)]
    shapes: dict[tuple[int, int], dict] = {}
    for name, n, k in per_layer:
        s = shapes.setdefault((n, k), dict(names=[], n=n, k=k, count=0, lm_head=False))
        s["names"].append(name)
        s["count"] += layers
    out = list(shapes.values())
    out.append(dict(names=["lm_head"], n=cfg["vocab_size"], k=h, count=1, lm_head=True))
    return out


def weights_per_row(shapes: list[dict]) -> tuple[int, int]:
    """(W: layer weights touched per token row, W_head: lm_head weights per sampled row), parameters."""
    return (sum(s["n"] * s["k"] * s["count"] for s in shapes if not s["lm_head"]),
            sum(s["n"] * s["k"] for s in shapes if s["lm_head"]))


def workload_rows(prompt_lens: list[int], max_tokens: list[int]) -> dict:
    """P (prefill rows), D (decode rows) and O (sampled rows = output tokens) of a workload."""
    return dict(P=sum(prompt_lens), D=sum(m - 1 for m in max_tokens), O=sum(max_tokens))


def workload_flops(shapes: list[dict], rows: dict) -> int:
    """FLOPs = 2·W·(P + D) + 2·W_head·O."""
    w, w_head = weights_per_row(shapes)
    return 2 * w * (rows["P"] + rows["D"]) + 2 * w_head * rows["O"]


def roofline_tokens_per_s(shapes: list[dict], rows: dict, flops_per_s: dict, m_prefill: int, m_decode: int) -> float:
    """Output tokens/s the measured FLOP/s allow. ``flops_per_s[(n, k, m)]``: matmul FLOP/s at M = m (the best path)."""
    seconds = 0.0
    for s in shapes:
        flops_row = 2 * s["n"] * s["k"] * s["count"]
        if s["lm_head"]:
            seconds += flops_row * rows["O"] / flops_per_s[(s["n"], s["k"], m_decode)]
        else:
            seconds += flops_row * (rows["P"] / flops_per_s[(s["n"], s["k"], m_prefill)]
                                    + rows["D"] / flops_per_s[(s["n"], s["k"], m_decode)])
    return rows["O"] / seconds


def decode_batch_profile(max_tokens: list[int], max_num_seqs: int) -> dict[int, int]:
    """{M: number of decode steps run at batch M} of ideal continuous batching of the workload
    (Orca / paper 4.2: iteration-level scheduling): requests join in order as soon as one of
    ``max_num_seqs`` slots is free, their prefill costing no step, and each leaves after its
    m_i - 1 decode rows. Σ M · steps = D. The batch shrinks as requests of different max_tokens
    finish: rows that do not exist cannot be batched by any engine."""
    remaining = [m - 1 for m in max_tokens if m > 1]
    profile: dict[int, int] = {}
    running: list[int] = []  # heap of the step at which each running request leaves
    step, nxt = 0, 0
    while nxt < len(remaining) or running:
        while nxt < len(remaining) and len(running) < max_num_seqs:
            heapq.heappush(running, step + remaining[nxt])
            nxt += 1
        leave = running[0]
        profile[len(running)] = profile.get(len(running), 0) + leave - step
        step = leave
        while running and running[0] == step:
            heapq.heappop(running)
    return profile


def decode_grid(m_decode: int) -> list[int]:
    """Batch sizes at which decode FLOP/s are measured for the batch-profile roofline: powers of two
    below ``m_decode``, and ``m_decode``; other sizes interpolate (``call_seconds``)."""
    return sorted({m for m in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if m < m_decode} | {m_decode})


def call_seconds(flops_per_s: dict, n: int, k: int, m: int, grid: list[int]) -> float:
    """Seconds of one [m, k] x [n, k]^T product: measured at the grid sizes, linear in m between
    them (a GEMM's time grows piecewise-linearly with its rows), flat-rate beyond the grid."""
    def at(g: int) -> float:
        return 2 * n * k * g / flops_per_s[(n, k, g)]

    if m in grid:
        return at(m)
    lo = max((g for g in grid if g < m), default=None)
    hi = min((g for g in grid if g > m), default=None)
    if lo is None or hi is None:
        g = hi if lo is None else lo
        return at(g) * m / g
    return at(lo) + (at(hi) - at(lo)) * (m - lo) / (hi - lo)


def roofline_profile_tokens_per_s(shapes: list[dict], rows: dict, flops_per_s: dict, m_prefill: int,
                                  profile: dict[int, int], grid: list[int]) -> float:
    """Output tokens/s the measured FLOP/s allow when decode runs at the workload's own batch
    profile (``decode_batch_profile``) instead of a full batch: prefill rows at ``m_prefill`` as in
    ``roofline_tokens_per_s``; each decode step at batch M costs each shape's product at M rows
    (``call_seconds``), its lm_head too; the first token of each request (sampled at the end of
    its prefill: O - D rows) costs lm_head rows at the largest grid size."""
    seconds = 0.0
    first_tokens = rows["O"] - rows["D"]
    for s in shapes:
        n, k, c = s["n"], s["k"], s["count"]
        decode = sum(steps * call_seconds(flops_per_s, n, k, m, grid) for m, steps in profile.items())
        if s["lm_head"]:
            seconds += decode + first_tokens * call_seconds(flops_per_s, n, k, grid[-1], grid) / grid[-1]
        else:
            seconds += c * (2 * n * k * rows["P"] / flops_per_s[(n, k, m_prefill)] + decode)
    return rows["O"] / seconds


def gemm_rows(max_num_seqs: int, num_requests: int, step_budget: int, prompt_tokens: int) -> tuple[int, int]:
    """(M_prefill, M_decode): a prefill chunk's rows and the decode batch's rows."""
    return max(1, min(step_budget, PREFILL_CHUNK, prompt_tokens)), max(1, min(max_num_seqs, num_requests))


def _timed_flops(fn, flops: float, sync, runs: int, min_seconds: float, budget_seconds: float,
                 warmup_seconds: float = 0.0) -> list[float]:
    """FLOP/s of ``fn`` in each of ``runs`` timed runs, each repeating it for >= ``min_seconds``, after
    a warm-up of >= ``warmup_seconds`` (at least one call: first-call allocation and dispatch)."""
    start = time.perf_counter()
    while True:
        fn()
        sync()
        if time.perf_counter() - start >= warmup_seconds:
            break
    start = time.perf_counter()
    fn()
    sync()
    one = max(time.perf_counter() - start, 1e-7)
    reps = max(1, math.ceil(min_seconds / one))
    runs = max(1, min(runs, int(budget_seconds / (one * reps))))  # a very slow path gets fewer runs
    rates = []
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        rates.append(flops * reps / (time.perf_counter() - start))
    return rates


def machine_load() -> dict:
    """The machine's load now: the 1-minute load average and the share of all CPUs' time the other
    processes took over the last 0.2 s (psutil; None where it is not installed)."""
    load = dict(loadavg=os.getloadavg()[0] if hasattr(os, "getloadavg") else None, others_busy=None, cores=os.cpu_count())
    try:
        import psutil
    except ImportError:
        return load
    me = psutil.Process()
    mine = me.cpu_times()
    total = psutil.cpu_percent(interval=0.2) / 100  # share of all CPUs busy over the interval
    used = sum(me.cpu_times()[:2]) - sum(mine[:2])  # this process's CPU seconds meanwhile
    load["others_busy"] = max(0.0, total - used / (0.2 * (os.cpu_count() or 1)))
    return load


def problems(flops: dict) -> list[str]:
    """What makes a ``measure`` result implausible (see the module docstring); [] when nothing does."""
    out = []
    peak = flops["peak"]
    for path, table in flops["by_path"].items():
        for (n, k, m), rate in table.items():
            if rate > MAX_OVER_PEAK * peak:
                out.append(f"{path} [{n}, {k}] at M={m}: {rate / 1e9:.3g} GFLOP/s, over {MAX_OVER_PEAK}x the large-mm peak {peak / 1e9:.3g}")
    for key, best in flops["linear"].items():
        if best < peak / MIN_UNDER_PEAK:
            n, k, m = key
            out.append(f"[{n}, {k}] at M={m}: best {best / 1e9:.3g} GFLOP/s, under 1/{MIN_UNDER_PEAK:.0f} of the large-mm peak {peak / 1e9:.3g}")
    for path, table in flops["spread"].items():
        for (n, k, m), spread in table.items():
            # only the path the roofline takes for the shape counts: a noisy slower path changes nothing
            if spread > MAX_SPREAD and flops["by_path"].get(path, {}).get((n, k, m)) == flops["linear"].get((n, k, m)):
                out.append(f"{path} [{n}, {k}] at M={m}: timed runs spread {spread:.2f}x (max / min), over {MAX_SPREAD}x")
    before, after = flops["mm_before"], flops["mm_after"]
    if max(before, after) > MAX_MM_DRIFT * min(before, after):
        out.append(f"torch.mm before / after the shapes: {before / 1e9:.3g} / {after / 1e9:.3g} GFLOP/s, over {MAX_MM_DRIFT}x apart")
    for when, load in flops["load"].items():
        if load.get("others_busy") is not None and load["others_busy"] > MAX_OTHERS_BUSY:
            out.append(f"machine busy {when}: other processes took {load['others_busy']:.0%} of the CPUs (over {MAX_OTHERS_BUSY:.0%})")
        # The load average is printed, not judged: it lags by a minute, so it still counts the run
        # before this one (and, after the shapes, this measurement's own threads). Others' CPU use,
        # sampled over the check, is what tells a busy machine.
    return out


def _median_flops(fn, flops: float, sync, runs: int, min_seconds: float, budget_seconds: float) -> float:
    """Median FLOP/s of ``fn`` over ``runs`` timed runs (``_timed_flops``)."""
    return statistics.median(_timed_flops(fn, flops, sync, runs, min_seconds, budget_seconds))


def matmul_paths(dtype: str, device: str = "cpu") -> list[str]:
    """The ways a [M, K] x [N, K]^T product in ``dtype`` can run here (``PATHS``). In bf16/fp16 on a
    CPU without fast bf16 GEMMs (no AVX-512 BF16 / AMX: torch's own reduced-precision kernel is a dot
    product per output element) an engine can keep fp32 copies of the weights and multiply in fp32;
    on an x86 CPU with oneDNN it can also prepack fp32 weights for oneDNN's inner product (pagedgen
    and vLLM's CPU backend do), and on a CPU with oneDNN bf16 (AMX, AVX-512 BF16) prepack the bf16
    weights themselves. Where pagedgen._C has its own GEMM (``packed_linear``: AVX2 builds), the
    weights packed in panels in the run's dtype are a path too, and for bf16 where it has
    ``packed_linear_bf16`` (AVX512-BF16 builds) the weights packed in bf16 pairs, and where the CPU has
    AMX and the amx level is loaded (``cpu_has_amx``) the same pairs on AMX tiles (``packed_linear_bf16_amx``,
    the default there). The roofline takes, per shape, the best path, so that no engine beats it by picking another."""
    import torch

    from pagedgen import ops
    from pagedgen.layers.matmul import cpu_has_amx, native_reduced_precision, onednn_prepack_supported

    paths = ["F.linear", "fp32 weights"] if dtype in ("bfloat16", "float16") else ["F.linear"]
    if device != "cpu":
        return paths
    if ops.has_kernel("packed_linear"):
        paths = paths + ["pagedgen panels"]
    if dtype == "bfloat16" and ops.has_kernel("packed_linear_bf16"):
        paths = paths + ["pagedgen bf16 pairs"]
    if dtype == "bfloat16" and cpu_has_amx():
        paths = paths + ["pagedgen AMX"]
    if not onednn_prepack_supported():
        return paths
    paths = paths + ["oneDNN prepacked"]
    return paths + ["oneDNN prepacked bf16"] if dtype == "bfloat16" and native_reduced_precision(torch.bfloat16) else paths


PATHS = {
    "F.linear": "F.linear(x, W) in the run's dtype",
    "fp32 weights": "F.linear(x.float(), W32).to(dtype) with an fp32 copy W32 of the weights kept (conversions timed)",
    "oneDNN prepacked": "oneDNN's inner product on fp32 weights prepacked once (pagedgen.layers.matmul.prepack), x converted to fp32 and back",
    "oneDNN prepacked bf16": "oneDNN's inner product on the bf16 weights prepacked once (pagedgen.layers.matmul.prepack)",
    "pagedgen panels": "pagedgen's own GEMM (pagedgen.ops.packed_linear) on the weights packed once in panels in the run's dtype (pagedgen.layers.matmul.pack_panels)",
    "pagedgen bf16 pairs": "pagedgen's AVX512-BF16 GEMM (pagedgen.ops.packed_linear_bf16) on the bf16 weights packed once in pairs (pagedgen.layers.matmul.pack_pairs)",
    "pagedgen AMX": "pagedgen's AMX GEMM (packed_linear_bf16_amx, self-checked) on the same bf16 pairs",
}


def _path_fn(path: str, x, w, w32):
    """The timed call of ``path``; ``w32``: the fp32 copy, or for "oneDNN prepacked" (bf16) the
    packed fp32 (bf16) weight, for "pagedgen panels" the weight in panels, for "pagedgen bf16
    pairs" the weight in pairs."""
    import torch.nn.functional as F

    from pagedgen.layers.matmul import MatmulConfig, amx_self_check, linear

    if path == "pagedgen AMX":
        amx_self_check()  # the check the engine runs before its first use

    if path == "F.linear":
        return lambda: F.linear(x, w)
    if path == "fp32 weights":
        return lambda: F.linear(x.float(), w32).to(x.dtype)
    # pagedgen's own call on the packed weight, conversions included
    config = MatmulConfig(x.dtype, pairs=True, amx=True) if path == "pagedgen AMX" else None
    return lambda: linear(x, w32, None, config, w.shape[0])


def measure(shapes: list[dict], m_prefill: int, m_decode: int, dtype: str, device: str = "cpu",
            runs: int = 7, min_seconds: float = 0.02, budget_seconds: float = 3.0, paths: list[str] | None = None,
            m_grid: list[int] | None = None, warmup_seconds: float = 0.05, threads: int | None = None) -> dict:
    """FLOP/s of every matmul path (``matmul_paths``) at every shape and M the roofline needs, the
    best path of each, and torch.mm as a reference, with what is needed to trust them (the module
    docstring, "Trust"). ``m_grid``: more decode batch sizes to measure (``decode_grid``, for the
    batch-profile roofline), besides ``m_decode``. ``threads``: torch threads for the whole
    measurement (default: the current count; restored after).

    Returns dict(linear={(n, k, m): best FLOP/s}, best_path={(n, k, m): path name},
    by_path={path: {(n, k, m): FLOP/s (median)}}, spread={path: {(n, k, m): max / min of the timed
    runs}}, mm=(size, FLOP/s), mm_before, mm_after (the run's dtype), peak (the larger of those and,
    for bf16/fp16, the float32 mm), load={"before": machine_load(), "after": ...}, threads,
    problems=problems(...)). torch.mm is square, 2048 per side, or 1024 / 512 where a 2048 multiply
    would take over ``budget_seconds`` (slow bf16 paths).
    """
    import torch

    from pagedgen.layers.matmul import pack_pairs, pack_panels, prepack

    dt = getattr(torch, dtype)
    paths = paths or matmul_paths(dtype, device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    gen = torch.Generator(device="cpu").manual_seed(0)
    threads0 = torch.get_num_threads()
    threads = threads or threads0
    torch.set_num_threads(threads)  # the same thread count for every figure of the run

    def mm_flops(mm_dtype) -> tuple[int, float]:
        probe = None
        for size in (512, 1024, 2048):
            if probe is not None and 2 * size**3 / probe > budget_seconds:
                break
            a = torch.randn(size, size, generator=gen).to(device=device, dtype=mm_dtype)
            b = torch.randn(size, size, generator=gen).to(device=device, dtype=mm_dtype)
            probe = statistics.median(_timed_flops(lambda: torch.mm(a, b), 2 * size**3, sync, runs, min_seconds, budget_seconds, warmup_seconds))
            result = (size, probe)
        return result

    try:
        load_before = machine_load()
        size, mm_before = mm_flops(dt)
        by_path: dict[str, dict] = {p: {} for p in paths}
        spread: dict[str, dict] = {p: {} for p in paths}
        for s in shapes:
            w = torch.randn(s["n"], s["k"], generator=gen).to(device=device, dtype=dt)  # [N, K]
            prepared = {  # each path's weight, made once as an engine would
                "fp32 weights": w.float() if "fp32 weights" in paths else None,  # [N, K] float32
                "oneDNN prepacked": prepack(w.float()) if "oneDNN prepacked" in paths else None,  # [N, K] oneDNN layout
                "oneDNN prepacked bf16": prepack(w) if "oneDNN prepacked bf16" in paths else None,  # [N, K] bf16, oneDNN layout
                "pagedgen panels": pack_panels(w) if "pagedgen panels" in paths else None,  # [ceil(N / 16), K, 16]
                "pagedgen bf16 pairs": pack_pairs(w) if "pagedgen bf16 pairs" in paths else None,  # [ceil(N / 16), ceil(K / 2), 16, 2]
                "pagedgen AMX": pack_pairs(w) if "pagedgen AMX" in paths else None,  # the same pairs
            }
            decode_ms = {m_decode} | set(m_grid or ())
            for m in sorted(decode_ms if s["lm_head"] else decode_ms | {m_prefill}):
                x = torch.randn(m, s["k"], generator=gen).to(device=device, dtype=dt)  # [M, K]
                for path in paths:
                    fn = _path_fn(path, x, w, prepared.get(path))
                    rates = _timed_flops(fn, 2 * m * s["n"] * s["k"], sync, runs, min_seconds, budget_seconds, warmup_seconds)
                    by_path[path][(s["n"], s["k"], m)] = statistics.median(rates)
                    spread[path][(s["n"], s["k"], m)] = max(rates) / min(rates)
            del prepared
        _, mm_after = mm_flops(dt)
        peak = max(mm_before, mm_after)
        if dt != torch.float32 and device == "cpu":  # a GEMM that computes in float32 (fp32 weights, panels) can reach this
            peak = max(peak, mm_flops(torch.float32)[1])
        load_after = machine_load()
    finally:
        torch.set_num_threads(threads0)
    keys = list(by_path[paths[0]])
    best_path = {key: max(paths, key=lambda p: by_path[p][key]) for key in keys}
    linear = {key: by_path[best_path[key]][key] for key in keys}
    out = dict(linear=linear, best_path=best_path, by_path=by_path, spread=spread, mm=(size, max(mm_before, mm_after)),
               mm_before=mm_before, mm_after=mm_after, peak=peak, load=dict(before=load_before, after=load_after), threads=threads)
    out["problems"] = problems(out)
    return out


def layer_weights_per_token(cfg: dict) -> int:
    """Weights one token row multiplies through the layers (no embedding, no lm_head / pooler head),
    parameters, from a config.json: BERT / XLM-R encoders (q, k, v, o [h, h], intermediate [I, h],
    output [h, I] per layer) or a Llama-shaped decoder (``gemm_shapes``)."""
    if cfg.get("model_type") in ("bert", "xlm-roberta", "roberta"):
        h, inter = cfg["hidden_size"], cfg["intermediate_size"]
        return cfg["num_hidden_layers"] * (4 * h * h + 2 * h * inter)
    return weights_per_row(gemm_shapes(cfg))[0]


def matmul_peak(dtype: str, device: str = "cpu") -> dict:
    """This machine's matmul peak now, what a benchmark's "share of the matmul peak" divides by:
    ``measure`` with no shapes, i.e. torch.mm FLOP/s (square, in ``dtype``, before and after; for
    bf16/fp16 on a CPU also float32, which a GEMM computing in float32 reaches). Returns measure's
    dict (``peak`` in FLOP/s, ``problems``, ``load``)."""
    return measure([], 1, 1, dtype, device)


def share_line(name: str, flops: float, seconds: float, peak: dict) -> str:
    """One line: ``flops`` of model matmuls in ``seconds`` as GFLOP/s and a share of ``peak["peak"]``."""
    rate = flops / seconds
    return f"  {name}: {rate / 1e9:,.1f} GFLOP/s of model matmuls, {rate / peak['peak']:.1%} of the matmul peak {peak['peak'] / 1e9:,.1f} GFLOP/s"


def machine(device: str = "cpu") -> dict:
    """CPU model name, the matmul-relevant CPU flags, core count, torch threads and CPU capability."""
    import torch

    name, flags = "unknown", set()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Model name":
                name = value.strip()
            elif key.strip() == "Flags":
                flags = set(value.split())
    except (OSError, subprocess.SubprocessError):
        pass
    info = dict(cpu=name, flags={f: f in flags for f in CPU_FLAGS}, cores=os.cpu_count(),
                torch_threads=torch.get_num_threads(), capability=torch.backends.cpu.get_cpu_capability(),
                onednn_bf16=bool(getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)()))
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "none available"
    return info


def describe_machine(info: dict) -> str:
    flags = ", ".join(f"{f} {'yes' if v else 'no'}" for f, v in info["flags"].items())
    gpu = f"; GPU {info['gpu']}" if "gpu" in info else ""
    return (f"machine: {info['cpu']}, {info['cores']} CPUs ({flags}); torch CPU capability {info['capability']}, "
            f"oneDNN bf16 {'yes' if info['onednn_bf16'] else 'no'}, {info['torch_threads']} torch threads{gpu}")
