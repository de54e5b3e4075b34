"""Micro-benchmark of the CPU paged_attention kernel (pagedgen._C) against torch's
scaled_dot_product_attention on contiguous tensors holding the same keys and values, and of the
kernel on a shuffled block table against the kernel on a contiguous one (the price of paging).

Workloads, per dtype and head size (random keys, values and queries):
  decode:  --num-seqs decode rows of one token, each attending over --context-len cached tokens;
           SDPA: q [S, H, 1, D] against k/v [S, Hkv, ctx, D].
  prefill: one prompt of --prefill-len tokens as one varlen chunk (the engine's tiled prefill: each
           row attends causally over the rows before it); SDPA: q/k/v [1, H, n, D], is_causal=True.
The paged calls read the cache through a block table of shuffled physical blocks ("paged") and
through one of consecutive blocks ("contiguous table"). Every configuration is timed in rounds that
interleave the systems (so that a busy machine slows them alike); the figure is the median over
rounds, in ms, and the ratios are of those medians:
  sdpa/paged    > 1: the paged kernel is faster than SDPA on contiguous tensors (target >= 1 for prefill)
  paging price  paged / contiguous table - 1 (target <= +10%)
With --vs-general, the paged call is also timed with PAGEDGEN_CPU_ATTENTION=general (the kernel's
general path, which it reads at each call) in the same rounds: for head sizes 8 and 16, "general /
paged" > 1 means the small-head path (csrc/cpu/attention_small.h) is faster than the general one.
With --kv-cache-dtypes int8 fp8 ..., the shuffled cache is also quantized to each 1-byte dtype and
paged_attention_quantized (the kernel reading the codes and scales itself) timed in the same rounds:
"<dtype>/paged" < 1 means the 1-byte cache attends faster than the float one (issue 46's target: <= 1).

    python benchmarks/cpu_kernels.py            # 1,024-token prefill, 64 x 512 decode, fp32 and bf16, heads 64/128
    python benchmarks/cpu_kernels.py --quick    # small sizes, few rounds (CI: checks that it runs)
    python benchmarks/cpu_kernels.py --threads 1 --clock thread --head-sizes 8 16 --vs-general
    python benchmarks/cpu_kernels.py --dtypes bfloat16 --num-heads 9 --num-kv-heads 3 --head-sizes 64 --kv-cache-dtypes int8 fp8
"""
import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from pagedgen.ops import extension_available, extension_error

