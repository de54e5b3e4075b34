"""``EngineStats``: what ``LLM.get_stats()`` returns (the engine fills it: ``LLMEngine.stats``)."""
from __future__ import annotations

from dataclasses import dataclass

from pagedgen import _repr


@dataclass
class EngineStats:
    """KV-cache and scheduling figures since the engine was made (``LLM.get_stats()``).

    ``kv_utilization_mean`` is the mean, over steps, of slots holding real tokens / slots allocated
    (the PagedAttention paper's figure 2 measure); ``kv_utilization`` is the last step's value.
    ``sharing_savings_*``: 1 - physical blocks used / blocks the same block tables would need
    unshared (paper section 6.3-6.4).
    """

    num_steps: int
    num_preemptions: int
    num_recomputes: int
    num_swaps_out: int
    num_swaps_in: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_generated_tokens: int
    num_kv_blocks: int
    num_used_blocks: int
    num_free_blocks: int
    block_size: int
    kv_utilization: float
    kv_utilization_mean: float
    peak_used_blocks: int
    prefix_cache_hit_rate: float  # prompt tokens found in the prefix cache / tokens looked up
    num_cached_tokens: int  # tokens not recomputed thanks to the prefix cache
    sharing_savings_mean: float  # mean over steps of 1 - physical blocks / blocks unshared tables need
    peak_sharing_savings: float
    num_copy_on_write: int  # blocks copied because a shared block was written
    # speculative decoding (docs/speculative.md): draft tokens proposed and accepted, and the
    # acceptance rate of each draft position (0, 1, ...); zeros and () without speculation
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    acceptance_rate_per_position: tuple = ()
    # structured outputs' jump-forward decoding (docs/structured_outputs.md): of num_generated_tokens,
    # those a grammar forced and the engine appended without a decode step each
    num_jump_forward_tokens: int = 0
    # LLM(kv_cache_dtype=...): "auto" (the model's dtype) or the 1-byte cache's "int8", "fp8"...
    kv_cache_dtype: str = "auto"
    # the model's weights (docs/quantization.md): "" float, "int8" / "fp8" quantized at load (or "fp8" read: vLLM's fp8 format), "compressed-tensors" int8, FP8 or int4 read, "gptq" / "awq" int4 read
    quantization: str = ""

    def __repr__(self) -> str:
        return _repr.render("EngineStats", _repr.engine_stats(self))

    def _repr_pretty_(self, p, cycle: bool) -> None:
        _repr.pretty(p, "EngineStats", _repr.engine_stats(self), cycle)
