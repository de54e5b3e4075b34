"""Llama decoder (``LlamaForCausalLM``) over a flattened token batch and the paged KV cache.

Numerics follow transformers' ``modeling_llama`` (RMSNorm in float32, rotate-half RoPE with cos/sin
computed in float32, SwiGLU MLP) so that greedy output matches it token for token. q/k/v and
gate/up projections are fused into one matmul each (fewer, larger matmuls per step), and the small
per-token layers are one op each (``pagedgen.ops``: rms_norm, fused_add_rms_norm for the residual add
and the norm after it, rotary_embedding in place on the q/k views, silu_and_mul): one pass over the
rows instead of up to ten ATen ops, which matters when a step is a few hundred tokens of a small model.

One step's batch is flat: T tokens from many sequences, prefill chunks and decode tokens mixed.
Attention for every token goes through the paged kernels: the new keys/values are first written
into their slots (``reshape_and_cache``), then each token attends over its sequence's cached tokens
up to and including itself (the varlen ``paged_attention``: a prefill chunk or a decode row per
sequence, see ``pagedgen.ops.AttentionMetadata``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedgen import ops
from pagedgen.config import ModelConfig
from pagedgen.ops import AttentionMetadata


def rope_cos_sin(hf_config, head_dim: int, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [max_positions, head_dim] float32, as transformers' LlamaRotaryEmbedding.

    The inverse frequencies come from transformers' RoPE initialisers (default, linear, llama3, yarn...);
    types that depend on the running sequence length (dynamic, longrope) are refused.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in ("dynamic", "longrope"):
        raise ValueError(f"rope_type {rope_type!r} is not supported")
    if rope_type == "default":
        inv_freq, scaling = LlamaRotaryEmbedding.compute_default_rope_parameters(hf_config)
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq.float()[None, :]  # [P, head_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [P, head_dim]
    return emb.cos() * scaling, emb.sin() * scaling


def check_layer_count(weights: dict[str, torch.Tensor], num_layers: int) -> None:
    """Raises ValueError when the checkpoint holds layers past config.json's ``num_hidden_layers``
    (missing ones are reported weight by weight when the model takes them)."""
    indices = {int(name.split(".")[2]) for name in weights if name.startswith("model.layers.") and name.split(".")[2].isdigit()}
    if indices and max(indices) >= num_layers:
        raise ValueError(
            f"the checkpoint holds {max(indices) + 1} decoder layers, but config.json says num_hidden_layers="
            f"{num_layers}: config.json does not describe these weights"
        )


class LlamaForCausalLM:
    """Weights of a Llama checkpoint and its forward pass over the paged KV cache.

    Args:
        config: model shape and dtype.
        weights: tensors by Hugging Face name (``model.layers.0.self_attn.q_proj.weight``...).
        cos, sin: RoPE tables [max_positions, head_dim] float32 (see ``rope_cos_sin``).
        device: where weights and activations live.

    Raises:
        ValueError: a weight is missing, has a shape other than config.json implies, or the checkpoint
            holds more layers than config.json says.
    """

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, device) -> None:
        self.config = config
        self.device = torch.device(device)
        dt = config.dtype

        c = config
        hidden, q_dim, kv_dim = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        check_layer_count(weights, c.num_layers)

        def take(name: str, *shape: int) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"weight {name!r} is missing from the checkpoint")
            if tuple(weights[name].shape) != shape:
                raise ValueError(
                    f"weight {name!r} has shape {tuple(weights[name].shape)}, but config.json implies {shape} "
                    f"(hidden_size={hidden}, intermediate_size={c.intermediate_size}, num_attention_heads="
                    f"{c.num_heads}, num_key_value_heads={c.num_kv_heads}, head_dim={c.head_dim}, "
                    f"vocab_size={c.vocab_size}): config.json does not describe these weights"
                )
            return weights[name].to(device=self.device, dtype=dt).contiguous()

        self.embed_tokens = take("model.embed_tokens.weight", c.vocab_size, hidden)  # [vocab, hidden]
        self.layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            self.layers.append(
                {
                    "input_norm": take(p + "input_layernorm.weight", hidden),  # [hidden]
                    # [(num_heads + 2 * num_kv_heads) * head_dim, hidden]
                    "qkv": torch.cat(
                        [take(p + f"self_attn.{x}_proj.weight", d, hidden) for x, d in zip("qkv", (q_dim, kv_dim, kv_dim))]
                    ),
                    "o": take(p + "self_attn.o_proj.weight", hidden, q_dim),  # [hidden, num_heads * head_dim]
                    "post_norm": take(p + "post_attention_layernorm.weight", hidden),  # [hidden]
                    # [2 * intermediate, hidden]
                    "gate_up": torch.cat(
                        [take(p + f"mlp.{x}_proj.weight", c.intermediate_size, hidden) for x in ("gate", "up")]
                    ),
                    "down": take(p + "mlp.down_proj.weight", hidden, c.intermediate_size),  # [hidden, intermediate]
                }
            )
        self.norm = take("model.norm.weight", hidden)
        if config.tie_word_embeddings or "lm_head.weight" not in weights:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = take("lm_head.weight", c.vocab_size, hidden)  # [vocab, hidden]
        self.cos = cos.to(self.device)  # [max_positions, head_dim] float32
        self.sin = sin.to(self.device)
        self.scale = config.head_dim**-0.5

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        attn: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer: 2 x [num_blocks, block_size, num_kv_heads, head_dim]
        logits_indices: torch.Tensor,  # [S] int64, rows of the tokens whose next token is sampled
    ) -> torch.Tensor:
        """Returns logits [S, vocab] float32 for the tokens at ``logits_indices``."""
        cfg = self.config
        T = input_ids.shape[0]
        H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        x = F.embedding(input_ids, self.embed_tokens)  # [T, hidden], the residual stream
        h = torch.empty_like(x)  # [T, hidden], the normalised input of the next sublayer
        ops.rms_norm(h, x, self.layers[0]["input_norm"], eps)
        attn_out = torch.empty(T, H, D, dtype=cfg.dtype, device=self.device)
        act = torch.empty(T, cfg.intermediate_size, dtype=cfg.dtype, device=self.device)  # [T, intermediate]
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            qkv = F.linear(h, layer["qkv"])  # [T, (H + 2 Hkv) D]
            q = qkv[:, : H * D].view(T, H, D)  # views into qkv
            k = qkv[:, H * D : (H + Hkv) * D].view(T, Hkv, D)
            v = qkv[:, (H + Hkv) * D :].view(T, Hkv, D)
            ops.rotary_embedding(positions, q, k, self.cos, self.sin)  # in place
            ops.reshape_and_cache(k, v, k_cache, v_cache, attn.slot_mapping)
            ops.paged_attention(attn_out, q, k_cache, v_cache, attn.block_tables, attn.seq_lens, attn.query_start_loc, self.scale, 0)
            h = F.linear(attn_out.view(T, H * D), layer["o"])  # [T, hidden]
            ops.fused_add_rms_norm(h, x, layer["post_norm"], eps)  # x += h; h = norm(x)
            gate_up = F.linear(h, layer["gate_up"])  # [T, 2 intermediate]
            ops.silu_and_mul(act, gate_up)  # [T, intermediate]
            h = F.linear(act, layer["down"])  # [T, hidden]
            if i + 1 < len(self.layers):
                ops.fused_add_rms_norm(h, x, self.layers[i + 1]["input_norm"], eps)  # x += h; h = norm(x)
            else:
                x = x[logits_indices] + h[logits_indices]  # [S, hidden]: only the rows that are sampled
        out = torch.empty_like(x)
        ops.rms_norm(out, x, self.norm, eps)
        return F.linear(out, self.lm_head).float()  # [S, vocab]
