"""Attention kernel benchmark: pagedgen's paged_attention against
torch.nn.functional.scaled_dot_product_attention (SDPA) on contiguous tensors holding the same keys
and values.

Decode cases (batch x context): one query token per sequence, SDPA with enable_gqa on a contiguous
cache. Prefill cases (chunk x prefix): one sequence whose chunk of query tokens follows a cached
prefix (the chunk's own keys already in the cache, as the engine writes them before attention),
against SDPA's causal kernel (is_causal with no prefix, else torch's lower-right causal bias: each
query row sees the prefix and the chunk up to itself).

For each case: the time per call, as the median over rounds of (CUDA events around the replay of a
CUDA graph of --repeat calls) / --repeat, after warm-up; decode calls rotate over enough copies of
the caches that the inputs are never L2-resident (eager calls if graph capture fails). Decode: the
bytes of K and V read per call over that time, that as a fraction of the measured copy bandwidth (a
large tensor copy, bytes read + written over its time), and the paged / SDPA time ratio. Prefill:
attention TFLOP/s (4 * heads * head_size per attended (row, token) pair) and the time ratio. Cases
whose tensors do not fit the free GPU memory are skipped.

    python benchmarks/kernels.py                # the full grid, results to $OUT or ./gpu_results
    python benchmarks/kernels.py --quick        # a smaller grid, fewer repeats
    python benchmarks/kernels.py --dry-run      # check the arguments, print the cases (no GPU)
    python benchmarks/kernels.py --device cpu --batch 2 --context 64 --prefill-chunk 16 ...
                                                # the same code path on the CPU kernels (tiny sizes:
                                                # a check that it runs, not a measurement)

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
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: the CPU kernels, eager calls timed with the host clock (for tiny runs)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256], help="decode: sequences per call")
    p.add_argument("--context", type=int, nargs="+", default=[512, 2048, 8192, 32768], help="decode: tokens per sequence")
    p.add_argument("--prefill-chunk", type=int, nargs="*", default=[512, 2048, 8192],
                   help="prefill: query tokens of the chunk (none: no prefill cases)")
    p.add_argument("--prefill-prefix", type=int, nargs="+", default=[0, 2048, 8192],
                   help="prefill: cached tokens before the chunk")
    p.add_argument("--prefill-repeat", type=int, default=5, help="prefill calls per timed round")
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--memory-fraction", type=float, default=0.85, help="share of free GPU memory a case may use")
    p.add_argument("--quick", action="store_true",
                   help="batch 1 and 64, context 512 and 8192, 10 repeats; prefill chunks 512 and 2048, prefixes 0 and 2048")
    p.add_argument("--dry-run", action="store_true", help="validate the arguments, print the cases, exit (no GPU)")
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.context, args.repeat, args.warmup = [1, 64], [512, 8192], 10, 3
        args.prefill_chunk, args.prefill_prefix, args.prefill_repeat = [512, 2048], [0, 2048], 3
    for name in ("batch", "context", "prefill_chunk"):
        if any(v <= 0 for v in getattr(args, name)):
            p.error(f"--{name.replace('_', '-')} values must be positive")
    if any(v < 0 for v in args.prefill_prefix):
        p.error("--prefill-prefix values must be >= 0")
    for name in ("num_heads", "num_kv_heads", "head_size", "block_size", "repeat", "prefill_repeat"):
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


def prefill_cases(args):
    return [(q, p) for q in args.prefill_chunk for p in args.prefill_prefix]


def prefill_pairs(chunk: int, prefix: int) -> int:
    """(query row, key token) pairs a causal chunk attends to: row i sees prefix + i + 1 tokens."""
    return chunk * prefix + chunk * (chunk + 1) // 2


def prefill_flops(args, chunk: int, prefix: int) -> int:
    """q.k and p.v multiply-adds (2 flops each) over every query head and attended pair."""
    return 4 * args.num_heads * args.head_size * prefill_pairs(chunk, prefix)


def prefill_memory(args, chunk: int, prefix: int) -> int:
    """Peak bytes of one prefill case: the paged cache, its contiguous copy (K and V), query, two
    outputs, and SDPA's float32 workspace for the chunk (an upper bound)."""
    tokens = math.ceil((prefix + chunk) / args.block_size) * args.block_size
    kv = 2 * tokens * args.num_kv_heads * args.head_size * element_size(args.dtype)
    q = chunk * args.num_heads * args.head_size * element_size(args.dtype)
    return 2 * kv + 3 * q + chunk * args.num_heads * args.head_size * 4


