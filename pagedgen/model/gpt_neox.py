"""GPT-NeoX and Pythia (transformers' ``modeling_gpt_neox``, Black et al. 2022; Biderman et al. 2023).

    token ids [T]
      -> embed_in                                               [T, hidden]
      -> layers x N:
           a = attention(input_layernorm(x))   query_key_value -> partial RoPE -> paged attention -> dense
           use_parallel_residual:  x = mlp(post_attention_layernorm(x)) + a + x
           otherwise:              x = a + x;  x = mlp(post_attention_layernorm(x)) + x
              mlp: dense_h_to_4h -> gelu -> dense_4h_to_h
      -> rows at logits_indices -> final_layer_norm
      -> embed_out (the lm_head, untied by default)              [S, vocab]

RoPE rotates only the first ``partial_rotary_factor`` (``rotary_pct``) of each head's features.
Checkpoints store the fused q/k/v per head (``[num_heads, 3, head_dim]`` along the output
features), reordered on load (``layout="interleaved_qkv"``); older ones carry the buffers
``attention.bias``, ``attention.masked_bias`` and ``rotary_emb.inv_freq`` (ignored).
"""
from __future__ import annotations

from typing import Optional

import torch

from pagedgen.config import ModelConfig
from pagedgen.distributed.group import PPGroup, TPGroup
from pagedgen.layers.activation import get_act_fn
from pagedgen.layers.attention import Attention
from pagedgen.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedgen.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedgen.layers.module import Module
from pagedgen.layers.norm import LayerNorm
from pagedgen.layers.rotary_embedding import RotaryEmbedding, get_rope
from pagedgen.model.base import CausalLM, IntermediateTensors, KVCache
from pagedgen.model.stages import is_last, make_layers, on_first, on_last, stage_layers
from pagedgen.ops import AttentionMetadata


class GPTNeoXAttention(Module):
    def __init__(self, hf_config, config: ModelConfig, rotary_emb: RotaryEmbedding, tp: Optional[TPGroup] = None) -> None:
        super().__init__()
        H, D, bias = config.num_heads, config.head_dim, hf_config.attention_bias
        self.query_key_value = QKVParallelLinear(config.hidden_size, D, H, H, bias=bias, layout="interleaved_qkv", tp=tp)
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.query_key_value.num_heads, D, D**-0.5, self.query_key_value.num_heads)
        self.dense = RowParallelLinear(config.hidden_size, config.hidden_size, bias=bias, tp=tp)

    def forward(self, positions, h: torch.Tensor, kv_cache: KVCache, attn: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.query_key_value.split(self.query_key_value(h))  # [T, H, D] each
        self.rotary_emb(positions, q, k)  # in place, first rotary_dim features
        return self.dense(self.attn(q, k, v, kv_cache, attn).view(h.shape[0], -1))


class GPTNeoXMLP(Module):
    def __init__(self, hf_config, tp: Optional[TPGroup] = None) -> None:
        super().__init__()
        self.dense_h_to_4h = ColumnParallelLinear(hf_config.hidden_size, hf_config.intermediate_size, bias=True, tp=tp)
        self.act = get_act_fn(hf_config.hidden_act)
        self.dense_4h_to_h = RowParallelLinear(hf_config.intermediate_size, hf_config.hidden_size, bias=True, tp=tp)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(h)))


class GPTNeoXLayer(Module):
    def __init__(self, hf_config, config: ModelConfig, rotary_emb: RotaryEmbedding, tp: Optional[TPGroup] = None) -> None:
        super().__init__()
        self.use_parallel_residual = hf_config.use_parallel_residual
        self.input_layernorm = LayerNorm(config.hidden_size, hf_config.layer_norm_eps)
        self.post_attention_layernorm = LayerNorm(config.hidden_size, hf_config.layer_norm_eps)
        self.attention = GPTNeoXAttention(hf_config, config, rotary_emb, tp)
        self.mlp = GPTNeoXMLP(hf_config, tp)

    def forward(self, positions, x: torch.Tensor, kv_cache: KVCache, attn: AttentionMetadata) -> torch.Tensor:
        a = self.attention(positions, self.input_layernorm(x), kv_cache, attn)
        if self.use_parallel_residual:
            return self.mlp(self.post_attention_layernorm(x)) + a + x  # transformers' order of the adds
        a = a + x
        return self.mlp(self.post_attention_layernorm(a)) + a


class GPTNeoXModel(Module):
    """Pipeline stages (``pp``): embed_in on the first, final_layer_norm on the last; the stages
    hand on x [T, hidden]."""

    def __init__(self, hf_config, config: ModelConfig, tp: Optional[TPGroup] = None, pp: Optional[PPGroup] = None) -> None:
        super().__init__()
        rotary_emb = get_rope(hf_config, config.head_dim)
        self.embed_in = on_first(pp, lambda: VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=tp))
        self.layers = make_layers(config.num_layers, lambda i: GPTNeoXLayer(hf_config, config, rotary_emb, tp), pp)
        self.stage_layers = stage_layers(self.layers, pp)
        self.final_layer_norm = on_last(pp, lambda: LayerNorm(config.hidden_size, hf_config.layer_norm_eps))
        self.is_last = is_last(pp)

    def forward(self, input_ids, positions, attn: AttentionMetadata, kv_caches: list[KVCache], logits_indices,
                intermediate: Optional[IntermediateTensors] = None):
        x = self.embed_in(input_ids) if intermediate is None else intermediate[0]  # [T, hidden]
        for layer, kv_cache in zip(self.stage_layers, kv_caches):
            x = layer(positions, x, kv_cache, attn)
        if not self.is_last:
            return (x,)
        return self.final_layer_norm(x[logits_indices])  # [S, hidden]


class GPTNeoXForCausalLM(CausalLM):
    """``GPTNeoXForCausalLM`` (GPT-NeoX-20B, Pythia)."""

    base_model_prefix = "gpt_neox"
    lm_head_name = "embed_out"
    embed_tokens_name = "gpt_neox.embed_in"
    ignored_weights = (r"\.attention\.bias$", r"\.attention\.masked_bias$", r"\.rotary_emb\.inv_freq$")
    required_config_fields = ("intermediate_size",)
    shape_fields = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")

    def __init__(self, hf_config, config: ModelConfig, tp: Optional[TPGroup] = None, pp: Optional[PPGroup] = None) -> None:
        super().__init__(hf_config, config, tp, pp)
        self.gpt_neox = GPTNeoXModel(hf_config, config, tp, pp)
        self.embed_out = on_last(pp, lambda: ParallelLMHead(
            config.vocab_size, config.hidden_size, tie_to=self.gpt_neox.embed_in if config.tie_word_embeddings else None, tp=tp))
