"""GPT-2 (transformers' ``modeling_gpt2``, Radford et al. 2019).

    token ids [T], positions [T]
      -> wte(ids) + wpe(positions)                              [T, hidden]
      -> h x N:
           x = x + attn(ln_1(x))    attn: c_attn (q|k|v) -> paged attention -> c_proj
           x = x + mlp(ln_2(x))     mlp:  c_fc -> gelu_new -> c_proj
      -> rows at logits_indices -> ln_f
      -> lm_head (tied to wte)                                  [S, vocab]

Checkpoints store every projection as a ``Conv1D``, ``[in_features, out_features]``: loaded
transposed into ordinary linear layers (``layout="conv1d"``). Older checkpoints lack the
``transformer.`` prefix and carry the causal-mask buffers ``attn.bias`` / ``attn.masked_bias``
(ignored).
"""
from __future__ import annotations

from typing import Optional

import torch

from pagedgen.config import ModelConfig
from pagedgen.distributed.group import PPGroup, TPGroup
from pagedgen.layers.activation import get_act_fn
from pagedgen.layers.attention import Attention
from pagedgen.layers.embedding import ParallelLMHead, PositionEmbedding, VocabParallelEmbedding
from pagedgen.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedgen.layers.module import Module
from pagedgen.layers.norm import LayerNorm
from pagedgen.model.base import CausalLM, IntermediateTensors, KVCache
from pagedgen.model.stages import is_last, make_layers, on_first, on_last, stage_layers
from pagedgen.ops import AttentionMetadata


class GPT2Attention(Module):
    """Multi-head attention; q·k scaled by 1/sqrt(head_dim) (``scale_attn_weights``) and by
    1/(layer index + 1) with ``scale_attn_by_inverse_layer_idx``."""

    def __init__(self, hf_config, config: ModelConfig, layer_idx: int, tp: Optional[TPGroup] = None) -> None:
        super().__init__()
        H, D = config.num_heads, config.head_dim
        scale = D**-0.5 if hf_config.scale_attn_weights else 1.0
        if hf_config.scale_attn_by_inverse_layer_idx:
            scale /= float(layer_idx + 1)
        self.c_attn = QKVParallelLinear(config.hidden_size, D, H, H, bias=True, layout="conv1d", tp=tp)
        self.attn = Attention(self.c_attn.num_heads, D, scale, self.c_attn.num_heads)
        self.c_proj = RowParallelLinear(config.hidden_size, config.hidden_size, bias=True, layout="conv1d", tp=tp)

    def forward(self, h: torch.Tensor, kv_cache: KVCache, attn: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.c_attn.split(self.c_attn(h))  # [T, H, D] each
        return self.c_proj(self.attn(q, k, v, kv_cache, attn).view(h.shape[0], -1))


class GPT2MLP(Module):
    def __init__(self, hf_config, hidden_size: int, tp: Optional[TPGroup] = None) -> None:
        super().__init__()
        inner = hf_config.n_inner or 4 * hidden_size
        self.c_fc = ColumnParallelLinear(hidden_size, inner, bias=True, layout="conv1d", tp=tp)
        self.act = get_act_fn(hf_config.activation_function, "activation_function")
        self.c_proj = RowParallelLinear(inner, hidden_size, bias=True, layout="conv1d", tp=tp)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(h)))


class GPT2Block(Module):
    def __init__(self, hf_config, config: ModelConfig, layer_idx: int, tp: Optional[TPGroup] = None) -> None:
        super().__init__()
        eps = hf_config.layer_norm_epsilon
        self.ln_1 = LayerNorm(config.hidden_size, eps)
        self.attn = GPT2Attention(hf_config, config, layer_idx, tp)
        self.ln_2 = LayerNorm(config.hidden_size, eps)
        self.mlp = GPT2MLP(hf_config, config.hidden_size, tp)

    def forward(self, x: torch.Tensor, kv_cache: KVCache, attn: AttentionMetadata) -> torch.Tensor:
        x = self.attn(self.ln_1(x), kv_cache, attn) + x
        return x + self.mlp(self.ln_2(x))


class GPT2Model(Module):
    """Pipeline stages (``pp``): wte/wpe on the first, ln_f on the last; the stages hand on x [T, hidden]."""

    def __init__(self, hf_config, config: ModelConfig, tp: Optional[TPGroup] = None, pp: Optional[PPGroup] = None) -> None:
        super().__init__()
        self.wte = on_first(pp, lambda: VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=tp))
        self.wpe = on_first(pp, lambda: PositionEmbedding(config.max_position_embeddings, config.hidden_size))
        self.h = make_layers(config.num_layers, lambda i: GPT2Block(hf_config, config, i, tp), pp)
        self.stage_layers = stage_layers(self.h, pp)
        self.ln_f = on_last(pp, lambda: LayerNorm(config.hidden_size, hf_config.layer_norm_epsilon))
        self.is_last = is_last(pp)

    def forward(self, input_ids, positions, attn: AttentionMetadata, kv_caches: list[KVCache], logits_indices,
                intermediate: Optional[IntermediateTensors] = None):
        x = self.wte(input_ids) + self.wpe(positions) if intermediate is None else intermediate[0]  # [T, hidden]
        for block, kv_cache in zip(self.stage_layers, kv_caches):
            x = block(x, kv_cache, attn)
        if not self.is_last:
            return (x,)
        return self.ln_f(x[logits_indices])  # [S, hidden]


class GPT2LMHeadModel(CausalLM):
    """``GPT2LMHeadModel``."""

    base_model_prefix = "transformer"
    embed_tokens_name = "transformer.wte"
    ignored_weights = (r"\.attn\.bias$", r"\.attn\.masked_bias$")
    shape_fields = ("n_embd", "n_inner", "n_head", "n_positions", "vocab_size")

    @classmethod
    def check_config(cls, hf_config) -> None:
        if getattr(hf_config, "add_cross_attention", False):
            raise ValueError("config.json add_cross_attention=True (an encoder-decoder GPT-2) is not supported")

    def __init__(self, hf_config, config: ModelConfig, tp: Optional[TPGroup] = None, pp: Optional[PPGroup] = None) -> None:
        super().__init__(hf_config, config, tp, pp)
        self.transformer = GPT2Model(hf_config, config, tp, pp)
        self.lm_head = on_last(pp, lambda: ParallelLMHead(
            config.vocab_size, config.hidden_size, tie_to=self.transformer.wte if config.tie_word_embeddings else None, tp=tp))