def print_plan(args) -> None:
    print(f"attention on {args.device}, {args.dtype}, {args.num_heads} query heads, {args.num_kv_heads} KV heads, "
          f"head size {args.head_size}, block size {args.block_size}; {args.warmup} warm-up")
    print(f"decode ({args.repeat} repeats):")
    print(f"{'batch':>6} {'context':>8} {'K+V read':>10} {'copies':>6} {'peak memory':>12}")
    for b, c in cases(args):
        print(f"{b:>6} {c:>8} {kv_bytes(args, b, c) / 1e9:>8.3f}GB {copies(args, b, c):>6} "
              f"{case_memory(args, b, c) / 1e9:>10.2f}GB")
    if prefill_cases(args):
        print(f"prefill ({args.prefill_repeat} repeats; SDPA causal on contiguous tensors):")
        print(f"{'chunk':>6} {'prefix':>8} {'TFLOP':>10} {'peak memory':>12}")
        for q, p in prefill_cases(args):
            print(f"{q:>6} {p:>8} {prefill_flops(args, q, p) / 1e12:>10.3f} {prefill_memory(args, q, p) / 1e9:>10.2f}GB")
    print(f"results to {args.out}/kernels.json and kernels.txt")


# ---- GPU part -------------------------------------------------------------------------------------


