"""The Llama family: Llama 2/3, Mistral, Qwen2, Qwen3 and Phi-3 (transformers' ``modeling_llama``,
``modeling_mistral``, ``modeling_qwen2``, ``modeling_qwen3``, ``modeling_phi3``).

    token ids [T]
      -> embed_tokens                                          [T, hidden]
      -> layers x N:
           input_layernorm (RMSNorm, fused with the residual add)
           self_attn: qkv_proj -> (q_norm, k_norm: Qwen3) -> rotary_emb -> paged attention -> o_proj
           post_attention_layernorm (RMSNorm, fused with the residual add)
           mlp: gate_up_proj -> SiLU(gate) * up -> down_proj
      -> rows at logits_indices -> norm                        [S, hidden]
      -> lm_head                                               [S, vocab]

The variants are flags read from the config: Qwen2 has q/k/v biases, Llama ``attention_bias`` /
``mlp_bias``, Qwen3 per-head RMSNorm of q and k before RoPE, Mistral/Qwen2/Phi-3 may have a sliding
window, Phi-3 a partial rotary factor. Phi-3 checkpoints store q/k/v and gate/up already fused under
the names of this file's fused modules, so they load as they are; Llama-style checkpoints give the
parts, mapped by ``packed_modules_mapping``.

One step's batch is flat: T tokens of many sequences, prefill chunks and decode tokens mixed.
Numerics follow transformers step by step (RMSNorm statistics in float32, RoPE bitwise), so greedy
output matches it token for token.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pagedgen.config import ModelConfig
from pagedgen.distributed.group import PPGroup, TPGroup
from pagedgen.layers.activation import ActAndMul
from pagedgen.layers.attention import Attention
from pagedgen.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedgen.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedgen.layers.module import Module
from pagedgen.layers.norm import RMSNorm
from pagedgen.layers.rotary_embedding import RotaryEmbedding, get_rope, rope_cos_sin  # noqa: F401 (rope_cos_sin: re-exported)
from pagedgen.model.base import CausalLM, IntermediateTensors, KVCache, layer_sliding_windows
from pagedgen.model.stages import is_last, make_layers, on_first, on_last, stage_layers
from pagedgen.ops import AttentionMetadata


class LlamaAttention(Module):
    """q/k/v projection, optional per-head q/k RMSNorm, RoPE, paged attention, output projection.

    Args:
        qkv_bias / o_bias: biases of the q/k/v and output projections.
        qk_norm: Qwen3's RMSNorm over each head of q and k (eps ``rms_norm_eps``) before RoPE.
        sliding_window: this layer's window (0: full attention).
    """

    def __init__(self, hf_config, config: ModelConfig, rotary_emb: RotaryEmbedding, qkv_bias: bool, o_bias: bool, qk_norm: bool, sliding_window: int,
                 tp: Optional[TPGroup] = None) -> None:
        super().__init__()
        H, Hkv, D = config.num_heads, config.num_kv_heads, config.head_dim  # global
        self.qkv_proj = QKVParallelLinear(config.hidden_size, D, H, Hkv, bias=qkv_bias, tp=tp)
        self.q_norm = RMSNorm(D, hf_config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(D, hf_config.rms_norm_eps) if qk_norm else None
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.qkv_proj.num_heads, D, D**-0.5, self.qkv_proj.num_kv_heads, sliding_window)  # this rank's heads
        self.o_proj = RowParallelLinear(H * D, config.hidden_size, bias=o_bias, tp=tp)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, kv_cache: KVCache, attn: AttentionMetadata) -> torch.Tensor:
        T, D = h.shape[0], self.attn.head_dim
        qkv = self.qkv_proj(h)  # [T, (H + 2 Hkv) D]
        q, k, v = self.qkv_proj.split(qkv)  # views: [T, H, D], [T, Hkv, D], [T, Hkv, D]
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, D)).view(T, -1, D)
            k = self.k_norm(k.reshape(-1, D)).view(T, -1, D)
        self.rotary_emb(positions, q, k)  # in place
        out = self.attn(q, k, v, kv_cache, attn)  # [T, H, D]
        return self.o_proj(out.view(T, -1))  # [T, hidden]


class LlamaMLP(Module):
    """Gated MLP: ``down_proj(act(gate_proj(x)) * up_proj(x))``, gate and up in one matmul
    (SwiGLU for ``silu``; Gemma's GeGLU with ``gelu_pytorch_tanh``)."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool = False, tp: Optional[TPGroup] = None) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias, tp=tp)
        self.act_fn = ActAndMul(hidden_act)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, tp=tp)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(h)))  # [T, hidden]


