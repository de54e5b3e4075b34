"""Plain PyTorch references of the pagedgen ops: the fallback when the extension is not built and the
oracle the kernels are tested against. Deliberately simple: loops over the block table, no tricks.

Cache layout (one layer): key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size].
A slot is block_id * block_size + offset; a negative slot is padding and is skipped.
"""
from typing import Optional

import torch


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size], written in place
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size], written in place
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Write each token's key and value into its slot of the paged cache (negative slot = skip)."""
    block_size = key_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key[valid].to(key_cache.dtype)
    value_cache[blocks, offsets] = value[valid].to(value_cache.dtype)


def paged_attention(
    out: torch.Tensor,  # [num_tokens, num_heads, head_size], written in place
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length of each sequence after this step
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    sliding_window: int = 0,
) -> None:
    """Varlen paged attention: prefill chunks and decode rows of many sequences in one call.

    Rows ``query_start_loc[s] .. query_start_loc[s + 1] - 1`` of ``query`` are the new tokens of
    sequence s, at positions ``seq_lens[s] - q_len .. seq_lens[s] - 1`` (their keys and values are
    already in the cache). A row at position p attends over the positions t <= p of its sequence
    (causal), and with ``sliding_window > 0`` only over ``p - sliding_window < t <= p``, the mask of
    transformers' Mistral / Qwen2 (``masking_utils.sliding_window_overlay``). A row at a negative
    position (``seq_lens[s] < q_len``, e.g. a padding sequence with seq_len 0) gets zeros.

    Grouped-query attention: query head h reads KV head h // (num_heads // num_kv_heads).
    Softmax is computed in float32 whatever the input dtype (PagedAttention paper, section 4.1).
    Only the cache slots of attended positions are read (blocks before a window may be reused).
    """
    num_heads = query.shape[1]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for s, seq_len in enumerate(lens):
        q_start, q_end = starts[s], starts[s + 1]
        q_len = q_end - q_start
        positions = torch.arange(seq_len - q_len, seq_len, device=query.device)  # [q_len]
        out[q_start:q_end][positions < 0] = 0
        valid = positions >= 0
        if not bool(valid.any()):
            continue
        rows = torch.arange(q_start, q_end, device=query.device)[valid]
        positions = positions[valid]
        first = max(0, int(positions[0]) - sliding_window + 1) if sliding_window > 0 else 0
        keys = torch.arange(first, seq_len, device=query.device)  # the attended positions
        blocks = block_tables[s].long()[keys // block_size]  # block_table[t // block_size]
        offsets = keys % block_size
        k = key_cache[blocks, offsets].float().repeat_interleave(group, dim=1)  # [n_keys, num_heads, head_size]
        v = value_cache[blocks, offsets].float().repeat_interleave(group, dim=1)
        q = query[rows].float()  # [n_rows, num_heads, head_size]
        scores = torch.einsum("rhd,thd->rht", q, k) * scale  # [n_rows, num_heads, n_keys]
        allowed = keys[None, :] <= positions[:, None]  # [n_rows, n_keys]
        if sliding_window > 0:
            allowed &= keys[None, :] > positions[:, None] - sliding_window
        scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[rows] = torch.einsum("rht,thd->rhd", probs, v).to(out.dtype)


def varlen_attention(
    out: torch.Tensor,  # [num_tokens, num_heads, head_size], written in place
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    cu_seqlens: torch.Tensor,  # [num_seqs + 1] int32: 0, then the cumulative sequence lengths
    scale: float,
) -> None:
    """Bidirectional attention over packed sequences (the encoders', no KV cache): the rows
    ``cu_seqlens[s] .. cu_seqlens[s + 1] - 1`` are sequence s, and each attends to all of them
    (no mask). One ``scaled_dot_product_attention`` per sequence in float32, rounded once to out's
    dtype. GQA: query head h reads KV head h // (num_heads // num_kv_heads)."""
    group = query.shape[1] // key.shape[1]
    bounds = cu_seqlens.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b == a:
            continue
        q = query[a:b].float().transpose(0, 1)  # [num_heads, L, head_size]
        k = key[a:b].float().repeat_interleave(group, dim=1).transpose(0, 1)
        v = value[a:b].float().repeat_interleave(group, dim=1).transpose(0, 1)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)  # [num_heads, L, head_size]
        out[a:b] = o.transpose(0, 1).to(out.dtype)

