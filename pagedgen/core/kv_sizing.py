"""How many KV blocks the cache gets: from the user's numbers, or from the memory left.

CPU: ``DEFAULT_CPU_KV_FRACTION`` of the memory available when the engine is built.
GPU: vLLM's rule: ``gpu_memory_utilization * total GPU memory - peak memory of a profiling forward
pass`` (weights + activations of the largest step), measured with torch's allocator statistics by
the worker (``pagedgen/worker/kv_profile.py``); this module holds the arithmetic, tensor-free.
Either way the default never exceeds what ``max_num_seqs`` sequences of ``max_model_len`` tokens
could use at once.

However it is sized, the cache must hold one sequence of ``max_model_len`` tokens (so that a
sequence alone always fits and preemption cannot loop): ``check_max_model_len`` raises a ValueError
otherwise, naming both numbers and what to change, as vLLM does at start-up
(``check_enough_kv_cache_memory``); ``max_model_len`` is never lowered behind the user's back.

With a draft model (speculative decoding, spec_decode/draft_model.py) the draft's KV cache has the same
block ids as the model's, so ``block_bytes`` here is the bytes of one block in both caches: one
budget, one pool.
"""
from __future__ import annotations

from typing import Optional

from pagedgen.core.blocks import cdiv

#: Share of the available host memory the KV cache takes by default on the CPU.
DEFAULT_CPU_KV_FRACTION = 0.25


def num_kv_blocks(block_bytes: int, num_blocks: Optional[int], kv_bytes: Optional[int], cap_blocks: int) -> int:
    """Blocks of ``block_bytes`` each (all layers, keys and values) the cache gets.

    ``num_blocks`` wins over ``kv_bytes``; with neither, the CPU default applies (capped at
    ``cap_blocks``). Raises ValueError when ``kv_bytes`` holds less than one block.
    """
    if num_blocks is not None:
        return num_blocks
    if kv_bytes is None:
        import psutil

        default = int(psutil.virtual_memory().available * DEFAULT_CPU_KV_FRACTION) // block_bytes
        return max(1, min(default, cap_blocks))
    if kv_bytes < block_bytes:
        raise ValueError(f"LLM kv_cache_memory_bytes must hold at least one block ({block_bytes} bytes), got {kv_bytes}")
    return kv_bytes // block_bytes


def sizing_source(num_blocks: Optional[int], kv_bytes: Optional[int], device_type: str, gpu_memory_utilization: float) -> str:
    """How the cache is sized, in words for an error message: from the user's ``num_kv_blocks``
    (``num_blocks``) or ``kv_cache_memory_bytes`` (``kv_bytes``), else the device's default."""
    if num_blocks is not None:
        return f"num_kv_blocks={num_blocks}"
    if kv_bytes is not None:
        return f"kv_cache_memory_bytes={kv_bytes}"
    if device_type == "cuda":
        return f"the default, what gpu_memory_utilization={gpu_memory_utilization} leaves after the model"
    return f"the default, {DEFAULT_CPU_KV_FRACTION:.0%} of the available memory"


def check_max_model_len(num_blocks: int, block_size: int, block_bytes: int, max_model_len: int, max_model_len_given: bool, sized_by: str) -> None:
    """Raise ValueError when ``num_blocks`` blocks of ``block_size`` tokens (``block_bytes`` bytes
    each, all layers) cannot hold one sequence of ``max_model_len`` tokens. The message says how many
    tokens the cache holds, ``max_model_len`` (and, when it was not given, that it is the model's
    ``max_position_embeddings``), how the cache was sized (``sized_by``, from ``sizing_source``) and
    what to change: the blocks or bytes the cache needs, or a ``max_model_len`` it holds."""
    slots = num_blocks * block_size
    if slots >= max_model_len:
        return
    need = cdiv(max_model_len, block_size)
    origin = "" if max_model_len_given else " (the model's max_position_embeddings: max_model_len was not given)"
    bigger = f"raise num_kv_blocks to at least {need} or kv_cache_memory_bytes to at least {need * block_bytes}"
    if "gpu_memory_utilization" in sized_by:
        bigger += " (or gpu_memory_utilization)"
    raise ValueError(
        f"the KV cache holds {slots} tokens ({num_blocks} blocks of block_size={block_size}; sized by {sized_by}), "
        f"fewer than one sequence of max_model_len={max_model_len} tokens{origin}: {bigger}, "
        f"or pass a smaller max_model_len (at most {slots})"
    )
