"""Decode-attention kernel benchmark: pagedgen's paged_attention against
torch.nn.functional.scaled_dot_product_attention (enable_gqa) on a contiguous cache holding the same
keys and values, one query token per sequence.

For each (batch, context): the time per call, as the median over rounds of (CUDA events around
the replay of a CUDA graph of --repeat calls) / --repeat, after warm-up; the calls rotate over
enough copies of the caches that the inputs are never L2-resident (eager calls if graph capture
fails). Then the bytes of K and V read per call over that time, that as a fraction of the measured
device-to-device copy bandwidth (a large tensor copy, bytes read + written over its time), and the
paged / contiguous time ratio. Cases whose caches do not fit the free memory are skipped.

    python benchmarks/kernels.py                # the full grid, results to $OUT or ./gpu_results
    python benchmarks/kernels.py --quick        # a smaller grid, fewer repeats
    python benchmarks/kernels.py --dry-run      # check the arguments, print the cases (no GPU)

Writes kernels.json and kernels.txt to --out.
"""
import argparse
import json
import math
import os
import platform
import sys
import time

DTYPES = ("bfloat16", "float16", "float32")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT") or "./gpu_results", help="results folder (default: $OUT, else ./gpu_results)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--context", type=int, nargs="+", default=[512, 2048, 8192, 32768])
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--memory-fraction", type=float, default=0.85, help="share of free GPU memory a case may use")
    p.add_argument("--quick", action="store_true", help="batch 1 and 64, context 512 and 8192, 10 repeats")
    p.add_argument("--dry-run", action="store_true", help="validate the arguments, print the cases, exit (no GPU)")
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.context, args.repeat, args.warmup = [1, 64], [512, 8192], 10, 3
    for name in ("batch", "context"):
        if any(v <= 0 for v in getattr(args, name)):
            p.error(f"--{name} values must be positive")
    for name in ("num_heads", "num_kv_heads", "head_size", "block_size", "repeat"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.num_heads % args.num_kv_heads:
        p.error("--num-heads must be a multiple of --num-kv-heads")
    if not 0 < args.memory_fraction <= 1:
        p.error("--memory-fraction must be in (0, 1]")
    return args


def element_size(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


def kv_bytes(args, batch: int, context: int) -> int:
    """Bytes of K and V one call reads: batch x context tokens x KV heads x head size, twice."""
    return 2 * batch * context * args.num_kv_heads * args.head_size * element_size(args.dtype)


L2_BYTES = 60 << 20  # H200; copies() only needs the order of magnitude


def copies(args, batch: int, context: int) -> int:
    """Cache copies the timed calls rotate over, so that they read at least 4x the L2 size."""
    return min(64, max(1, math.ceil(4 * L2_BYTES / kv_bytes(args, batch, context))))


def case_memory(args, batch: int, context: int) -> int:
    """Peak bytes of one case: the paged and contiguous caches of every copy, plus one cache-sized
    gather temporary."""
    blocks = batch * math.ceil(context / args.block_size)
    paged = 2 * blocks * args.block_size * args.num_kv_heads * args.head_size * element_size(args.dtype)
    kv = kv_bytes(args, batch, context)
    return copies(args, batch, context) * (paged + kv) + kv // 2


def cases(args):
    return [(b, c) for b in args.batch for c in args.context]


def print_plan(args) -> None:
    print(f"decode attention, {args.dtype}, {args.num_heads} query heads, {args.num_kv_heads} KV heads, "
          f"head size {args.head_size}, block size {args.block_size}; {args.warmup} warm-up, {args.repeat} repeats")
    print(f"{'batch':>6} {'context':>8} {'K+V read':>10} {'copies':>6} {'peak memory':>12}")
    for b, c in cases(args):
        print(f"{b:>6} {c:>8} {kv_bytes(args, b, c) / 1e9:>8.3f}GB {copies(args, b, c):>6} "
              f"{case_memory(args, b, c) / 1e9:>10.2f}GB")
    print(f"results to {args.out}/kernels.json and kernels.txt")


# ---- GPU part -------------------------------------------------------------------------------------


def event_ms(torch, fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def time_per_call_ms(torch, calls, warmup: int, repeat: int, rounds: int = 5) -> tuple[float, str]:
    """Median over rounds of the time per call of `repeat` calls cycling through `calls`."""
    def loop():
        for i in range(repeat):
            calls[i % len(calls)]()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as graph capture wants
        for i in range(max(warmup, len(calls))):
            calls[i % len(calls)]()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            loop()
        run, how = graph.replay, "cuda graph"
    except Exception as exc:  # noqa: BLE001 - any capture failure: time eager calls instead
        print(f"  graph capture failed ({type(exc).__name__}: {exc}); timing eager calls", flush=True)
        torch.cuda.synchronize()
        run, how = loop, "eager"
    run()
    samples = sorted(event_ms(torch, run) / repeat for _ in range(rounds))
    return samples[len(samples) // 2], how


def copy_bandwidth(torch) -> float:
    """Device-to-device copy of 4 GiB: bytes read + written per second (median of 10)."""
    n = 4 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    ms = sorted(event_ms(torch, lambda: dst.copy_(src)) for _ in range(10))[5]
    del src, dst
    return 2 * n / (ms / 1e3)


def run_case(torch, args, batch: int, context: int) -> dict:
    import torch.nn.functional as F

    from pagedgen import ops

    dtype = getattr(torch, args.dtype)
    H, Hkv, D, bs = args.num_heads, args.num_kv_heads, args.head_size, args.block_size
    blocks_per_seq = math.ceil(context / bs)
    num_blocks = batch * blocks_per_seq
    g = torch.Generator(device="cuda").manual_seed(0)
    # random physical placement of each sequence's blocks
    perm = torch.randperm(num_blocks, device="cuda", generator=g)
    block_tables = perm.view(batch, blocks_per_seq).to(torch.int32)  # [batch, blocks_per_seq]
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device="cuda")  # one decode row per sequence
    query = torch.randn(batch, H, D, dtype=dtype, device="cuda", generator=g)  # [batch, H, D]
    q4 = query.unsqueeze(2)  # [batch, H, 1, D]
    out = torch.empty_like(query)
    scale = D**-0.5

    def gather(cache):  # [num_blocks, bs, Hkv, D] -> [batch, Hkv, context, D], the same tokens contiguous
        return cache[block_tables.long()].view(batch, blocks_per_seq * bs, Hkv, D)[:, :context].transpose(1, 2).contiguous()

    paged_calls, sdpa_calls = [], []
    for _ in range(copies(args, batch, context)):
        kc = torch.randn(num_blocks, bs, Hkv, D, dtype=dtype, device="cuda", generator=g)
        vc = torch.randn(num_blocks, bs, Hkv, D, dtype=dtype, device="cuda", generator=g)
        k, v = gather(kc), gather(vc)
        paged_calls.append(lambda kc=kc, vc=vc: ops.paged_attention(out, query, kc, vc, block_tables, seq_lens,
                                                                    query_start_loc, scale, 0))
        sdpa_calls.append(lambda k=k, v=v: F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True))

    row = {"batch": batch, "context": context, "kv_bytes": kv_bytes(args, batch, context), "copies": len(paged_calls)}
    row["paged_ms"], row["paged_timing"] = time_per_call_ms(torch, paged_calls, args.warmup, args.repeat)
    try:
        row["sdpa_ms"], row["sdpa_timing"] = time_per_call_ms(torch, sdpa_calls, args.warmup, args.repeat)
        paged_calls[0]()
        row["max_abs_diff"] = (sdpa_calls[0]().squeeze(2).float() - out.float()).abs().max().item()
    except torch.OutOfMemoryError:
        row["sdpa_ms"], row["sdpa_note"] = None, "out of memory"
    return row


def format_table(result: dict) -> str:
    bw = result["copy_bandwidth_GBps"]
    lines = [
        f"{result['device']}, torch {result['torch']}; copy bandwidth {bw:.0f} GB/s (read + write)",
        f"decode attention {result['config']}",
        f"{'batch':>6} {'context':>8} {'paged ms':>9} {'GB/s':>7} {'of copy':>8} {'sdpa ms':>9} {'GB/s':>7} "
        f"{'of copy':>8} {'paged/sdpa':>10} {'max diff':>9}",
    ]
    for r in result["cases"]:
        if "skipped" in r:
            lines.append(f"{r['batch']:>6} {r['context']:>8}  skipped: {r['skipped']}")
            continue
        pg = r["kv_bytes"] / r["paged_ms"] / 1e6
        cells = f"{r['batch']:>6} {r['context']:>8} {r['paged_ms']:>9.4f} {pg:>7.0f} {pg / bw:>8.1%}"
        if r.get("sdpa_ms"):
            sd = r["kv_bytes"] / r["sdpa_ms"] / 1e6
            cells += f" {r['sdpa_ms']:>9.4f} {sd:>7.0f} {sd / bw:>8.1%} {r['paged_ms'] / r['sdpa_ms']:>10.2f} {r['max_abs_diff']:>9.2e}"
        else:
            cells += f"  sdpa: {r.get('sdpa_note', 'n/a')}"
        lines.append(cells)
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        print_plan(args)
        return 0
    import torch

    from pagedgen import ops

    if not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA GPU (use --dry-run to check the arguments)", file=sys.stderr)
        return 2
    if not ops.extension_available("cuda"):
        print(f"pagedgen's CUDA kernels are not available: {ops.extension_error('cuda')}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    print_plan(args)
    props = torch.cuda.get_device_properties(0)
    result = {
        "device": props.name,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "config": {k: getattr(args, k) for k in ("dtype", "num_heads", "num_kv_heads", "head_size", "block_size", "warmup", "repeat")},
        "l2_bytes": props.L2_cache_size,
        "copy_bandwidth_GBps": copy_bandwidth(torch) / 1e9,
        "cases": [],
    }
    start = time.time()
    for batch, context in cases(args):
        free = torch.cuda.mem_get_info()[0]
        need = case_memory(args, batch, context)
        if need > args.memory_fraction * free:
            row = {"batch": batch, "context": context, "skipped": f"needs {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free"}
        else:
            row = run_case(torch, args, batch, context)
        result["cases"].append(row)
        torch.cuda.empty_cache()
        print(json.dumps(row), flush=True)
    result["seconds"] = time.time() - start
    table = format_table(result)
    with open(os.path.join(args.out, "kernels.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "kernels.txt"), "w") as f:
        f.write(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
