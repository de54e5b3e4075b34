"""Plain PyTorch references of the pagedgen ops: the fallback when the extension is not built and the
oracle the kernels are tested against. Deliberately simple: loops over the block table, no tricks.

Cache layout (one layer): key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size].
A slot is block_id * block_size + offset; a negative slot is padding and is skipped.
"""
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
    out: torch.Tensor,  # [num_seqs, num_heads, head_size], written in place
    query: torch.Tensor,  # [num_seqs, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
) -> None:
    """Decode attention: query i attends over the first seq_lens[i] cached tokens of its block table.

    Grouped-query attention: query head h reads KV head h // (num_heads // num_kv_heads).
    Softmax is computed in float32 whatever the input dtype (PagedAttention paper, section 4.1).
    """
    num_seqs, num_heads, head_size = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    for i in range(num_seqs):
        seq_len = int(seq_lens[i])
        if seq_len <= 0:
            out[i] = 0
            continue
        positions = torch.arange(seq_len, device=query.device)
        blocks = block_tables[i].long()[positions // block_size]  # block_table[j // block_size]
        offsets = positions % block_size
        k = key_cache[blocks, offsets].float()  # [seq_len, num_kv_heads, head_size]
        v = value_cache[blocks, offsets].float()
        k = k.repeat_interleave(group, dim=1)  # [seq_len, num_heads, head_size]
        v = v.repeat_interleave(group, dim=1)
        q = query[i].float()  # [num_heads, head_size]
        scores = torch.einsum("hd,thd->ht", q, k) * scale  # [num_heads, seq_len]
        probs = torch.softmax(scores, dim=-1)
        out[i] = torch.einsum("ht,thd->hd", probs, v).to(out.dtype)


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
