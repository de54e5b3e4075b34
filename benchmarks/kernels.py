"""Decode-attention kernel benchmark: pagedgen's paged_attention against
torch.nn.functional.scaled_dot_product_attention (enable_gqa) on a contiguous cache holding the same
keys and values, one query token per sequence.

For each (batch, context): median time over repeats (CUDA events around each call, L2 flushed
before each), the bytes of K and V read per call over that time, that as a fraction of the measured
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


def case_memory(args, batch: int, context: int) -> int:
    """Peak bytes of one case: paged and contiguous caches, plus one cache-sized gather temporary."""
    blocks = batch * math.ceil(context / args.block_size)
    paged = 2 * blocks * args.block_size * args.num_kv_heads * args.head_size * element_size(args.dtype)
    return paged + kv_bytes(args, batch, context) + kv_bytes(args, batch, context) // 2


def cases(args):
    return [(b, c) for b in args.batch for c in args.context]


def print_plan(args) -> None:
    print(f"decode attention, {args.dtype}, {args.num_heads} query heads, {args.num_kv_heads} KV heads, "
          f"head size {args.head_size}, block size {args.block_size}; {args.warmup} warm-up, {args.repeat} repeats")
    print(f"{'batch':>6} {'context':>8} {'K+V read':>10} {'peak memory':>12}")
    for b, c in cases(args):
        print(f"{b:>6} {c:>8} {kv_bytes(args, b, c) / 1e9:>8.2f}GB {case_memory(args, b, c) / 1e9:>10.2f}GB")
    print(f"results to {args.out}/kernels.json and kernels.txt")


# ---- GPU part -------------------------------------------------------------------------------------


def median_ms(torch, fn, warmup: int, repeat: int, flush) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        flush.zero_()  # evict the inputs from L2
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth(torch, flush) -> float:
    """Device-to-device copy of 4 GiB: bytes read + written per second."""
    n = 4 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = median_ms(torch, lambda: dst.copy_(src), 3, 10, flush)
    del src, dst
    return 2 * n / (ms / 1e3)


def run_case(torch, args, batch: int, context: int, flush) -> dict:
    import torch.nn.functional as F

    from pagedgen import ops

    dtype = getattr(torch, args.dtype)
    H, Hkv, D, bs = args.num_heads, args.num_kv_heads, args.head_size, args.block_size
    blocks_per_seq = math.ceil(context / bs)
    num_blocks = batch * blocks_per_seq
    g = torch.Generator(device="cuda").manual_seed(0)
    key_cache = torch.randn(num_blocks, bs, Hkv, D, dtype=dtype, device="cuda", generator=g)
    value_cache = torch.randn(num_blocks, bs, Hkv, D, dtype=dtype, device="cuda", generator=g)
    # random physical placement of each sequence's blocks
    perm = torch.randperm(num_blocks, device="cuda", generator=g)
    block_tables = perm.view(batch, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    query = torch.randn(batch, H, D, dtype=dtype, device="cuda", generator=g)
    out = torch.empty_like(query)
    scale = D**-0.5

    def gather(cache):  # [batch, Hkv, context, D], the same tokens laid out contiguously
        return cache[block_tables.long()].view(batch, blocks_per_seq * bs, Hkv, D)[:, :context].transpose(1, 2).contiguous()

    k, v = gather(key_cache), gather(value_cache)
    q4 = query.unsqueeze(2)  # [batch, H, 1, D]

    def paged():
        ops.paged_attention(out, query, key_cache, value_cache, block_tables, seq_lens, scale)

    def contiguous():
        return F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)

    row = {"batch": batch, "context": context, "kv_bytes": kv_bytes(args, batch, context)}
    row["paged_ms"] = median_ms(torch, paged, args.warmup, args.repeat, flush)
    try:
        row["sdpa_ms"] = median_ms(torch, contiguous, args.warmup, args.repeat, flush)
        row["max_abs_diff"] = (contiguous().squeeze(2).float() - out.float()).abs().max().item()
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
    flush = torch.empty(2 * max(props.L2_cache_size, 64 << 20), dtype=torch.uint8, device="cuda")
    result = {
        "device": props.name,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "config": {k: getattr(args, k) for k in ("dtype", "num_heads", "num_kv_heads", "head_size", "block_size", "warmup", "repeat")},
        "copy_bandwidth_GBps": copy_bandwidth(torch, flush) / 1e9,
        "cases": [],
    }
    start = time.time()
    for batch, context in cases(args):
        free = torch.cuda.mem_get_info()[0]
        need = case_memory(args, batch, context)
        if need > args.memory_fraction * free:
            row = {"batch": batch, "context": context, "skipped": f"needs {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free"}
        else:
            row = run_case(torch, args, batch, context, flush)
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
