"""OPT (transformers' ``modeling_opt``, Zhang et al. 2022; the model of the PagedAttention paper's
evaluation).

    token ids [T], positions [T]
      -> project_in(embed_tokens(ids)) + embed_positions(positions + 2)   [T, hidden]
      -> layers x N (do_layer_norm_before: pre-norm, as OPT-350m is not):
           x = x + self_attn(self_attn_layer_norm(x))   q scaled by 1/sqrt(head_dim) after q_proj
           x = x + fc2(relu(fc1(final_layer_norm(x))))
         (post-norm: the same norms applied after each residual add instead)
      -> rows at logits_indices -> final_layer_norm (pre-norm models only) -> project_out
      -> lm_head (tied to embed_tokens, width word_embed_proj_dim)        [S, vocab]

``project_in``/``project_out`` exist when ``word_embed_proj_dim`` != ``hidden_size`` (OPT-350m).
Checkpoints saved from the bare model start with ``decoder.`` (``model.`` is prepended).
"""
from __future__ import annotations

from typing import Optional

import torch

from pagedgen.config import ModelConfig
from pagedgen.distributed.group import PPGroup, TPGroup
from pagedgen.layers.activation import get_act_fn
from pagedgen.layers.attention import Attention
from pagedgen.layers.embedding import ParallelLMHead, PositionEmbedding, VocabParallelEmbedding
from pagedgen.layers.linear import ColumnParallelLinear, QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from pagedgen.layers.module import Module
from pagedgen.layers.norm import LayerNorm
from pagedgen.model.base import CausalLM, IntermediateTensors, KVCache
from pagedgen.model.stages import is_last, make_layers, on_first, on_last, stage_layers
from pagedgen.ops import AttentionMetadata

POSITION_OFFSET = 2  # OPT's learned positions reserve rows 0 and 1


class OPTAttention(Module):
    def __init__(self, config: ModelConfig, bias: bool, tp: Optional[TPGroup] = None) -> None:
        super().__init__()
        H, D = config.num_heads, config.head_dim
        self.scaling = D**-0.5
        self.qkv_proj = QKVParallelLinear(config.hidden_size, D, H, H, bias=bias, tp=tp)
        self.attn = Attention(self.qkv_proj.num_heads, D, 1.0, self.qkv_proj.num_heads)  # q is scaled before, as transformers does
        self.out_proj = RowParallelLinear(config.hidden_size, config.hidden_size, bias=bias, tp=tp)

    def forward(self, h: torch.Tensor, kv_cache: KVCache, attn: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(h))  # [T, H, D] each
        q.mul_(self.scaling)
        return self.out_proj(self.attn(q, k, v, kv_cache, attn).view(h.shape[0], -1))


class OPTDecoderLayer(Module):
    def __init__(self, hf_config, config: ModelConfig, tp: Optional[TPGroup] = None) -> None:
        super().__init__()
        hidden, bias, affine = config.hidden_size, hf_config.enable_bias, hf_config.layer_norm_elementwise_affine
        self.pre_norm = hf_config.do_layer_norm_before
        self.self_attn = OPTAttention(config, bias, tp)
        self.self_attn_layer_norm = LayerNorm(hidden, elementwise_affine=affine)
        self.fc1 = ColumnParallelLinear(hidden, hf_config.ffn_dim, bias=bias, tp=tp)
        self.act = get_act_fn(hf_config.activation_function, "activation_function")
        self.fc2 = RowParallelLinear(hf_config.ffn_dim, hidden, bias=bias, tp=tp)
        self.final_layer_norm = LayerNorm(hidden, elementwise_affine=affine)

    def forward(self, x: torch.Tensor, kv_cache: KVCache, attn: AttentionMetadata) -> torch.Tensor:
        if self.pre_norm:
            x = x + self.self_attn(self.self_attn_layer_norm(x), kv_cache, attn)
            return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))
        x = self.self_attn_layer_norm(x + self.self_attn(x, kv_cache, attn))
        return self.final_layer_norm(x + self.fc2(self.act(self.fc1(x))))


class OPTDecoder(Module):
    """Pipeline stages (``pp``): the embeddings and project_in on the first, final_layer_norm and
    project_out on the last; the stages hand on x [T, hidden]."""

    def __init__(self, hf_config, config: ModelConfig, tp: Optional[TPGroup] = None, pp: Optional[PPGroup] = None) -> None:
        super().__init__()
        hidden, word_dim = config.hidden_size, hf_config.word_embed_proj_dim
        self.embed_tokens = on_first(pp, lambda: VocabParallelEmbedding(config.vocab_size, word_dim, tp=tp))
        self.embed_positions = on_first(pp, lambda: PositionEmbedding(config.max_position_embeddings, hidden, offset=POSITION_OFFSET))
        self.project_in = on_first(pp, lambda: ReplicatedLinear(word_dim, hidden)) if word_dim != hidden else None
        self.project_out = on_last(pp, lambda: ReplicatedLinear(hidden, word_dim)) if word_dim != hidden else None
        self.layers = make_layers(config.num_layers, lambda i: OPTDecoderLayer(hf_config, config, tp), pp)
        self.stage_layers = stage_layers(self.layers, pp)
        keep_final_norm = hf_config.do_layer_norm_before and not getattr(hf_config, "_remove_final_layer_norm", False)
        self.final_layer_norm = on_last(pp, lambda: LayerNorm(hidden, elementwise_affine=hf_config.layer_norm_elementwise_affine)) if keep_final_norm else None
        self.is_last = is_last(pp)

    def forward(self, input_ids, positions, attn: AttentionMetadata, kv_caches: list[KVCache], logits_indices,
                intermediate: Optional[IntermediateTensors] = None):
        if intermediate is None:
            x = self.embed_tokens(input_ids)  # [T, word_embed_proj_dim]
            if self.project_in is not None:
                x = self.project_in(x)
            x = x + self.embed_positions(positions)  # [T, hidden]
        else:
            x = intermediate[0]  # [T, hidden], from the previous stage
        for layer, kv_cache in zip(self.stage_layers, kv_caches):
            x = layer(x, kv_cache, attn)
        if not self.is_last:
            return (x,)
        x = x[logits_indices]  # [S, hidden]
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)  # [S, word_embed_proj_dim]
        return x


class OPTModel(Module):
    def __init__(self, hf_config, config: ModelConfig, tp: Optional[TPGroup] = None, pp: Optional[PPGroup] = None) -> None:
        super().__init__()
        self.decoder = OPTDecoder(hf_config, config, tp, pp)

    def forward(self, *args) -> torch.Tensor:
        return self.decoder(*args)


class OPTForCausalLM(CausalLM):
    """``OPTForCausalLM``."""

    packed_modules_mapping = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}
    required_config_fields = ("ffn_dim",)
    shape_fields = ("hidden_size", "ffn_dim", "word_embed_proj_dim", "num_attention_heads", "max_position_embeddings", "vocab_size")
    embed_tokens_name = "model.decoder.embed_tokens"

    def __init__(self, hf_config, config: ModelConfig, tp: Optional[TPGroup] = None, pp: Optional[PPGroup] = None) -> None:
        super().__init__(hf_config, config, tp, pp)
        self.model = OPTModel(hf_config, config, tp, pp)
        embed = self.model.decoder.embed_tokens
        self.lm_head = on_last(pp, lambda: ParallelLMHead(
            config.vocab_size, hf_config.word_embed_proj_dim, tie_to=embed if config.tie_word_embeddings else None, tp=tp))
