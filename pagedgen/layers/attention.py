"""The attention layer: the only place a model touches the paged KV cache.

Every family's attention projects q/k/v and applies its position embedding, then calls
``Attention.forward(q, k, v, kv_cache, attn)``, which writes the new keys/values into their slots
(``ops.reshape_and_cache``) and attends over each token's sequence through its block table
(``ops.paged_attention``, PagedAttention paper section 4.1). The step's ``AttentionMetadata``
(``pagedgen.ops.metadata``) is built by the model runner and passed through unchanged; each layer
adds its own sliding window. ``_paged_attention`` below is the one call of the attention op, so a
change of its arguments is a change to that one function.

With ``kv_cache_dtype`` int8 / fp8 a layer's cache is (key_cache, value_cache, key_scales,
value_scales) (``pagedgen.ops.kv_quant``): the writes quantize, the reads dequantize.
"""
from __future__ import annotations

import torch

from pagedgen import ops
from pagedgen.ops import AttentionMetadata, kv_quant
from pagedgen.layers.module import Module


def _paged_attention(
    out: torch.Tensor,  # [T, num_heads, head_dim], written
    query: torch.Tensor,  # [T, num_heads, head_dim]
    kv_cache: tuple,  # key_cache, value_cache [num_blocks, block_size, num_kv_heads, head_dim] (+ their scales)
    attn: AttentionMetadata,
    scale: float,
    sliding_window: int,
) -> None:
    """The one call of ``ops.paged_attention`` (the varlen op: each sequence's rows of ``query``
    attend causally over its cached tokens, within ``sliding_window`` when it is not 0), or of
    ``ops.paged_attention_quantized`` over a 1-byte cache (its kernel reads the codes; without it,
    the copy path's gather plan is made once per step)."""
    if len(kv_cache) == 2:
        ops.paged_attention(out, query, *kv_cache, attn.block_tables, attn.seq_lens, attn.query_start_loc, scale, sliding_window)
        return
    if attn.kv_gather is None and not ops.quantized_attention_reads_codes(query.device.type):
        attn.kv_gather = kv_quant.gather_plan(attn.block_tables, attn.seq_lens, kv_cache[0].shape[1])
    ops.paged_attention_quantized(out, query, *kv_cache, attn.block_tables, attn.seq_lens, attn.query_start_loc, scale,
                                  sliding_window, attn.kv_gather)


class Attention(Module):
    """Causal attention of this step's tokens over their sequences' cached keys and values.

    Args:
        num_heads, head_dim: query heads and features per head.
        scale: multiplier of q·k (usually head_dim ** -0.5).
        num_kv_heads: key/value heads (grouped-query attention: num_heads is a multiple).
        sliding_window: 0 for none, else a token at position p attends over (p - window, p]
            (Mistral; transformers' ``sliding_window_overlay``).

    ``forward(q [T, H, D], k [T, Hkv, D], v [T, Hkv, D], kv_cache, attn) -> [T, H, D]``; ``kv_cache``
    is this layer's (key_cache, value_cache), each [num_blocks, block_size, Hkv, D], or with a
    1-byte cache (key_cache, value_cache, key_scales, value_scales) (``pagedgen.ops.kv_quant``).
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int, sliding_window: int = 0) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})")
        self.num_heads, self.head_dim, self.scale = num_heads, head_dim, scale
        self.num_kv_heads, self.sliding_window = num_kv_heads, sliding_window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], attn: AttentionMetadata) -> torch.Tensor:
        if len(kv_cache) == 2:
            ops.reshape_and_cache(k, v, *kv_cache, attn.slot_mapping)
        else:
            ops.reshape_and_cache_quantized(k, v, *kv_cache, attn.slot_mapping)
        out = torch.empty(q.shape[0], self.num_heads, self.head_dim, dtype=q.dtype, device=q.device)  # [T, H, D]
        _paged_attention(out, q, kv_cache, attn, self.scale, self.sliding_window)
        return out