def kv_dequantize_blocks(
    out: torch.Tensor,  # [num_out, block_size, num_kv_heads, head_size] float, written in place
    codes: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size] int8 / float8
    scales: torch.Tensor,  # [num_blocks, block_size, num_kv_heads] bfloat16
    blocks: torch.Tensor,  # [num_out] int64
) -> None:
    """The 1-byte KV cache's read (pagedgen/ops/kv_quant.py): out[u] = codes[blocks[u]] dequantized,
    ``float(code) * float(scale)`` rounded to out's dtype."""
    out.copy_(codes[blocks].float() * scales[blocks].float().unsqueeze(-1))


def copy_blocks(
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size], written in place
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size], written in place
    block_mapping: torch.Tensor,  # [num_pairs, 2] int64 (src, dst)
) -> None:
    """Copy whole blocks within one layer's cache (copy-on-write)."""
    for src, dst in block_mapping.tolist():
        key_cache[dst] = key_cache[src]
        value_cache[dst] = value_cache[src]


def swap_blocks(
    src: torch.Tensor,  # [num_blocks_src, ...] one layer's key or value cache
    dst: torch.Tensor,  # [num_blocks_dst, ...] same trailing shape, maybe another device; in place
    block_mapping: torch.Tensor,  # [num_pairs, 2] int64 (src block, dst block)
) -> None:
    """Copy whole blocks between two caches, typically GPU <-> pinned CPU memory (swap preemption)."""
    for s, d in block_mapping.tolist():
        dst[d].copy_(src[s])


# ----- the model's small per-token layers (fused into one kernel each on the CPU) -------------------
# These follow transformers' modeling_llama step by step (same dtypes, same rounding points), so that
# the model run through them gives transformers' logits.


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    # LlamaRMSNorm: statistics in float32, the weight applied in the model dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + epsilon)
    return weight * h.to(x.dtype)


def rms_norm(
    out: torch.Tensor,  # [num_tokens, hidden], written in place
    input: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    epsilon: float,
) -> None:
    """out = RMSNorm(input) as transformers' LlamaRMSNorm (Zhang & Sennrich 2019)."""
    out.copy_(_rms_norm(input, weight, epsilon))


def fused_add_rms_norm(
    input: torch.Tensor,  # [num_tokens, hidden], overwritten with the norm
    residual: torch.Tensor,  # [num_tokens, hidden], overwritten with residual + input
    weight: torch.Tensor,  # [hidden]
    epsilon: float,
) -> None:
    """residual += input (in the model dtype), then input = RMSNorm(residual)."""
    residual.add_(input)
    input.copy_(_rms_norm(residual, weight, epsilon))


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_size], rotated in place
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size], rotated in place
    cos: torch.Tensor,  # [max_positions, head_size] float32
    sin: torch.Tensor,  # [max_positions, head_size] float32
) -> None:
    """Rotary position embedding in transformers' rotate-half form: x * cos + rotate_half(x) * sin,
    cos and sin taken at each token's position and converted to the model dtype first."""
    c = cos[positions].to(query.dtype).unsqueeze(1)  # [num_tokens, 1, head_size]
    s = sin[positions].to(query.dtype).unsqueeze(1)
    for x in (query, key):
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        x.copy_(x * c + rotated * s)