def event_ms(torch, fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def time_per_call_ms(torch, calls, warmup: int, repeat: int, rounds: int = 5, device: str = "cuda") -> tuple[float, str]:
    """Median over rounds of the time per call of `repeat` calls cycling through `calls`."""
    def loop():
        for i in range(repeat):
            calls[i % len(calls)]()

    if device == "cpu":  # eager calls, the host clock
        for i in range(max(warmup, len(calls))):
            calls[i % len(calls)]()
        samples = []
        for _ in range(rounds):
            start = time.perf_counter()
            loop()
            samples.append((time.perf_counter() - start) * 1e3 / repeat)
        return sorted(samples)[len(samples) // 2], "eager (host clock)"

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


def copy_bandwidth(torch, device: str = "cuda") -> float:
    """A copy of 4 GiB on the GPU (64 MiB on the CPU): bytes read + written per second (median of 10)."""
    n = 4 << 30 if device == "cuda" else 64 << 20
    src = torch.empty(n, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    if device == "cuda":
        ms = sorted(event_ms(torch, lambda: dst.copy_(src)) for _ in range(10))[5]
    else:
        samples = []
        for _ in range(10):
            start = time.perf_counter()
            dst.copy_(src)
            samples.append((time.perf_counter() - start) * 1e3)
        ms = sorted(samples)[5]
    del src, dst
    return 2 * n / (ms / 1e3)


def run_case(torch, args, batch: int, context: int) -> dict:
    import torch.nn.functional as F

    from pagedgen import ops

    dtype, dev = getattr(torch, args.dtype), args.device
    H, Hkv, D, bs = args.num_heads, args.num_kv_heads, args.head_size, args.block_size
    blocks_per_seq = math.ceil(context / bs)
    num_blocks = batch * blocks_per_seq
    g = torch.Generator(device=dev).manual_seed(0)
    # random physical placement of each sequence's blocks
    perm = torch.randperm(num_blocks, device=dev, generator=g)
    block_tables = perm.view(batch, blocks_per_seq).to(torch.int32)  # [batch, blocks_per_seq]
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=dev)  # one decode row per sequence
    query = torch.randn(batch, H, D, dtype=dtype, device=dev, generator=g)  # [batch, H, D]
    q4 = query.unsqueeze(2)  # [batch, H, 1, D]
    out = torch.empty_like(query)
    scale = D**-0.5

    def gather(cache):  # [num_blocks, bs, Hkv, D] -> [batch, Hkv, context, D], the same tokens contiguous
        return cache[block_tables.long()].view(batch, blocks_per_seq * bs, Hkv, D)[:, :context].transpose(1, 2).contiguous()

    paged_calls, sdpa_calls = [], []
    for _ in range(copies(args, batch, context)):
        kc = torch.randn(num_blocks, bs, Hkv, D, dtype=dtype, device=dev, generator=g)
        vc = torch.randn(num_blocks, bs, Hkv, D, dtype=dtype, device=dev, generator=g)
        k, v = gather(kc), gather(vc)
        paged_calls.append(lambda kc=kc, vc=vc: ops.paged_attention(out, query, kc, vc, block_tables, seq_lens,
                                                                    query_start_loc, scale, 0))
        sdpa_calls.append(lambda k=k, v=v: F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True))

    row = {"batch": batch, "context": context, "kv_bytes": kv_bytes(args, batch, context), "copies": len(paged_calls)}
    row["paged_ms"], row["paged_timing"] = time_per_call_ms(torch, paged_calls, args.warmup, args.repeat, device=dev)
    try:
        row["sdpa_ms"], row["sdpa_timing"] = time_per_call_ms(torch, sdpa_calls, args.warmup, args.repeat, device=dev)
        paged_calls[0]()
        row["max_abs_diff"] = (sdpa_calls[0]().squeeze(2).float() - out.float()).abs().max().item()
    except torch.OutOfMemoryError:
        row["sdpa_ms"], row["sdpa_note"] = None, "out of memory"
    return row


def run_prefill_case(torch, args, chunk: int, prefix: int) -> dict:
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    from pagedgen import ops

    dtype, dev = getattr(torch, args.dtype), args.device
    H, Hkv, D, bs = args.num_heads, args.num_kv_heads, args.head_size, args.block_size
    seq_len = prefix + chunk
    num_blocks = math.ceil(seq_len / bs)
    g = torch.Generator(device=dev).manual_seed(1)
    block_tables = torch.randperm(num_blocks, device=dev, generator=g).to(torch.int32).view(1, num_blocks)
    seq_lens = torch.tensor([seq_len], dtype=torch.int32, device=dev)
    query_start_loc = torch.tensor([0, chunk], dtype=torch.int32, device=dev)
    query = torch.randn(chunk, H, D, dtype=dtype, device=dev, generator=g)  # [chunk, H, D]
    key_cache = torch.randn(num_blocks, bs, Hkv, D, dtype=dtype, device=dev, generator=g)  # [num_blocks, bs, Hkv, D]
    value_cache = torch.randn(num_blocks, bs, Hkv, D, dtype=dtype, device=dev, generator=g)
    out = torch.empty_like(query)
    scale = D**-0.5

    def gather(cache):  # -> [1, Hkv, seq_len, D]: the sequence's tokens, contiguous
        return cache[block_tables[0].long()].view(num_blocks * bs, Hkv, D)[:seq_len].transpose(0, 1).unsqueeze(0).contiguous()

    k, v = gather(key_cache), gather(value_cache)
    q4 = query.transpose(0, 1).unsqueeze(0).contiguous()  # [1, H, chunk, D]
    # SDPA's is_causal aligns the mask top-left; after a prefix, row i must see prefix + i + 1 tokens
    causal = dict(is_causal=True) if prefix == 0 else dict(attn_mask=causal_lower_right(chunk, seq_len))

    def paged():
        ops.paged_attention(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, 0)

    def sdpa():
        return F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True, **causal)

    flops = prefill_flops(args, chunk, prefix)
    row = {"chunk": chunk, "prefix": prefix, "flops": flops}
    row["paged_ms"], row["paged_timing"] = time_per_call_ms(torch, [paged], args.warmup, args.prefill_repeat, device=dev)
    try:
        row["sdpa_ms"], row["sdpa_timing"] = time_per_call_ms(torch, [sdpa], args.warmup, args.prefill_repeat,
                                                              device=dev)
        paged()
        row["max_abs_diff"] = (sdpa()[0].transpose(0, 1).float() - out.float()).abs().max().item()
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
    if result.get("prefill_cases"):
        lines += [
            "prefill attention: one sequence, a chunk of query tokens after a cached prefix; SDPA causal on "
            "contiguous tensors",
            f"{'chunk':>6} {'prefix':>8} {'paged ms':>9} {'TFLOP/s':>8} {'sdpa ms':>9} {'TFLOP/s':>8} "
            f"{'paged/sdpa':>10} {'max diff':>9}",
        ]
        for r in result["prefill_cases"]:
            if "skipped" in r:
                lines.append(f"{r['chunk']:>6} {r['prefix']:>8}  skipped: {r['skipped']}")
                continue
            cells = f"{r['chunk']:>6} {r['prefix']:>8} {r['paged_ms']:>9.4f} {r['flops'] / r['paged_ms'] / 1e9:>8.1f}"
            if r.get("sdpa_ms"):
                cells += (f" {r['sdpa_ms']:>9.4f} {r['flops'] / r['sdpa_ms'] / 1e9:>8.1f} "
                          f"{r['paged_ms'] / r['sdpa_ms']:>10.2f} {r['max_abs_diff']:>9.2e}")
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

    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA GPU (use --dry-run to check the arguments, --device cpu for "
              "the CPU kernels)", file=sys.stderr)
        return 2
    if not ops.extension_available(dev):
        print(f"pagedgen's {dev} kernels are not available: {ops.extension_error(dev)}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    print_plan(args)
    result = {
        "device": torch.cuda.get_device_properties(0).name if dev == "cuda" else f"CPU ({platform.processor() or platform.machine()})",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "config": {k: getattr(args, k) for k in ("dtype", "num_heads", "num_kv_heads", "head_size", "block_size", "warmup",
                                                 "repeat", "prefill_repeat")},
        "copy_bandwidth_GBps": copy_bandwidth(torch, dev) / 1e9,
        "cases": [],
        "prefill_cases": [],
    }
    if dev == "cuda":
        result["l2_bytes"] = torch.cuda.get_device_properties(0).L2_cache_size

    def fits(need: int) -> str | None:
        """Why a case needing `need` bytes is skipped, or None (no check on the CPU)."""
        if dev != "cuda":
            return None
        free = torch.cuda.mem_get_info()[0]
        return f"needs {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free" if need > args.memory_fraction * free else None

    start = time.time()
    for batch, context in cases(args):
        why = fits(case_memory(args, batch, context))
        row = {"batch": batch, "context": context, "skipped": why} if why else run_case(torch, args, batch, context)
        result["cases"].append(row)
        if dev == "cuda":
            torch.cuda.empty_cache()
        print(json.dumps(row), flush=True)
    for chunk, prefix in prefill_cases(args):
        why = fits(prefill_memory(args, chunk, prefix))
        row = {"chunk": chunk, "prefix": prefix, "skipped": why} if why else run_prefill_case(torch, args, chunk, prefix)
        result["prefill_cases"].append(row)
        if dev == "cuda":
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
