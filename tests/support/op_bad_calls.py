"""Bad calls of the ops that have a kernel per device (paged_attention, reshape_and_cache, copy_blocks,
swap_blocks) and of the CPU-only layer ops that share the output checks (rms_norm, fused_add_rms_norm,
silu_and_mul: csrc/op_checks.h, writable_output), one list for every test that runs them: tests/ops/test_ops_checks.py on the CPU kernels and,
with CPU tensors, through the CUDA kernels' own entry; tests/ops/test_ops_cuda.py on a GPU. Both kernels
run the same checks (csrc/op_checks.h), so each case names the message both must raise.

A case: ``(op, mutate, message, kernels)``. ``mutate(args, other)`` breaks a valid call built by
``valid_call(op, device)`` (a dict of the op's arguments by name); ``other`` is a device other than the
call's (``meta`` for the CPU kernel, ``cpu`` for the CUDA kernel) for the cases that mix devices;
``kernels`` the kernels that must reject the call (the CUDA kernel assumes contiguous strides the CPU
kernel does not need).
"""
import torch

from attention_batches import varlen_batch

BOTH, CUDA_ONLY, CPU_ONLY = ("cpu", "cuda"), ("cuda",), ("cpu",)

# The arguments of each op, in schema order (csrc/ops.cpp).
ARG_NAMES = {
    "paged_attention": ("out", "query", "key_cache", "value_cache", "block_tables", "seq_lens", "query_start_loc",
                        "scale", "sliding_window"),
    "reshape_and_cache": ("key", "value", "key_cache", "value_cache", "slot_mapping"),
    "copy_blocks": ("key_cache", "value_cache", "block_mapping"),
    "swap_blocks": ("src", "dst", "block_mapping"),
    "rms_norm": ("out", "input", "weight", "epsilon"),
    "fused_add_rms_norm": ("input", "residual", "weight", "epsilon"),
    "silu_and_mul": ("out", "input"),
}


def valid_call(op: str, device: str) -> dict:
    """Arguments of a call of ``op`` that its kernel on ``device`` accepts (block ids all in range)."""
    if op == "paged_attention":
        # two sequences: a 5-token prompt and a decode row after 19 cached tokens; [T=6, H=4, D=64], Hkv 2
        batch = varlen_batch([(5, 5), (20, 1)], 4, 2, 64, 16, torch.float32, unused=0, device=device)
        return dict(out=torch.empty_like(batch["query"]), **batch, scale=0.125, sliding_window=0)
    if op == "reshape_and_cache":
        cache = torch.zeros(4, 8, 2, 64, device=device)  # [num_blocks, block_size, Hkv, D]
        key = torch.randn(3, 2, 64, device=device)
        return dict(key=key, value=key.clone(), key_cache=cache, value_cache=cache.clone(),
                    slot_mapping=torch.tensor([0, 9, -1], device=device))
    if op == "copy_blocks":
        cache = torch.randn(4, 8, 2, 64, device=device)
        return dict(key_cache=cache, value_cache=cache.clone(), block_mapping=torch.tensor([[0, 1], [2, 3]]))
    if op == "swap_blocks":
        return dict(src=torch.randn(4, 8, 2, 64, device=device), dst=torch.zeros(3, 8, 2, 64),
                    block_mapping=torch.tensor([[0, 1], [3, 2]]))
    if op == "rms_norm":  # [T=3, hidden=16]
        return dict(out=torch.empty(3, 16, device=device), input=torch.randn(3, 16, device=device),
                    weight=torch.ones(16, device=device), epsilon=1e-5)
    if op == "fused_add_rms_norm":
        return dict(input=torch.randn(3, 16, device=device), residual=torch.randn(3, 16, device=device),
                    weight=torch.ones(16, device=device), epsilon=1e-5)
    if op == "silu_and_mul":  # input [T=3, 2 * d=16], out [3, 8]
        return dict(out=torch.empty(3, 8, device=device), input=torch.randn(3, 16, device=device))
    raise KeyError(op)


def _set(**changes):
    """mutate(args, other) that replaces arguments: each value is a function of (args, other)."""
    def mutate(args, other):
        args.update({name: fn(args, other) for name, fn in changes.items()})
    return mutate


def _zero_row_stride(t):
    """A tensor of t's shape whose rows all lie at one address (row stride 0: internal overlap)."""
    return t.new_empty(t.shape[1:]).as_strided(t.shape, (0,) + t.stride()[1:])


def _out_overlapping_query(args, other):
    """out and query as views of one buffer, out one row further on (a partial overlap)."""
    query = args["query"]
    rows, row = query.shape[0], query[0].numel()
    buffer = torch.randn((rows + 1) * row, dtype=query.dtype, device=query.device)
    args["query"], args["out"] = buffer[:-row].view(query.shape), buffer[row:].view(query.shape)