def silu_and_mul(
    out: torch.Tensor,  # [num_tokens, d], written in place
    input: torch.Tensor,  # [num_tokens, 2 * d]: gate, then up
) -> None:
    """out = silu(gate) * up, Llama's SwiGLU (Shazeer 2020) as transformers computes it."""
    gate, up = input.chunk(2, dim=-1)
    torch.mul(torch.nn.functional.silu(gate), up, out=out)


def fused_add_layer_norm(
    input: torch.Tensor,  # [num_tokens, hidden], overwritten with the norm
    residual: torch.Tensor,  # [num_tokens, hidden], overwritten with input + residual
    weight: Optional[torch.Tensor],  # [hidden] or None (with bias None: no affine)
    bias: Optional[torch.Tensor],  # [hidden] or None
    epsilon: float,
) -> None:
    """residual = input + residual (in the model dtype), then input = LayerNorm(residual) as
    torch.nn.LayerNorm computes it (float32 statistics, the biased variance; Ba et al. 2016)."""
    residual.copy_(input + residual)
    input.copy_(torch.nn.functional.layer_norm(residual, (residual.shape[-1],), weight, bias, epsilon))


def argmax(
    out: torch.Tensor,  # [num_rows] int64, written in place
    logits: torch.Tensor,  # [num_rows, vocab] float32, bfloat16 or float16
) -> None:
    """The greedy token of each row: the first index of the row's maximum, a NaN counting as the
    maximum (the first NaN's index), -0.0 equal to +0.0; torch.argmax(logits, dim=-1)."""
    out.copy_(logits.max(dim=-1).indices)


def logprob_topk(
    out: torch.Tensor,  # [num_rows, 3 + 2 * k_max] float64, written in place
    logits: torch.Tensor,  # [num_rows, vocab] float32, bfloat16 or float16: the raw logits
    token_ids: torch.Tensor,  # [num_rows] int64 in [0, vocab): the chosen token of each row
    k_max: int,  # top logprobs per row, 0 <= k_max <= vocab
) -> None:
    """vLLM's logprobs of each row, packed: (chosen id, its logprob, its rank, the top k_max
    logprobs, their ids). A logprob is ``logit - logsumexp(row)`` in float32 (no [rows, vocab]
    log-softmax: the same order as the logits); the rank is the number of logits >= the chosen one;
    the top k are by value descending, ties by lowest token id (``top_logprobs``). One [rows, vocab]
    float32 copy of bf16/fp16 logits. float64 holds float32 values and token ids exactly."""
    x = logits.float()  # [R, V] float32 (no copy when it is already)
    lse = torch.logsumexp(x, dim=-1, keepdim=True)  # [R, 1]
    chosen = x.gather(1, token_ids.unsqueeze(1))  # [R, 1] logits
    ranks = (x >= chosen).sum(dim=-1, keepdim=True)  # [R, 1]: the same order as the logprobs
    parts = [token_ids.unsqueeze(1).double(), (chosen - lse).double(), ranks.double()]
    if k_max:
        top_x, top_ids = top_logprobs(x, k_max)  # [R, k_max], descending
        parts += [(top_x - lse).double(), top_ids.double()]
    out.copy_(torch.cat(parts, dim=1))


