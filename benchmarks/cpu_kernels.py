"""Micro-benchmark of the CPU paged_attention kernel (pagedgen._C) against the PyTorch reference and
against torch's scaled_dot_product_attention over a contiguous (non-paged) cache of the same shapes.

Two workloads per head size, both with random (non-contiguous) block tables:
  decode:  num_seqs rows, each attending over context_len tokens;
  prefill: one prompt of prefill_len tokens run as prefill_len rows (row i attends over i + 1
           tokens), the way the engine runs prefill through this kernel; SDPA does it as one causal call.
Prints the median time of each. Short by default; run from the repository root:
    python benchmarks/cpu_kernels.py [--num-seqs 64 --context-len 512 --dtype bfloat16 ...]
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from pagedgen.ops import extension_available, extension_error, reference


CLOCK = time.perf_counter  # --clock thread: time.thread_time


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = CLOCK()
        fn()
        times.append(CLOCK() - start)
    return statistics.median(times) * 1e3


def paged_inputs(seq_lens: list[int], args, head_size: int, dtype: torch.dtype):
    """Random cache and block tables: each sequence gets its own blocks, shuffled across the cache."""
    bs = args.block_size
    blocks_per_seq = [(n + bs - 1) // bs for n in seq_lens]
    num_blocks = sum(blocks_per_seq)
    # key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size]
    key_cache = torch.randn(num_blocks, bs, args.num_kv_heads, head_size).to(dtype)
    value_cache = torch.randn(num_blocks, bs, args.num_kv_heads, head_size).to(dtype)
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)  # [num_seqs, max_blocks]
    perm, used = torch.randperm(num_blocks, dtype=torch.int32), 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = perm[used : used + n]
        used += n
    return key_cache, value_cache, block_tables


def bench_decode(args, head_size: int, dtype: torch.dtype) -> dict:
    n, ctx, h, kv = args.num_seqs, args.context_len, args.num_heads, args.num_kv_heads
    key_cache, value_cache, block_tables = paged_inputs([ctx] * n, args, head_size, dtype)
    seq_lens = torch.full((n,), ctx, dtype=torch.int32)  # [num_seqs]
    query = torch.randn(n, h, head_size).to(dtype)  # [num_seqs, num_heads, head_size]
    out = torch.empty_like(query)
    scale = head_size**-0.5
    call = (out, query, key_cache, value_cache, block_tables, seq_lens, scale)
    # Contiguous cache for SDPA: q [n, h, 1, d], k/v [n, kv, ctx, d]
    q4 = query.unsqueeze(2)
    k4 = torch.randn(n, kv, ctx, head_size).to(dtype)
    v4 = torch.randn(n, kv, ctx, head_size).to(dtype)
    return {
        "kernel": median_ms(lambda: torch.ops.pagedgen.paged_attention(*call), args.repeats),
        "reference": median_ms(lambda: reference.paged_attention(*call), args.reference_repeats),
        "sdpa": median_ms(lambda: F.scaled_dot_product_attention(q4, k4, v4, scale=scale, enable_gqa=True), args.repeats),
    }


def bench_prefill(args, head_size: int, dtype: torch.dtype) -> dict:
    n, h, kv = args.prefill_len, args.num_heads, args.num_kv_heads
    key_cache, value_cache, block_tables = paged_inputs([n], args, head_size, dtype)
    rows_table = block_tables.expand(n, -1)  # every row reads the prompt's table (a stride-0 view)
    seq_lens = torch.arange(1, n + 1, dtype=torch.int32)  # row i attends over positions 0..i
    query = torch.randn(n, h, head_size).to(dtype)  # [num_tokens, num_heads, head_size]
    out = torch.empty_like(query)
    scale = head_size**-0.5
    call = (out, query, key_cache, value_cache, rows_table, seq_lens, scale)
    # SDPA: q [1, h, n, d], k/v [1, kv, n, d], causal
    q4 = query.transpose(0, 1).unsqueeze(0)
    k4 = torch.randn(1, kv, n, head_size).to(dtype)
    v4 = torch.randn(1, kv, n, head_size).to(dtype)
    sdpa = lambda: F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale, enable_gqa=True)  # noqa: E731
    return {
        "kernel": median_ms(lambda: torch.ops.pagedgen.paged_attention(*call), args.repeats),
        "reference": median_ms(lambda: reference.paged_attention(*call), args.reference_repeats),
        "sdpa": median_ms(sdpa, args.repeats),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-seqs", type=int, default=64, help="decode rows")
    parser.add_argument("--context-len", type=int, default=512, help="tokens each decode row attends over")
    parser.add_argument("--prefill-len", type=int, default=512, help="prompt length of the prefill workload (0: skip)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-heads", type=int, default=8)
    parser.add_argument("--num-kv-heads", type=int, default=4)
    parser.add_argument("--head-sizes", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls of the kernel and of SDPA")
    parser.add_argument("--reference-repeats", type=int, default=3, help="timed calls of the (slow) reference")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave as is)")
    parser.add_argument(
        "--clock",
        choices=["wall", "thread"],
        default="wall",
        help="thread: CPU time of the calling thread, on one thread (robust to other load on the machine)",
    )
    args = parser.parse_args()
    if not extension_available("cpu"):
        raise SystemExit(f"needs the compiled kernels: {extension_error('cpu')}")
    if args.clock == "thread":
        global CLOCK
        CLOCK, args.threads = time.thread_time, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    print(
        f"{args.dtype}, {torch.get_num_threads()} threads, heads {args.num_heads}/{args.num_kv_heads} (q/kv), "
        f"block size {args.block_size}; median ms ({args.clock} clock)"
    )
    print(f"{'workload':<34} {'head':>4} {'kernel':>9} {'reference':>10} {'sdpa':>9} {'ref/kern':>9} {'sdpa/kern':>9}")
    for head_size in args.head_sizes:
        runs = [(f"decode {args.num_seqs} seqs x {args.context_len} ctx", bench_decode)]
        if args.prefill_len:
            runs.append((f"prefill {args.prefill_len} rows (1..{args.prefill_len})", bench_prefill))
        for name, bench in runs:
            r = bench(args, head_size, dtype)
            print(
                f"{name:<34} {head_size:>4} {r['kernel']:>9.3f} {r['reference']:>10.2f} {r['sdpa']:>9.3f} "
                f"{r['reference'] / r['kernel']:>8.1f}x {r['sdpa'] / r['kernel']:>8.2f}x"
            )


if __name__ == "__main__":
    main()
