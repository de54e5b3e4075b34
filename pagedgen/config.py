"""Frozen configuration of one engine, built and validated once (``engine/build.py``) and passed down."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the configs are plain data: the scheduler's side (pagedgen/core) imports no torch
    import torch


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs to know of the model, read from a Hugging Face config.json.

    The shape of the KV cache, the vocabulary, the context length and the dtype are the same kind of
    field for every family; everything else about an architecture (norm epsilon, MLP width,
    activation, biases, rotary details...) the family reads from the transformers config it is built
    with (``pagedgen/model/``), whose classes document those fields.

    Attributes:
        architecture: the Hugging Face architecture name (``LlamaForCausalLM``...).
        vocab_size, hidden_size, num_layers: as in config.json.
        num_heads, num_kv_heads, head_dim: query heads, key/value heads (grouped-query attention),
            size of one head (any size, 8 included).
        max_position_embeddings: the model's context length (tokens).
        tie_word_embeddings: lm_head shares the input embedding matrix.
        dtype: torch dtype of weights, activations and the KV cache.
        sliding_window: 0 when some layer attends over the whole sequence; else every layer attends
            over at most this many most recent tokens (Mistral's ``sliding_window``; the largest
            when layers differ), so blocks that fall wholly out of it are no longer read and go
            back to the pool (``CacheConfig.sliding_window``).
        quantization: "" (float weights), "int8" (quantized at load), "fp8" (FP8 W8A16: quantized at
            load, or read from an ``fp8``-format checkpoint), "compressed-tensors" (int8, FP8 or int4
            weights read from the checkpoint) or "gptq" / "awq" (int4 W4A16 read from the
            checkpoint): ``pagedgen.model.quantization``, docs/quantization.md.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    dtype: torch.dtype
    sliding_window: int = 0
    quantization: str = ""

    def kv_bytes_per_token(self, cache_dtype: str = "auto") -> int:
        """Bytes of KV cache one token takes over all layers (keys and values) in a cache of
        ``cache_dtype`` (``CacheConfig.cache_dtype``): the model dtype's elements for "auto"; for
        the 1-byte caches one byte an element plus a 2-byte scale per head (pagedgen/ops/kv_quant.py)."""
        if cache_dtype == "auto":
            per_head = self.head_dim * self.dtype.itemsize  # bytes of one element of a torch.dtype
        else:
            per_head = self.head_dim + 2
        return 2 * self.num_layers * self.num_kv_heads * per_head


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: ``num_blocks`` blocks of ``block_size`` tokens, shared by all sequences.

    Attributes:
        enable_prefix_caching: reuse cached full blocks of equal token prefixes.
        num_cpu_blocks: blocks of CPU swap space for swap preemption (0: none).
        sliding_window: ``ModelConfig.sliding_window`` (tokens; 0: none): a sequence's blocks wholly
            before it are returned to the pool (``BlockManager``'s module docstring gives the bound).
        cache_dtype: ``LLM(kv_cache_dtype=...)``: "auto" (the model's dtype) or a 1-byte cache,
            "int8", "fp8" (= "fp8_e4m3"), "fp8_e4m3", "fp8_e5m2" (docs/kv_cache_dtype.md).
    """

    block_size: int
    num_blocks: int
    enable_prefix_caching: bool = False
    num_cpu_blocks: int = 0
    sliding_window: int = 0
    cache_dtype: str = "auto"

    @property
    def num_slots(self) -> int:
        """Token slots in the whole cache."""
        return self.block_size * self.num_blocks


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one scheduler step.

    Attributes:
        max_num_seqs: most sequences running at once (decode batch size).
        max_num_batched_tokens: most tokens computed in one model step (prefill chunks + decodes).
        max_model_len: most tokens (prompt + output) of one sequence.
        preemption_mode: "recompute" (free the blocks, prefill again later) or "swap" (copy the
            blocks to CPU swap space and back); swap falls back to recompute when swap space is full.
        max_loras: with LoRA on, the most distinct adapters among the running sequences (so a step
            never needs more adapter slots than the worker has); a request whose adapter would be
            one more waits (0: LoRA off).
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    preemption_mode: str = "recompute"
    max_loras: int = 0  # LoRA on: the most distinct adapters in the running set (LLM's max_loras); 0: LoRA off