def top_logprobs(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest entries of each row: (values [R, k], token ids [R, k] int64), by value descending
    and, among equal values, by token id ascending (whatever the other rows; a batch holding a NaN
    falls back to ``torch.topk``'s own order of ties). ``logprobs``: [R, V] float32 (logits or
    logprobs: the same order), 1 <= k <= V."""
    values = logprobs.topk(k, dim=-1).values  # [R, k]: the k largest values themselves are exact
    rows, ids = (logprobs >= values[:, -1:]).nonzero(as_tuple=True)  # candidates, row-major: ids ascending
    counts = torch.bincount(rows, minlength=logprobs.shape[0])  # [R], >= k unless a row holds NaN
    # NOTE: nonzero above already waits for the device; this test adds no further sync
    if bool((counts < k).any()):
        return logprobs.topk(k, dim=-1)
    cand = logprobs[rows, ids]
    order = cand.sort(descending=True, stable=True).indices  # by value; stable: ids ascending among ties
    order = order[rows[order].sort(stable=True).indices]  # then by row, keeping that order within rows
    starts = counts.cumsum(0) - counts  # [R]: each row's first candidate
    take = order[(starts.unsqueeze(1) + torch.arange(k, device=logprobs.device)).view(-1)].view(-1, k)  # [R, k]
    return cand[take], ids[take]


def packed_linear(
    out: torch.Tensor,  # [M, N], input's dtype, written in place
    input: torch.Tensor,  # [M, K] float32, bfloat16 or float16
    weight: torch.Tensor,  # [ceil(N / 16), K, 16]: W [N, K] as panels of 16 output features
    bias: Optional[torch.Tensor] = None,  # [N] or None
) -> None:
    """``out = input @ W^T + bias`` in float32, rounded once to out's dtype, with the weight given as
    panels: ``weight[p, k, j] = W[16 p + j, k]`` (``pagedgen.layers.matmul.pack_panels``; zeros pad
    the last panel). The kernel sums each output over k in order; this reference lets torch's GEMM
    pick its order, so the two agree to float32 rounding, not bitwise."""
    n = out.shape[1]
    w = weight.transpose(1, 2).reshape(weight.shape[0] * weight.shape[2], weight.shape[1])[:n]  # [N, K]
    y = torch.nn.functional.linear(input.float(), w.float(), None if bias is None else bias.float())
    out.copy_(y)


def packed_linear_bf16(
    out: torch.Tensor,  # [M, N] bfloat16, written in place
    input: torch.Tensor,  # [M, K] bfloat16
    weight: torch.Tensor,  # [ceil(N / 16), ceil(K / 2), 16, 2] bfloat16: W [N, K] as pairs in panels of 16
    bias: Optional[torch.Tensor] = None,  # [N] or None
) -> None:
    """``out = input @ W^T + bias`` in float32, rounded once to bf16, with the weight given as bf16
    pairs in panels: ``weight[p, q, j, t] = W[16 p + j, 2 q + t]`` (``pagedgen.layers.matmul.pack_pairs``;
    zeros pad the last panel and an odd K's last pair). The kernel adds the pairs' products in q order
    (vdpbf16ps); this reference lets torch's float32 GEMM pick its order, so the two agree to float32
    rounding, not bitwise."""
    n, k = out.shape[1], input.shape[1]
    p, q = weight.shape[0], weight.shape[1]
    w = weight.permute(0, 2, 1, 3).reshape(p * weight.shape[2], q * 2)[:n, :k]  # [N, K]
    y = torch.nn.functional.linear(input.float(), w.float(), None if bias is None else bias.float())
    out.copy_(y)


def quantize_rows_int8(
    input: torch.Tensor,  # [M, K] float32, bfloat16 or float16
    input_scale: Optional[torch.Tensor] = None,  # [1] float32 (static) or None (dynamic, per row)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization of activation rows, as ``int8_linear``'s kernel does it in its
    prologue: in float32, ``scale[m] = max_k |x[m, k]| / 127`` (dynamic, per row; 1 for a row of
    zeros) or the static ``input_scale``; ``q = clamp(rint(x / scale), -128, 127)`` (round half to
    even, an IEEE float32 division per element). Returns (q [M, K] int8, scale [M] float32)."""
    x = input.float()
    if input_scale is None:
        scale = x.abs().amax(dim=1) / 127.0 if x.shape[1] else x.new_zeros(x.shape[0])
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    else:
        scale = input_scale.float().reshape(1).expand(x.shape[0]).contiguous()
    q = torch.round(x / scale[:, None]).clamp_(-128, 127).to(torch.int8)
    return q, scale


def int8_linear(
    out: torch.Tensor,  # [M, N] float32, bfloat16 or float16 (input's dtype), written in place
    input: torch.Tensor,  # [M, K] float32, bfloat16 or float16
    weight: torch.Tensor,  # [ceil(N / 16), ceil(K / 2), 16, 2] int8: W [N, K] as int8 pairs in panels of 16
    weight_scale: torch.Tensor,  # [N] float32: the real weight row n is W[n, :] * weight_scale[n]
    input_scale: Optional[torch.Tensor] = None,  # [1] float32 (static) or None (dynamic per-row scales)
    bias: Optional[torch.Tensor] = None,  # [N] or None
) -> None:
    """W8A8 int8 GEMM (compressed-tensors' / vLLM's "int8 W8A8", fake quantization in float): the
    rows of ``input`` quantized to int8 (``quantize_rows_int8``), exact integer sums ``acc[m, n] =
    sum_k q[m, k] * weight[n, k]`` (computed in float64, exact while K * 128 * 128 < 2^53), then in
    float32 ``y = float32(acc) * x_scale[m] * weight_scale[n] + bias[n]`` in that order, rounded once
    to out's dtype. The weight is packed as ``pagedgen.layers.matmul.pack_int8`` does it:
    ``weight[p, q, j, t] = W[16 p + j, 2 q + t]``, zeros past N and K (bf16 pairs' layout, in int8). Every
    row depends on itself only (batch-invariant), and the CPU kernel gives the same bits (integer sums
    are exact whatever their order)."""
    n, k = out.shape[1], input.shape[1]
    w = weight.permute(0, 2, 1, 3).reshape(weight.shape[0] * weight.shape[2], weight.shape[1] * 2)[:n, :k]  # [N, K]
    q, x_scale = quantize_rows_int8(input, input_scale)
    acc = (q.double() @ w.double().t()).float()  # exact integers; float32 rounds them as cvtdq2ps does
    y = acc * x_scale[:, None] * weight_scale.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    out.copy_(y)


def add_lora_linear(
    out: torch.Tensor,  # [M, N] float32, bfloat16 or float16 (input's dtype), += each row's delta in place
    input: torch.Tensor,  # [M, K]
    lora_a: torch.Tensor,  # [S, K, P R]: A^T of each slot, parts side by side
    lora_b: torch.Tensor,  # [S, R, N]: (scale B)^T of each slot, lora_a's dtype
    slots: torch.Tensor,  # [M] int32: the row's slot, -1 for none
    output_slices: list,  # P sizes summing to N
) -> None:
    """Multi-LoRA (punica's SGMV, vLLM's ``add_lora_linear``): for each row m with ``s = slots[m] >= 0``,
    ``h = input[m] @ lora_a[s]`` in float32, then ``out[m, n] += h[p R : (p + 1) R] @ lora_b[s, :, n]``
    for n in output slice p (``output_slices``' p-th run of columns), rounded once to out's dtype; rows
    of slot -1 are left as they are. The kernel sums over k and i in order; this reference runs every
    slot over every row with torch's GEMMs (no host sync: the GPU's path), so the two agree to float32
    rounding, not bitwise."""
    R = lora_b.shape[1]
    x = input.float()
    delta = torch.zeros(out.shape, dtype=torch.float32, device=out.device)  # [M, N]
    for s in range(lora_a.shape[0]):
        h = x @ lora_a[s].float()  # [M, P R]
        parts = [hp @ bp for hp, bp in zip(h.split(R, dim=1), lora_b[s].float().split(list(output_slices), dim=1))]
        d = torch.cat(parts, dim=1) if parts else delta  # [M, N]
        delta = torch.where((slots == s)[:, None], d, delta)
    out.copy_(torch.where((slots >= 0)[:, None], out.float() + delta, out.float()))


def int4_linear(
    out: torch.Tensor,  # [M, N] float32, bfloat16 or float16 (input's dtype), written in place
    input: torch.Tensor,  # [M, K] float32, bfloat16 or float16
    weight: torch.Tensor,  # [ceil(N / 16), K, 8] uint8: codes of outputs 16 p + b (low nibble) and 16 p + b + 8 (high)
    weight_scale: torch.Tensor,  # [ceil(N / 16), ceil(K / group_size), 16] float32 (the last group may be partial)
    weight_zero: torch.Tensor,  # [ceil(N / 16), ceil(K / group_size), 16] uint8 zero points (0..16)
    group_size: int,  # input features per group (K: one group per output channel)
    bias: Optional[torch.Tensor] = None,  # [N] or None
) -> None:
    """int4 W4A16 GEMM (GPTQ / AWQ / compressed-tensors pack-quantized, fake quantization in float):
    each weight dequantized in float32 as ``float32(q - z) * s`` (q the 4-bit code, z and s its
    output's zero point and scale for its group of ``group_size`` input features; one float32
    rounding), then ``out = float32(input) @ W^T + bias`` in float32, rounded once to out's dtype.
    The weight layout is ``pagedgen.layers.quant_int4.pack_int4``'s: ``weight[p, k, b] =
    q[16 p + b, k] | q[16 p + b + 8, k] << 4``. The kernel sums each output over k in order (fused
    multiply-adds); this reference lets torch's float32 GEMM pick its order, so the two agree to
    float32 rounding, not bitwise."""
    n = out.shape[1]
    p, k, _ = weight.shape
    codes = torch.cat([weight & 0xF, weight >> 4], dim=2).transpose(1, 2).reshape(p * 16, k)[:n].to(torch.int32)  # [N, K]
    s = weight_scale.float().transpose(1, 2).reshape(p * 16, -1)[:n].repeat_interleave(group_size, dim=1)[:, :k]  # [N, K]
    z = weight_zero.transpose(1, 2).reshape(p * 16, -1)[:n].to(torch.int32).repeat_interleave(group_size, dim=1)[:, :k]
    w = (codes - z).float() * s
    y = torch.nn.functional.linear(input.float(), w, None if bias is None else bias.float())
    out.copy_(y)


def fp8_linear(
    out: torch.Tensor,  # [M, N] float32, bfloat16 or float16 (input's dtype), written in place
    input: torch.Tensor,  # [M, K] float32, bfloat16 or float16
    weight: torch.Tensor,  # [ceil(N / 16), K, 16] float8_e4m3fn: weight[p, k, j] = code[16 p + j, k]
    weight_scale: torch.Tensor,  # [N] float32 (block_k 0) or [N, ceil(K / block_k)] float32
    block_k: int,  # input features per scale block; 0: one scale per output channel
    bias: Optional[torch.Tensor] = None,  # [N] or None
) -> None:
    """FP8 W8A16 GEMM (FP8 checkpoints, online ``quantization="fp8"``; fake quantization in float):
    each weight dequantized in float32 as ``float32(code[n, k]) * weight_scale[n]`` (or
    ``* weight_scale[n, k // block_k]``; one float32 rounding), then ``out = float32(input) @ W^T +
    bias`` in float32, rounded once to out's dtype. The weight layout is
    ``pagedgen.layers.quant_fp8.pack_fp8``'s. The kernel sums each output over k in order (fused
    multiply-adds); this reference lets torch's float32 GEMM pick its order, so the two agree to
    float32 rounding, not bitwise. A NaN code (0x7f / 0xff) gives NaN here; the loaders refuse them."""
    n = out.shape[1]
    p, k, _ = weight.shape
    codes = weight.float().transpose(1, 2).reshape(p * 16, k)[:n]  # [N, K] float32 (exact)
    s = weight_scale.float()
    s = s[:, None] if block_k == 0 else s.repeat_interleave(block_k, dim=1)[:, :k]  # [N, 1] or [N, K]
    y = torch.nn.functional.linear(input.float(), codes * s, None if bias is None else bias.float())
    out.copy_(y)
