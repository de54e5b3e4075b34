"""Fake implementations of pagedgen's ops, for FakeTensor tracing (torch.compile, torch.export) and
``torch.library.opcheck``. Every op writes into its ``Tensor(a!)`` arguments and returns nothing
(csrc/ops.cpp), so a fake only checks the shapes that tie its arguments together (the kernels
check everything else).

``register_fakes()`` is called by pagedgen/ops/__init__.py once pagedgen._C has defined the ops.
Registering twice is harmless: recent torch replaces the earlier fake, older torch refuses with
"already has a fake impl", which is ignored here (so another module may register the same fakes).
"""
import torch


def _reshape_and_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    # key, value: [num_tokens, num_kv_heads, head_size]; caches: [num_blocks, block_size, num_kv_heads, head_size]
    torch._check(key.shape == value.shape, lambda: f"key {key.shape} and value {value.shape} differ")
    torch._check(key.shape[1:] == key_cache.shape[2:], lambda: f"key {key.shape} does not fit key_cache {key_cache.shape}")


def _paged_attention(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                     sliding_window) -> None:
    # out, query: [num_tokens, num_heads, head_size]; caches: [num_blocks, block_size, num_kv_heads, head_size]
    # block_tables: [num_seqs, max_blocks]; seq_lens: [num_seqs]; query_start_loc: [num_seqs + 1]
    torch._check(out.shape == query.shape, lambda: f"out {out.shape} and query {query.shape} differ")
    torch._check(
        query.shape[2] == key_cache.shape[3] and query.shape[1] % key_cache.shape[2] == 0,
        lambda: f"query {query.shape} does not fit key_cache {key_cache.shape}",
    )
    torch._check(
        seq_lens.shape[0] == block_tables.shape[0] and query_start_loc.shape[0] == block_tables.shape[0] + 1,
        lambda: f"block_tables {block_tables.shape}, seq_lens {seq_lens.shape} and query_start_loc "
        f"{query_start_loc.shape} must describe the same sequences ([S, max_blocks], [S], [S + 1])",
    )


def _paged_attention_quantized(out, query, key_cache, value_cache, key_scales, value_scales, block_tables, seq_lens,
                               query_start_loc, scale, sliding_window) -> None:
    # as _paged_attention; key_scales, value_scales: [num_blocks, block_size, num_kv_heads]
    _paged_attention(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window)
    torch._check(key_scales.shape == key_cache.shape[:3] and value_scales.shape == key_cache.shape[:3],
                 lambda: f"key_scales {key_scales.shape} and value_scales {value_scales.shape} must be key_cache's "
                 f"first three dimensions {key_cache.shape[:3]}")


def _varlen_attention(out, query, key, value, cu_seqlens, scale) -> None:
    # out, query: [num_tokens, num_heads, head_size]; key, value: [num_tokens, num_kv_heads, head_size]
    torch._check(out.shape == query.shape, lambda: f"out {out.shape} and query {query.shape} differ")
    torch._check(key.shape == value.shape, lambda: f"key {key.shape} and value {value.shape} differ")
    torch._check(
        key.shape[0] == query.shape[0] and key.shape[2] == query.shape[2] and query.shape[1] % key.shape[1] == 0,
        lambda: f"key {key.shape} does not fit query {query.shape}",
    )


def _reshape_and_cache_quantized(key, value, key_cache, value_cache, key_scales, value_scales, slot_mapping) -> None:
    _reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def _copy_blocks(key_cache, value_cache, block_mapping) -> None:
    return None


def _swap_blocks(src, dst, block_mapping) -> None:
    torch._check(src.shape[1:] == dst.shape[1:], lambda: f"src {src.shape} and dst {dst.shape} blocks differ")


def _rms_norm(out, input, weight, epsilon) -> None:
    torch._check(out.shape == input.shape, lambda: f"out {out.shape} and input {input.shape} differ")


def _fused_add_rms_norm(input, residual, weight, epsilon) -> None:
    torch._check(residual.shape == input.shape, lambda: f"residual {residual.shape} and input {input.shape} differ")


def _rotary_embedding(positions, query, key, cos, sin) -> None:
    torch._check(query.shape[-1] == cos.shape[-1], lambda: f"query {query.shape} does not fit cos {cos.shape}")


def _silu_and_mul(out, input) -> None:
    torch._check(input.shape[-1] == 2 * out.shape[-1], lambda: f"input {input.shape} does not fit out {out.shape}")


def _fused_add_layer_norm(input, residual, weight, bias, epsilon) -> None:
    torch._check(residual.shape == input.shape, lambda: f"residual {residual.shape} and input {input.shape} differ")


def _argmax(out, logits) -> None:
    torch._check(out.shape == logits.shape[:1], lambda: f"out {out.shape} does not fit logits {logits.shape}")


def _logprob_topk(out, logits, token_ids, k_max) -> None:
    # out: [R, 3 + 2 * k_max]; logits: [R, V]; token_ids: [R]
    torch._check(out.shape == (logits.shape[0], 3 + 2 * k_max), lambda: f"out {out.shape} does not fit logits {logits.shape}, k_max {k_max}")
    torch._check(token_ids.shape == logits.shape[:1], lambda: f"token_ids {token_ids.shape} does not fit logits {logits.shape}")


