"""Gemma (transformers' ``modeling_gemma``): the Llama decoder stack with three differences.

    token ids [T]
      -> embed_tokens * sqrt(hidden_size)   (the scale rounded to the model dtype first)
      -> layers x N:
           input_layernorm          RMSNorm, Gemma form: x / rms(x) * (1 + weight), in float32
           self_attn                as Llama (head_dim from config, 256 for Gemma 7B)
           post_attention_layernorm RMSNorm, Gemma form
           mlp                      GeGLU: gelu_pytorch_tanh(gate) * up -> down_proj
      -> rows at logits_indices -> norm (Gemma form)
      -> lm_head (tied to embed_tokens)

The attention, MLP and layer modules are Llama's (``pagedgen.model.llama``), composed with Gemma's
norm and embedding scale; checkpoint names are Llama's.
"""
from __future__ import annotations

from typing import Optional

from pagedgen.config import ModelConfig
from pagedgen.distributed.group import PPGroup, TPGroup
from pagedgen.layers.embedding import ParallelLMHead
from pagedgen.layers.rotary_embedding import get_rope
from pagedgen.model.base import CausalLM
from pagedgen.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel
from pagedgen.model.stages import make_layers, on_last


class GemmaForCausalLM(CausalLM):
    """``GemmaForCausalLM``."""

    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping
    ignored_weights = LlamaForCausalLM.ignored_weights
    required_config_fields = LlamaForCausalLM.required_config_fields
    shape_fields = LlamaForCausalLM.shape_fields

    @classmethod
    def check_config(cls, hf_config) -> None:
        if getattr(hf_config, "use_bidirectional_attention", None):
            raise ValueError("config.json use_bidirectional_attention=True (an embedding model) is not supported: pagedgen's attention is causal")

    def __init__(self, hf_config, config: ModelConfig, tp: Optional[TPGroup] = None, pp: Optional[PPGroup] = None) -> None:
        super().__init__(hf_config, config, tp, pp)
        bias = bool(getattr(hf_config, "attention_bias", False))
        rotary_emb = get_rope(hf_config, config.head_dim)
        layers = make_layers(config.num_layers, lambda i: LlamaDecoderLayer(
            hf_config,
            LlamaAttention(hf_config, config, rotary_emb, qkv_bias=bias, o_bias=bias, qk_norm=False, sliding_window=0, tp=tp),
            LlamaMLP(config.hidden_size, hf_config.intermediate_size, hf_config.hidden_act, tp=tp),
            gemma_norm=True,
        ), pp)
        self.model = LlamaModel(hf_config, layers, embed_scale=config.hidden_size**0.5, gemma_norm=True, tp=tp, pp=pp)
        self.lm_head = on_last(pp, lambda: ParallelLMHead(
            config.vocab_size, config.hidden_size, tie_to=self.model.embed_tokens if config.tie_word_embeddings else None, tp=tp))