class LlamaDecoderLayer(Module):
    """Pre-norm decoder layer. ``forward(positions, h, residual, kv_cache, attn) -> (h, residual)``:
    the residual add is deferred to the next norm (fused with it), as in vLLM; the first layer gets
    ``residual=None`` and the embeddings as ``h``.

    Args:
        attention: the layer's self-attention module; mlp: its MLP.
        gemma_norm: Gemma's RMSNorm form ``(1 + weight)`` instead of Llama's.
    """

    def __init__(self, hf_config, attention: nn.Module, mlp: nn.Module, gemma_norm: bool = False) -> None:
        super().__init__()
        hidden, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps, gemma=gemma_norm)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(hidden, eps, gemma=gemma_norm)
        self.mlp = mlp

    def forward(self, positions, h, residual, kv_cache: KVCache, attn: AttentionMetadata):
        if residual is None:
            h, residual = self.input_layernorm(h), h
        else:
            h, residual = self.input_layernorm(h, residual)  # residual += h; h = norm(residual)
        h = self.self_attn(positions, h, kv_cache, attn)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(Module):
    """Embedding, decoder layers, final norm; returns the normalised rows at ``logits_indices``.
    On a pipeline stage (``pp``): the embedding on the first stage only, the final norm on the last
    only; a stage other than the last returns (h, residual) [T, hidden] each for the next one, and
    one other than the first starts from them (``intermediate``).

    Args:
        layers: the decoder layers (built by the family with ``make_layers``, so that Gemma can
            reuse this stack; placeholders outside the stage).
        embed_scale: multiplier of the embeddings (Gemma: sqrt(hidden_size)).
        gemma_norm: Gemma's RMSNorm form for the final norm.
    """

    def __init__(self, hf_config, layers: nn.ModuleList, embed_scale: float = 1.0, gemma_norm: bool = False, tp: Optional[TPGroup] = None,
                 pp: Optional[PPGroup] = None) -> None:
        super().__init__()
        self.embed_tokens = on_first(pp, lambda: VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size, scale=embed_scale, tp=tp))
        self.layers = layers
        self.stage_layers = stage_layers(layers, pp)
        self.norm = on_last(pp, lambda: RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, gemma=gemma_norm))
        self.is_last = is_last(pp)

    def forward(self, input_ids, positions, attn: AttentionMetadata, kv_caches: list[KVCache], logits_indices,
                intermediate: Optional[IntermediateTensors] = None):
        if intermediate is None:
            h, residual = self.embed_tokens(input_ids), None  # [T, hidden]
        else:
            h, residual = intermediate  # [T, hidden] each, from the previous stage
        for layer, kv_cache in zip(self.stage_layers, kv_caches):
            h, residual = layer(positions, h, residual, kv_cache, attn)
        if not self.is_last:
            return h, residual
        h, residual = h[logits_indices], residual[logits_indices]  # [S, hidden]: only the rows sampled
        h, _ = self.norm(h, residual)
        return h


class LlamaForCausalLM(CausalLM):
    """``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``,
    ``Phi3ForCausalLM``: one decoder stack, the variants chosen from ``config.architecture``."""

    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    ignored_weights = (r"\.rotary_emb\.inv_freq$",)
    required_config_fields = ("intermediate_size",)
    shape_fields = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size")

    def __init__(self, hf_config, config: ModelConfig, tp: Optional[TPGroup] = None, pp: Optional[PPGroup] = None) -> None:
        super().__init__(hf_config, config, tp, pp)
        arch = config.architecture
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        qkv_bias = True if arch == "Qwen2ForCausalLM" else attention_bias  # Qwen2: q/k/v biases, no o_proj bias
        qk_norm = arch == "Qwen3ForCausalLM"
        rotary_emb = get_rope(hf_config, config.head_dim)
        windows = layer_sliding_windows(hf_config, config.num_layers)
        layers = make_layers(config.num_layers, lambda i: LlamaDecoderLayer(
            hf_config,
            LlamaAttention(hf_config, config, rotary_emb, qkv_bias, attention_bias, qk_norm, windows[i], tp),
            LlamaMLP(config.hidden_size, hf_config.intermediate_size, hf_config.hidden_act, bool(getattr(hf_config, "mlp_bias", False)), tp),
        ), pp)
        self.model = LlamaModel(hf_config, layers, tp=tp, pp=pp)
        self.lm_head = on_last(pp, lambda: ParallelLMHead(
            config.vocab_size, config.hidden_size, tie_to=self.model.embed_tokens if config.tie_word_embeddings else None, tp=tp))