def _noncontiguous(t):
    """t's values in a tensor of t's shape whose dim 1 and 2 strides are swapped (not contiguous)."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


CASES = {
    # ---- paged_attention: the four that crashed the H200 run (2026-12-04) first
    "attention-heads-not-multiple-of-kv-heads": (
        "paged_attention", _set(out=lambda a, o: a["out"][:, :3], query=lambda a, o: a["query"][:, :3]),
        r"num_heads \(3\) must be a multiple of num_kv_heads \(2\)", BOTH),
    "attention-head-size-mismatch": (
        "paged_attention", _set(out=lambda a, o: a["out"][..., :32], query=lambda a, o: a["query"][..., :32]),
        r"key_cache head_size 64 != query head_size 32", BOTH),
    "attention-query-start-loc-one-short": (
        "paged_attention", _set(query_start_loc=lambda a, o: a["query_start_loc"][:-1]),
        r"query_start_loc must be \[num_seqs \+ 1=3\], got \[2\]", BOTH),
    "attention-negative-sliding-window": (
        "paged_attention", _set(sliding_window=lambda a, o: -1), r"sliding_window must be in \[0, .*got -1", BOTH),
    "attention-int64-block-tables": (
        "paged_attention", _set(block_tables=lambda a, o: a["block_tables"].long()), "block_tables must be int32", BOTH),
    "attention-out-dtype": (
        "paged_attention", _set(out=lambda a, o: a["out"].half()), "must share one dtype", BOTH),
    "attention-cache-dtype": (
        "paged_attention", _set(key_cache=lambda a, o: a["key_cache"].half()), "must share one dtype", BOTH),
    "attention-int-query": (
        "paged_attention", _set(query=lambda a, o: a["query"].int(), out=lambda a, o: a["out"].int()),
        "query dtype must be float32, float16 or bfloat16", BOTH),
    "attention-query-2d": (
        "paged_attention", _set(query=lambda a, o: a["query"][:, 0], out=lambda a, o: a["out"][:, 0]),
        r"query must be \[num_tokens, num_heads, head_size\]", BOTH),
    "attention-out-shape": (
        "paged_attention", _set(out=lambda a, o: a["out"][:1]), "out .* must match query", BOTH),
    "attention-cache-3d": (
        "paged_attention", _set(key_cache=lambda a, o: a["key_cache"][0], value_cache=lambda a, o: a["value_cache"][0]),
        r"key_cache must be \[num_blocks, block_size, num_kv_heads, head_size\]", BOTH),
    "attention-value-cache-shape": (
        "paged_attention", _set(value_cache=lambda a, o: a["value_cache"][:1]), "value_cache .* must match key_cache",
        BOTH),
    "attention-zero-kv-heads": (
        "paged_attention", _set(key_cache=lambda a, o: a["key_cache"][:, :, :0], value_cache=lambda a, o: a["value_cache"][:, :, :0]),
        r"must be a multiple of num_kv_heads \(0\)", BOTH),
    "attention-zero-block-size": (
        "paged_attention", _set(key_cache=lambda a, o: a["key_cache"][:, :0], value_cache=lambda a, o: a["value_cache"][:, :0]),
        r"block_size \(0\) and head_size \(64\) must be positive", BOTH),
    "attention-noncontiguous-cache": (
        "paged_attention", _set(key_cache=lambda a, o: _noncontiguous(a["key_cache"])),
        "key_cache and value_cache must be contiguous", BOTH),
    "attention-block-tables-1d": (
        "paged_attention", _set(block_tables=lambda a, o: a["block_tables"][0]),
        r"block_tables must be \[num_seqs, max_blocks_per_seq\]", BOTH),
    "attention-seq-lens-short": (
        "paged_attention", _set(seq_lens=lambda a, o: a["seq_lens"][:1]), r"seq_lens must be \[num_seqs=2\]", BOTH),
    "attention-int64-seq-lens": (
        "paged_attention", _set(seq_lens=lambda a, o: a["seq_lens"].long()), "seq_lens must be int32", BOTH),
    "attention-int64-query-start-loc": (
        "paged_attention", _set(query_start_loc=lambda a, o: a["query_start_loc"].long()),
        "query_start_loc must be int32", BOTH),
    "attention-rows-without-sequences": (
        "paged_attention", _set(block_tables=lambda a, o: a["block_tables"][:0], seq_lens=lambda a, o: a["seq_lens"][:0],
                                query_start_loc=lambda a, o: a["query_start_loc"][:1]),
        "6 query rows but no sequence", BOTH),
    "attention-query-strided-head-size": (
        "paged_attention", _set(query=lambda a, o: a["query"].transpose(1, 2).contiguous().transpose(1, 2)),
        "query must be contiguous in its head_size dimension", CUDA_ONLY),
    "attention-out-strided-head-size": (
        "paged_attention", _set(out=lambda a, o: a["out"].new_empty(6, 64, 4).transpose(1, 2)),
        "out must be contiguous in its head_size dimension", CUDA_ONLY),
    "attention-block-tables-strided-rows": (
        "paged_attention", _set(block_tables=lambda a, o: a["block_tables"].t().contiguous().t()),
        "block_tables rows must be contiguous", CUDA_ONLY),
    "attention-seq-lens-strided": (
        "paged_attention", _set(seq_lens=lambda a, o: a["seq_lens"].repeat_interleave(2)[::2]),
        "seq_lens and query_start_loc must be contiguous", CUDA_ONLY),
    "attention-seq-lens-on-another-device": (
        "paged_attention", _set(seq_lens=lambda a, o: a["seq_lens"].to(o)),
        "all tensors must be on one device, got seq_lens on", BOTH),
    "attention-out-zero-row-stride": (
        "paged_attention", _set(out=lambda a, o: _zero_row_stride(a["out"])), "out must not overlap itself", BOTH),
    "attention-out-is-query": (
        "paged_attention", _set(out=lambda a, o: a["query"]), "out must not overlap query", BOTH),
    "attention-out-partially-overlaps-query": (
        "paged_attention", _out_overlapping_query, "out must not overlap query", BOTH),
    "attention-strided-out-inside-key-cache": (  # not dense: the address ranges decide
        "paged_attention", _set(out=lambda a, o: a["key_cache"].view(-1)[: 6 * 512].view(6, 512)[:, :256].view(6, 4, 64)),
        "out must not overlap key_cache", BOTH),
    # a value (read on the host by the CPU kernel only; the CUDA kernel gives such rows zeros and the
    # engine never passes them: CUDA-graph padding rows are sequences of seq_len 0)
    "attention-query-rows-past-query-start-loc": (
        "paged_attention", _set(query=lambda a, o: torch.cat([a["query"], a["query"][:2]]),
                                out=lambda a, o: torch.empty(8, 4, 64)),
        r"query_start_loc must run from 0 to num_tokens=8, got 0 \.\. 6", CPU_ONLY),
    # ---- rms_norm, fused_add_rms_norm, silu_and_mul (CPU kernels only): the outputs they write
    "rms-norm-out-zero-row-stride": (
        "rms_norm", _set(out=lambda a, o: _zero_row_stride(a["out"])), "rms_norm: out must not overlap itself", CPU_ONLY),
    "rms-norm-out-is-input": (
        "rms_norm", _set(out=lambda a, o: a["input"]), "rms_norm: out must not overlap input", CPU_ONLY),
    "fused-add-rms-norm-residual-is-input": (
        "fused_add_rms_norm", _set(residual=lambda a, o: a["input"]),
        "fused_add_rms_norm: input must not overlap residual", CPU_ONLY),
    "fused-add-rms-norm-residual-zero-row-stride": (
        "fused_add_rms_norm", _set(residual=lambda a, o: _zero_row_stride(a["residual"])),
        "fused_add_rms_norm: residual must not overlap itself", CPU_ONLY),
    "silu-and-mul-out-zero-row-stride": (
        "silu_and_mul", _set(out=lambda a, o: _zero_row_stride(a["out"])), "silu_and_mul: out must not overlap itself",
        CPU_ONLY),
    "silu-and-mul-out-inside-input": (  # a strided view of input's columns 4..11
        "silu_and_mul", _set(out=lambda a, o: a["input"][:, 4:12]), "silu_and_mul: out must not overlap input", CPU_ONLY),
    # ---- reshape_and_cache
    "cache-int32-slot-mapping": (
        "reshape_and_cache", _set(slot_mapping=lambda a, o: a["slot_mapping"].int()), "slot_mapping must be int64", BOTH),
    "cache-key-does-not-fit": (
        "reshape_and_cache", _set(key=lambda a, o: a["key"][:, :1], value=lambda a, o: a["value"][:, :1]),
        "does not fit key_cache", BOTH),
    "cache-key-head-size": (
        "reshape_and_cache", _set(key=lambda a, o: a["key"][..., :8], value=lambda a, o: a["value"][..., :8]),
        r"key must be \[num_tokens, num_kv_heads=2, head_size=64\], got \[3, 2, 8\]", BOTH),
    "cache-value-shape": (
        "reshape_and_cache", _set(value=lambda a, o: a["value"][:2]), "value .* must match key", BOTH),
    "cache-slot-mapping-length": (
        "reshape_and_cache", _set(slot_mapping=lambda a, o: a["slot_mapping"][:2]),
        r"slot_mapping must be \[num_tokens=3\], got \[2\]", BOTH),
    "cache-cache-dtypes-differ": (
        "reshape_and_cache", _set(value_cache=lambda a, o: a["value_cache"].half()),
        "key_cache and value_cache must share one dtype", BOTH),
    "cache-int-key": (
        "reshape_and_cache", _set(key=lambda a, o: a["key"].int(), value=lambda a, o: a["value"].int()),
        "key and value must share one dtype, float32, float16 or bfloat16", BOTH),
    "cache-key-value-dtypes-differ": (
        "reshape_and_cache", _set(value=lambda a, o: a["value"].half()), "key and value must share one dtype", BOTH),
    "cache-noncontiguous-cache": (
        "reshape_and_cache", _set(key_cache=lambda a, o: _noncontiguous(a["key_cache"]),
                                  value_cache=lambda a, o: _noncontiguous(a["value_cache"])),
        "key_cache and value_cache must be contiguous", BOTH),
    "cache-strided-slot-mapping": (
        "reshape_and_cache", _set(slot_mapping=lambda a, o: a["slot_mapping"].repeat_interleave(2)[::2]),
        "slot_mapping must be contiguous", BOTH),
    "cache-3d-cache": (
        "reshape_and_cache", _set(key_cache=lambda a, o: a["key_cache"][0], value_cache=lambda a, o: a["value_cache"][0]),
        r"key_cache must be \[num_blocks, block_size, num_kv_heads, head_size\]", BOTH),
    "cache-slot-mapping-on-another-device": (
        "reshape_and_cache", _set(slot_mapping=lambda a, o: a["slot_mapping"].to(o)),
        "all tensors must be on one device, got slot_mapping on", BOTH),
    # ---- copy_blocks
    "copy-int32-mapping": (
        "copy_blocks", _set(block_mapping=lambda a, o: a["block_mapping"].int()), "block_mapping must be int64", BOTH),
    "copy-mapping-shape": (
        "copy_blocks", _set(block_mapping=lambda a, o: a["block_mapping"].flatten()),
        r"block_mapping must be \[num_pairs, 2\]", BOTH),
    "copy-value-cache-shape": (
        "copy_blocks", _set(value_cache=lambda a, o: a["value_cache"][:, :4].contiguous()),
        "value_cache .* must match key_cache", BOTH),
    "copy-dtypes-differ": (
        "copy_blocks", _set(value_cache=lambda a, o: a["value_cache"].half()), "value_cache dtype .* != key_cache dtype",
        BOTH),
    "copy-noncontiguous-cache": (
        "copy_blocks", _set(key_cache=lambda a, o: _noncontiguous(a["key_cache"]),
                            value_cache=lambda a, o: _noncontiguous(a["value_cache"])),
        "key_cache and value_cache must be contiguous", BOTH),
    "copy-value-cache-on-another-device": (
        "copy_blocks", _set(value_cache=lambda a, o: a["value_cache"].to(o)),
        "all tensors must be on one device, got value_cache on", BOTH),
    "copy-mapping-on-another-device": (  # the CUDA kernel takes a CPU mapping too
        "copy_blocks", _set(block_mapping=lambda a, o: a["block_mapping"].to(o)),
        "block_mapping must be on the CPU or on the caches' device", CPU_ONLY),
    # ---- swap_blocks
    "swap-block-shape": (
        "swap_blocks", _set(dst=lambda a, o: a["dst"][:, :4].contiguous()), "must have the same block shape", BOTH),
    "swap-dtypes-differ": (
        "swap_blocks", _set(dst=lambda a, o: a["dst"].half()), "src dtype .* != dst dtype", BOTH),
    "swap-int32-mapping": (
        "swap_blocks", _set(block_mapping=lambda a, o: a["block_mapping"].int()), "block_mapping must be int64", BOTH),
    "swap-mapping-shape": (
        "swap_blocks", _set(block_mapping=lambda a, o: a["block_mapping"][:, :1]), r"block_mapping must be \[num_pairs, 2\]",
        BOTH),
    "swap-noncontiguous": (
        "swap_blocks", _set(src=lambda a, o: _noncontiguous(a["src"])), "src and dst must be contiguous", BOTH),
}

# Cases that put a tensor on another device: run only on the kernel's own device (the CUDA kernel's
# entry, given CPU tensors, stops at its first device check instead).
MIXES_DEVICES = {name for name in CASES if name.endswith("on-another-device")}


def arguments(op: str, args: dict) -> tuple:
    """The positional arguments of ``op`` from ``args`` (see ARG_NAMES)."""
    return tuple(args[name] for name in ARG_NAMES[op])


def bad_call(case: str, device: str, other: str):
    """(op, positional arguments, message) of ``case`` on ``device``."""
    op, mutate, message, _ = CASES[case]
    args = valid_call(op, device)
    mutate(args, other)
    return op, arguments(op, args), message
