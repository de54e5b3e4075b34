"""Where a decode step of pagedgen goes on the device: torch.profiler over a few steps (issue 35 item 4).

    python benchmarks/gpu_profile.py --model random-1b --device cuda --workload sharegpt --num-prompts 512 --out DIR
    python benchmarks/gpu_profile.py --model ../shared/models/stories260K --device cpu --num-prompts 16 --steps 3

The workload and the engine settings are benchmarks/throughput.py's (its ``setup``: the same prompts,
per-request limits, KV cache size and max_num_seqs; greedy, ignore_eos), so the profiled steps are
steps of the end-to-end run. Every request is queued at once; steps run unprofiled until no request
waits (all admitted: the steps after that are decode steps, at the batch the workload then has) or
``--max-skip`` steps; then one warm-up step and ``--steps`` steps run under ``torch.profiler`` (CPU
and CUDA activity; CPU alone on the CPU), each in a ``record_function`` range ``pagedgen.step``; the
device is synchronised once, after the last (a step that overlaps the next keeps its overlap).

From the trace, which is never written out (``analyze``):
- per step: wall ms (host start of the step to the host start of the next; the last, to the end of
  its last work), device-busy ms (the union of the work intervals inside that window) and share,
  and its prefill and decode tokens (the scheduler's counters);
- the top kernels by device time over the profiled window (name, ms, calls, share of busy time);
- host gaps: the intervals inside the window when no work runs on the device (count, total, how
  many over 10 us / 100 us / 1 ms, the largest with the host operation running as each began).
On CUDA the work is the kernels, copies and memsets; on the CPU it is torch's outermost CPU ops, so
"busy" is the time in torch ops and the gaps are Python between them (tests run it so).

Writes ``gpu_profile.txt`` (the tables) and ``gpu_profile.json`` (the same numbers) to ``--out``.
"""
from __future__ import annotations

import argparse
import bisect
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

STEP = "pagedgen.step"  # the record_function range around one LLMEngine.step()
WORK_CATS = {"cuda": ("kernel", "gpu_memcpy", "gpu_memset"), "cpu": ("cpu_op",)}
HOST_CATS = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")
GAP_BINS_US = (10, 100, 1000)


def merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of [start, end) intervals, as sorted disjoint intervals."""
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def covered(merged: list[tuple[float, float]], start: float, end: float) -> float:
    """Length of [start, end) covered by ``merged`` (sorted, disjoint)."""
    total = 0.0
    i = max(0, bisect.bisect_right(merged, (start, float("inf"))) - 1)
    for s, e in merged[i:]:
        if s >= end:
            break
        total += max(0.0, min(e, end) - max(s, start))
    return total


def outermost(events: list[dict]) -> list[dict]:
    """The events not inside another one of the same thread (CPU ops nest: count each moment once)."""
    out, end_by_tid = [], {}
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        tid = e.get("tid")
        if e["ts"] >= end_by_tid.get(tid, float("-inf")):
            out.append(e)
            end_by_tid[tid] = e["ts"] + e["dur"]
    return out


def host_op_at(host: list[dict], t: float) -> str:
    """The innermost host event running at time ``t`` (the shortest that covers it)."""
    best = None
    for e in host:
        if e["ts"] <= t < e["ts"] + e["dur"] and (best is None or e["dur"] < best["dur"]):
            best = e
    if best is None:
        return "(no host event)"
    return best["name"] + (" (Python between torch ops)" if best["name"] == STEP else "")


def analyze(events: list[dict], device: str, top: int = 12, largest: int = 8) -> dict:
    """Step, kernel and gap figures of a Chrome trace's events (``traceEvents``), times in us.

    ``device``: "cuda" (the work is kernels, copies, memsets) or "cpu" (the outermost CPU ops).
    """
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]
    steps = sorted((e for e in complete if e.get("cat") == "user_annotation" and e.get("name") == STEP), key=lambda e: e["ts"])
    if not steps:
        raise ValueError(f"the trace holds no {STEP!r} range: nothing was profiled")
    work = [e for e in complete if e.get("cat") in WORK_CATS[device]]
    if device == "cpu":
        work = outermost(work)
    start = steps[0]["ts"]
    end = max([s["ts"] + s["dur"] for s in steps] + [e["ts"] + e["dur"] for e in work if e["ts"] >= start])
    work = [e for e in work if e["ts"] < end and e["ts"] + e["dur"] > start]
    busy = merge([(e["ts"], e["ts"] + e["dur"]) for e in work])
    bounds = [s["ts"] for s in steps] + [end]
    rows = []
    for i in range(len(steps)):
        wall, b = bounds[i + 1] - bounds[i], covered(busy, bounds[i], bounds[i + 1])
        rows.append(dict(wall_ms=wall / 1e3, busy_ms=b / 1e3, busy_share=b / wall if wall else 0.0,
                         host_ms=steps[i]["dur"] / 1e3))
    window = end - start
    busy_total = covered(busy, start, end)
    by_name: dict[str, list[float]] = {}
    for e in work:
        by_name.setdefault(e["name"], []).append(e["dur"])
    kernels = sorted(((n, sum(d), len(d)) for n, d in by_name.items()), key=lambda k: -k[1])
    work_sum = sum(k[1] for k in kernels) or 1.0
    idle, t = [], start
    for s, e in busy:
        if s > t:
            idle.append((t, min(s, end)))
        t = max(t, e)
    if t < end:
        idle.append((t, end))
    host = [e for e in complete if e.get("cat") in HOST_CATS]
    gaps = sorted(idle, key=lambda g: g[0] - g[1])[:largest]
    return dict(
        device=device, work="CUDA kernels, copies and memsets" if device == "cuda" else "torch CPU ops (outermost)",
        steps=rows, window_ms=window / 1e3, busy_ms=busy_total / 1e3, busy_share=busy_total / window if window else 0.0,
        top=[dict(name=n[:200], ms=d / 1e3, calls=c, share=d / work_sum) for n, d, c in kernels[:top]],
        num_kernels=sum(k[2] for k in kernels),
        gaps=dict(count=len(idle), idle_ms=sum(e - s for s, e in idle) / 1e3,
                  **{f"over_{b}us": sum(1 for s, e in idle if e - s > b) for b in GAP_BINS_US},
                  largest=[dict(at_ms=(s - start) / 1e3, ms=(e - s) / 1e3, host_op=host_op_at(host, s)[:160]) for s, e in gaps]),
    )


def describe(result: dict) -> str:
    """The analysis as small text tables."""
    a = result["analysis"]
    lines = [f"pagedgen steps under torch.profiler: {result['model']} ({result['dtype']}) on {result['device_name']}, "
             f"workload {result['workload']} ({result['num_prompts']} requests), {len(a['steps'])} steps profiled after "
             f"{result['skipped_steps']} unprofiled ({result['skip_reason']}); work = {a['work']}",
             f"{'step':>4} {'rows':>5} {'prefill':>7} {'wall ms':>9} {'host ms':>9} {'busy ms':>9} {'busy':>6}"]
    for i, (s, k) in enumerate(zip(a["steps"], result["step_tokens"])):
        lines.append(f"{i:>4} {k['rows']:>5} {k['prefill']:>7} {s['wall_ms']:>9.3f} {s['host_ms']:>9.3f} {s['busy_ms']:>9.3f} "
                     f"{s['busy_share']:>6.1%}")
    d = result["decode"]
    lines.append(f"decode steps: {d['steps']}, wall median {d['wall_ms_median']:.3f} ms, device busy median "
                 f"{d['busy_share_median']:.1%}; whole window {a['window_ms']:.3f} ms, busy {a['busy_share']:.1%}")
    lines.append(f"top work by device time ({a['num_kernels']:,} launches in the window; share of all work time):")
    for k in a["top"]:
        lines.append(f"  {k['ms']:>9.3f} ms {k['share']:>6.1%} {k['calls']:>6}x  {k['name'][:100]}")
    g = a["gaps"]
    lines.append(f"device idle: {g['count']:,} gaps, {g['idle_ms']:.3f} ms ({g['idle_ms'] / a['window_ms']:.1%} of the window); "
                 + ", ".join(f"{g[f'over_{b}us']} over {b} us" for b in GAP_BINS_US) + "; the largest:")
    for x in g["largest"]:
        lines.append(f"  {x['ms']:>9.3f} ms at +{x['at_ms']:.3f} ms, host in {x['host_op']}")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    import _workload

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random-1b", help=f"checkpoint folder or {' / '.join(_workload.RANDOM_MODELS)}")
    ap.add_argument("--dtype", default="auto", choices=["auto", *_workload.DTYPE_BYTES])
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--workload", default="sharegpt", choices=list(_workload.WORKLOADS))
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=None, help="largest per-request max_tokens (default: the workload's)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8, help="profiled steps (after one profiled warm-up step)")
    ap.add_argument("--max-skip", type=int, default=3000, help="at most this many unprofiled steps first")
    ap.add_argument("--out", default=os.environ.get("OUT") or "./gpu_results", help="folder for gpu_profile.txt/.json")
    args = ap.parse_args(argv)
    for name in ("num_prompts", "max_num_seqs", "steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_skip < 0:
        ap.error(f"--max-skip must be >= 0, got {args.max_skip}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    import _local_systems
    import _workload
    import throughput
    from pagedgen import SamplingParams

    targs = ["--model", args.model, "--dtype", args.dtype, "--device", args.device, "--workload", args.workload,
             "--num-prompts", str(args.num_prompts), "--max-num-seqs", str(args.max_num_seqs), "--systems", "pagedgen"]
    if args.max_tokens is not None:
        targs += ["--max-tokens", str(args.max_tokens), "--min-tokens", "1"]
    tsa = throughput.parse_args(targs)
    su = throughput.setup(tsa)
    model = _workload.ensure_random_model(args.model, su.info["dtype"])[0] if su.info["random"] else args.model
    job = dict(model=model, dtype=su.info["dtype"], device=args.device, seed=0, options=su.rows["pagedgen"][1])
    llm = _local_systems.pagedgen_llm(job)
    warm = _workload.warmup_prompts(su.prompts)
    llm.generate([{"prompt_token_ids": p} for p in warm], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    engine = llm.llm_engine
    for i, (p, m) in enumerate(zip(su.prompts, su.max_tokens)):
        engine.add_request(str(i), {"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
    scheduler = getattr(engine, "scheduler", None)
    stats = getattr(scheduler, "stats", None)

    def waiting() -> int:
        return len(getattr(scheduler, "waiting", ())) + len(getattr(scheduler, "swapped", ()))

    def counters() -> tuple[int, int]:
        return (getattr(stats, "num_prefill_tokens", 0), getattr(stats, "num_decode_tokens", 0))

    skipped, start = 0, time.perf_counter()
    while waiting() and skipped < args.max_skip and engine.has_unfinished_requests():
        engine.step()
        skipped += 1
    skip_reason = f"{'no request waiting' if not waiting() else f'--max-skip {args.max_skip}'}, {time.perf_counter() - start:.1f} s"
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    step_tokens = []
    with tempfile.TemporaryDirectory(prefix="pagedgen-profile-") as tmp:
        trace = os.path.join(tmp, "trace.json")
        with profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=args.steps, repeat=1),
                     on_trace_ready=lambda p: p.export_chrome_trace(trace)) as prof:
            for i in range(args.steps + 1):
                if not engine.has_unfinished_requests():
                    raise SystemExit(f"gpu_profile: the workload ended after {skipped + i} steps, before {args.steps} "
                                     f"profiled ones: use more --num-prompts or fewer --steps")
                before = counters()
                with record_function(STEP):
                    engine.step()
                after = counters()
                if i:  # the first is the profiler's warm-up step, not in the trace
                    step_tokens.append(dict(prefill=after[0] - before[0], rows=after[0] - before[0] + after[1] - before[1]))
                if i == args.steps:
                    sync()
                prof.step()
        with open(trace) as f:
            events = json.load(f)["traceEvents"]
    analysis = analyze(events, args.device)
    decode = [s for s, k in zip(analysis["steps"], step_tokens) if k["prefill"] == 0] if stats is not None else analysis["steps"]
    result = dict(model=args.model, dtype=su.info["dtype"], device=args.device, workload=args.workload, num_prompts=args.num_prompts,
                  device_name=torch.cuda.get_device_name(0) if args.device == "cuda" else "the CPU",
                  torch=torch.__version__, skipped_steps=skipped, skip_reason=skip_reason, step_tokens=step_tokens,
                  decode=dict(steps=len(decode), wall_ms_median=statistics.median([s["wall_ms"] for s in decode]) if decode else 0.0,
                              busy_share_median=statistics.median([s["busy_share"] for s in decode]) if decode else 0.0),
                  analysis=analysis)
    text = describe(result)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_profile.json"), "w") as f:
        json.dump(result, f, indent=2)
    with open(os.path.join(args.out, "gpu_profile.txt"), "w") as f:
        f.write(text + "\n")
    print(f"wrote {args.out}/gpu_profile.txt and gpu_profile.json")


if __name__ == "__main__":
    main()