CLOCK = time.perf_counter  # --clock thread: time.thread_time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-seqs", type=int, default=64, help="decode rows")
    p.add_argument("--context-len", type=int, default=512, help="tokens each decode row attends over")
    p.add_argument("--prefill-len", type=int, default=1024, help="prompt length of the prefill workload (0: skip)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-heads", type=int, default=8)
    p.add_argument("--num-kv-heads", type=int, default=4)
    p.add_argument("--head-sizes", type=int, nargs="+", default=[64, 128])
    p.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16", "float16"], default=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=15, help="timed rounds (each: one call of every system)")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave as is)")
    p.add_argument("--clock", choices=["wall", "thread"], default="wall",
                   help="thread: CPU time of the calling thread, on one thread (robust to other load on the machine)")
    p.add_argument("--vs-general", action="store_true",
                   help="also time the paged call on the kernel's general path (PAGEDGEN_CPU_ATTENTION=general)")
    p.add_argument("--kv-cache-dtypes", nargs="*", default=[], choices=["int8", "fp8", "fp8_e4m3", "fp8_e5m2"],
                   help="also time paged_attention_quantized over the cache quantized to these kv_cache_dtypes")
    p.add_argument("--quick", action="store_true", help="prefill 256, decode 8 x 256, head size 64, 3 rounds")
    args = p.parse_args(argv)
    if args.quick:
        args.prefill_len, args.num_seqs, args.context_len, args.head_sizes, args.rounds = 256, 8, 256, [64], 3
    for name in ("num_seqs", "context_len", "block_size", "num_heads", "num_kv_heads", "rounds"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.prefill_len < 0 or any(d <= 0 for d in args.head_sizes):
        p.error("--prefill-len must be >= 0 and --head-sizes positive")
    if args.num_heads % args.num_kv_heads:
        p.error("--num-heads must be a multiple of --num-kv-heads")
    return args


def interleaved_medians(calls: dict, rounds: int) -> dict:
    """Median time in ms of each call, measured in rounds that run every call once (after a warm-up)."""
    for fn in calls.values():
        fn()
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            start = CLOCK()
            fn()
            times[name].append(CLOCK() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def paged_cache(k: torch.Tensor, v: torch.Tensor, block_size: int, shuffle: bool):
    """k, v [S, Hkv, n, D] -> key_cache, value_cache [S * blocks, block_size, Hkv, D] holding the same
    tokens, and block_tables [S, blocks] int32 (shuffled physical blocks, or consecutive ones)."""
    S, Hkv, n, D = k.shape
    blocks = -(-n // block_size)
    pad = blocks * block_size - n

    def blocked(t):  # [S, Hkv, n, D] -> [S * blocks, block_size, Hkv, D]
        t = F.pad(t, (0, 0, 0, pad)).transpose(1, 2)  # [S, blocks * block_size, Hkv, D]
        return t.reshape(S * blocks, block_size, Hkv, D)

    order = torch.randperm(S * blocks) if shuffle else torch.arange(S * blocks)
    shape, dtype = (S * blocks, block_size, Hkv, D), k.dtype
    key_cache, value_cache = torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)
    key_cache[order] = blocked(k)  # logical block i of the batch lives in physical block order[i]
    value_cache[order] = blocked(v)
    return key_cache, value_cache, order.view(S, blocks).to(torch.int32)


def bench(args, kind: str, head_size: int, dtype: torch.dtype) -> dict:
    H, Hkv, D, bs = args.num_heads, args.num_kv_heads, head_size, args.block_size
    if kind == "decode":
        S, n = args.num_seqs, args.context_len
        q = torch.randn(S, H, 1, D).to(dtype)  # SDPA layout [S, H, 1, D]
        query = q.squeeze(2)  # [S, H, D]: one row per sequence
        seq_lens = torch.full((S,), n, dtype=torch.int32)
        query_start_loc = torch.arange(S + 1, dtype=torch.int32)
        causal = False
    else:
        S, n = 1, args.prefill_len
        q = torch.randn(1, H, n, D).to(dtype)
        query = q[0].transpose(0, 1).contiguous()  # [n, H, D]: the prompt's rows
        seq_lens = torch.tensor([n], dtype=torch.int32)
        query_start_loc = torch.tensor([0, n], dtype=torch.int32)
        causal = True
    k, v = torch.randn(S, Hkv, n, D).to(dtype), torch.randn(S, Hkv, n, D).to(dtype)
    scale = D**-0.5
    out = torch.empty_like(query)

    def paged(shuffle):
        kc, vc, tables = paged_cache(k, v, bs, shuffle)
        return lambda: torch.ops.pagedgen.paged_attention(out, query, kc, vc, tables, seq_lens, query_start_loc, scale, 0)

    calls = {
        "paged": paged(True),
        "contiguous table": paged(False),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True),
    }
    if args.vs_general:
        calls["general"] = on_general_path(paged(True))
    if args.kv_cache_dtypes:
        from pagedgen.ops import kv_quant

        kc, vc, tables = paged_cache(k, v, bs, True)
        out_q = torch.empty_like(query)
        for name in args.kv_cache_dtypes:
            code = kv_quant.KV_CACHE_DTYPES[name][0]
            cache = (*kv_quant.quantize(kc, code), *kv_quant.quantize(vc, code))  # key codes, key scales, value ...
            calls[name] = (lambda c: lambda: torch.ops.pagedgen.paged_attention_quantized(
                out_q, query, c[0], c[2], c[1], c[3], tables, seq_lens, query_start_loc, scale, 0))(cache)
    r = interleaved_medians(calls, args.rounds)
    calls["paged"]()
    expected = calls["sdpa"]()  # [S, H, n or 1, D]
    got = out.unsqueeze(2) if kind == "decode" else out.transpose(0, 1)[None]
    r["max_abs_diff"] = (got.float() - expected.float()).abs().max().item()
    return r


def on_general_path(call):
    """call, run with PAGEDGEN_CPU_ATTENTION=general (the kernel reads it at each call), then restored."""

    def run():
        before = os.environ.get("PAGEDGEN_CPU_ATTENTION")
        os.environ["PAGEDGEN_CPU_ATTENTION"] = "general"
        try:
            return call()
        finally:
            if before is None:
                del os.environ["PAGEDGEN_CPU_ATTENTION"]
            else:
                os.environ["PAGEDGEN_CPU_ATTENTION"] = before

    return run


def main(argv=None) -> None:
    args = parse_args(argv)
    if not extension_available("cpu"):
        raise SystemExit(f"needs the compiled kernels: {extension_error('cpu')}")
    if args.clock == "thread":
        global CLOCK
        CLOCK, args.threads = time.thread_time, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"{torch.get_num_threads()} threads, heads {args.num_heads}/{args.num_kv_heads} (q/kv), block size "
          f"{args.block_size}; median ms over {args.rounds} interleaved rounds ({args.clock} clock)")
    print(f"{'workload':<30} {'dtype':<9} {'head':>4} {'paged':>9} {'contig tbl':>10} {'sdpa':>9} "
          f"{'sdpa/paged':>10} {'paging price':>12} {'max diff':>9}" + (f" {'general':>9} {'gen/paged':>9}" if args.vs_general else "")
          + "".join(f" {n:>9} {n + '/paged':>13}" for n in args.kv_cache_dtypes))
    workloads = [("decode", f"decode {args.num_seqs} x {args.context_len} ctx")]
    if args.prefill_len:
        workloads.append(("prefill", f"prefill {args.prefill_len} (causal)"))
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for head_size in args.head_sizes:
            for kind, label in workloads:
                r = bench(args, kind, head_size, dtype)
                price = r["paged"] / r["contiguous table"] - 1
                print(f"{label:<30} {dtype_name:<9} {head_size:>4} {r['paged']:>9.3f} {r['contiguous table']:>10.3f} "
                      f"{r['sdpa']:>9.3f} {r['sdpa'] / r['paged']:>9.2f}x {price:>+11.1%} {r['max_abs_diff']:>9.1e}"
                      + (f" {r['general']:>9.3f} {r['general'] / r['paged']:>8.2f}x" if args.vs_general else "")
                      + "".join(f" {r[n]:>9.3f} {r[n] / r['paged']:>12.2f}x" for n in args.kv_cache_dtypes),
                      flush=True)


if __name__ == "__main__":
    main()