def _kv_dequantize_blocks(out, codes, scales, blocks) -> None:
    torch._check(out.shape[1:] == codes.shape[1:], lambda: f"out {out.shape} does not fit codes {codes.shape}")


def _packed_linear(out, input, weight, bias) -> None:
    # out: [M, N]; input: [M, K]; weight: [ceil(N / 16), K, 16]
    torch._check(out.shape[0] == input.shape[0], lambda: f"out {out.shape} and input {input.shape} differ in rows")
    torch._check(weight.shape[1] == input.shape[1], lambda: f"weight {weight.shape} does not fit input {input.shape}")


def _packed_linear_bf16(out, input, weight, bias) -> None:
    # out: [M, N]; input: [M, K]; weight: [ceil(N / 16), ceil(K / 2), 16, 2]
    torch._check(out.shape[0] == input.shape[0], lambda: f"out {out.shape} and input {input.shape} differ in rows")
    torch._check(weight.shape[1] == (input.shape[1] + 1) // 2, lambda: f"weight {weight.shape} does not fit input {input.shape}")


def _int8_linear(out, input, weight, weight_scale, input_scale, bias) -> None:
    # out: [M, N]; input: [M, K]; weight: [ceil(N / 16), ceil(K / 2), 16, 2] int8
    torch._check(out.shape[0] == input.shape[0], lambda: f"out {out.shape} and input {input.shape} differ in rows")
    torch._check(weight.shape[1] == (input.shape[1] + 1) // 2, lambda: f"weight {weight.shape} does not fit input {input.shape}")


def _add_lora_linear(out, input, lora_a, lora_b, slots, output_slices) -> None:
    # out: [M, N]; input: [M, K]; lora_a: [S, K, P R]; lora_b: [S, R, N]; slots: [M]
    torch._check(out.shape[0] == input.shape[0] == slots.shape[0],
                 lambda: f"out {out.shape}, input {input.shape}, slots {slots.shape} differ in rows")
    torch._check(lora_a.shape[1] == input.shape[1], lambda: f"lora_a {lora_a.shape} does not fit input {input.shape}")
    torch._check(lora_b.shape[2] == out.shape[1], lambda: f"lora_b {lora_b.shape} does not fit out {out.shape}")


def _int4_linear(out, input, weight, weight_scale, weight_zero, group_size, bias) -> None:
    # out: [M, N]; input: [M, K]; weight: [ceil(N / 16), K, 8] uint8
    torch._check(out.shape[0] == input.shape[0], lambda: f"out {out.shape} and input {input.shape} differ in rows")
    torch._check(weight.shape[1] == input.shape[1], lambda: f"weight {weight.shape} does not fit input {input.shape}")


def _fp8_linear(out, input, weight, weight_scale, block_k, bias) -> None:
    # out: [M, N]; input: [M, K]; weight: [ceil(N / 16), K, 16] float8_e4m3fn
    torch._check(out.shape[0] == input.shape[0], lambda: f"out {out.shape} and input {input.shape} differ in rows")
    torch._check(weight.shape[1] == input.shape[1], lambda: f"weight {weight.shape} does not fit input {input.shape}")


_FAKES = {
    "reshape_and_cache": _reshape_and_cache,
    "paged_attention": _paged_attention,
    "varlen_attention": _varlen_attention,
    "copy_blocks": _copy_blocks,
    "swap_blocks": _swap_blocks,
    "rms_norm": _rms_norm,
    "fused_add_rms_norm": _fused_add_rms_norm,
    "rotary_embedding": _rotary_embedding,
    "silu_and_mul": _silu_and_mul,
    "fused_add_layer_norm": _fused_add_layer_norm,
    "argmax": _argmax,
    "logprob_topk": _logprob_topk,
    "kv_dequantize_blocks": _kv_dequantize_blocks,
    "paged_attention_quantized": _paged_attention_quantized,
    "reshape_and_cache_quantized": _reshape_and_cache_quantized,
    "packed_linear": _packed_linear,
    "packed_linear_bf16": _packed_linear_bf16,
    "int8_linear": _int8_linear,
    "int8_linear_amx": _int8_linear,  # int8_linear's product on AMX-INT8 tiles, and its emulation
    "int8_linear_amx_emulated": _int8_linear,
    "add_lora_linear": _add_lora_linear,
    "int4_linear": _int4_linear,
    "fp8_linear": _fp8_linear,
}


def register_fakes() -> None:
    """Register the fake of each op defined by pagedgen._C (needs the library loaded; an extension built
    before an op was added lacks that op, which is then skipped)."""
    for name, fn in _FAKES.items():
        if not hasattr(torch.ops.pagedgen, name):
            continue
        try:
            torch.library.register_fake(f"pagedgen::{name}")(fn)
        except RuntimeError as exc:
            if "already has" not in str(exc):
                raise
