"""Llama decoder (``LlamaForCausalLM``) over a flattened token batch and the paged KV cache.

Numerics follow transformers' ``modeling_llama`` (RMSNorm in float32, rotate-half RoPE with cos/sin
computed in float32, SwiGLU MLP) so that greedy output matches it token for token. q/k/v and
gate/up projections are fused into one matmul each (fewer, larger matmuls per step).

One step's batch is flat: T tokens from many sequences, prefill chunks and decode tokens mixed.
Attention for every token goes through the paged kernels: the new keys/values are first written
into their slots (``reshape_and_cache``), then each token attends over its sequence's cached tokens
up to and including itself (``paged_attention`` with one row per token, seq_len = position + 1).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedgen import ops
from pagedgen.config import ModelConfig


@dataclass
class AttentionMetadata:
    """Per-step inputs of attention (built by the model runner).

    Attributes:
        slot_mapping: [T] int64, KV slot of each token (block * block_size + offset).
        block_tables: [T, max_blocks] int32, the block table of each token's sequence.
        seq_lens: [T] int32, tokens each token attends over (its position + 1).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor


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


class LlamaForCausalLM:
    """Weights of a Llama checkpoint and its forward pass over the paged KV cache.

    Args:
        config: model shape and dtype.
        weights: tensors by Hugging Face name (``model.layers.0.self_attn.q_proj.weight``...).
        cos, sin: RoPE tables [max_positions, head_dim] float32 (see ``rope_cos_sin``).
        device: where weights and activations live.
    """

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, device) -> None:
        self.config = config
        self.device = torch.device(device)
        dt = config.dtype

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"weight {name!r} is missing from the checkpoint")
            return weights[name].to(device=self.device, dtype=dt).contiguous()

        self.embed_tokens = take("model.embed_tokens.weight")  # [vocab, hidden]
        self.layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            self.layers.append(
                {
                    "input_norm": take(p + "input_layernorm.weight"),  # [hidden]
                    # [(num_heads + 2 * num_kv_heads) * head_dim, hidden]
                    "qkv": torch.cat([take(p + f"self_attn.{x}_proj.weight") for x in "qkv"]),
                    "o": take(p + "self_attn.o_proj.weight"),  # [hidden, num_heads * head_dim]
                    "post_norm": take(p + "post_attention_layernorm.weight"),  # [hidden]
                    # [2 * intermediate, hidden]
                    "gate_up": torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]),
                    "down": take(p + "mlp.down_proj.weight"),  # [hidden, intermediate]
                }
            )
        self.norm = take("model.norm.weight")
        if config.tie_word_embeddings or "lm_head.weight" not in weights:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = take("lm_head.weight")  # [vocab, hidden]
        # RoPE as x * cos + roll(x, head_dim / 2) * sin_signed: transformers' rotate_half(x) * sin with
        # the sign moved into the table (negation is exact, so the result is bitwise the same)
        half = config.head_dim // 2
        sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        # [max_positions, 2, head_dim] in the model dtype: cos, then sin_signed, gathered once per step
        self.cos_sin = torch.stack((cos, sin_signed), dim=1).to(device=self.device, dtype=dt)
        # the permutation of the last dim that swaps its halves (what roll by head_dim / 2 does)
        self.rotate_index = torch.cat((torch.arange(half, config.head_dim), torch.arange(half))).to(self.device)
        self.scale = config.head_dim**-0.5

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # as transformers' LlamaRMSNorm: statistics in float32, weight applied in the model dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return weight * h.to(x.dtype)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        # x: [T, heads, head_dim]; cos, sin_signed: [T, 1, head_dim] in x's dtype
        return x * cos + x.index_select(-1, self.rotate_index) * sin_signed

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
        dt = cfg.dtype
        cos_sin = self.cos_sin.index_select(0, positions)  # [T, 2, D]
        cos, sin_signed = cos_sin[:, :1], cos_sin[:, 1:]  # [T, 1, D] each
        x = F.embedding(input_ids, self.embed_tokens)  # [T, hidden]
        attn_out = torch.empty(T, H, D, dtype=dt, device=self.device)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            h = self._rms_norm(x, layer["input_norm"])
            qkv = F.linear(h, layer["qkv"])  # [T, (H + 2 Hkv) D]
            qk = self._rope(qkv[:, : (H + Hkv) * D].view(T, H + Hkv, D), cos, sin_signed)  # [T, H + Hkv, D], one pass
            q, k = qk[:, :H], qk[:, H:]  # [T, H, D], [T, Hkv, D] (views)
            v = qkv[:, (H + Hkv) * D :].view(T, Hkv, D)
            ops.reshape_and_cache(k, v, k_cache, v_cache, attn.slot_mapping)
            ops.paged_attention(attn_out, q, k_cache, v_cache, attn.block_tables, attn.seq_lens, self.scale)
            x = x + F.linear(attn_out.view(T, H * D), layer["o"])
            h = self._rms_norm(x, layer["post_norm"])
            gate, up = F.linear(h, layer["gate_up"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate).mul_(up), layer["down"])
        x = x[logits_indices]  # [S, hidden]
        x = self._rms_norm(x, self.norm)
        return F.linear(x, self.lm_head).float()  # [S, vocab]
