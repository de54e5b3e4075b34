"""How many KV blocks the cache gets: from the user's numbers, or from the memory left.

CPU: ``DEFAULT_CPU_KV_FRACTION`` of the memory available when the engine is built.
GPU: vLLM's rule: ``gpu_memory_utilization * total GPU memory - peak memory of a profiling forward
pass`` (weights + activations of the largest step), measured with torch's allocator statistics.
Either way the default never exceeds what ``max_num_seqs`` sequences of ``max_model_len`` tokens
could use at once.
"""
from __future__ import annotations

from typing import Optional

import torch

from pagedgen.model.llama import LlamaForCausalLM
from pagedgen.ops import AttentionMetadata

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


@torch.inference_mode()
def cuda_kv_bytes(model: LlamaForCausalLM, max_num_batched_tokens: int, gpu_memory_utilization: float) -> int:
    """Bytes left for the KV cache on ``model.device`` after a profiling forward pass of
    ``max_num_batched_tokens`` tokens (the largest step). Raises ValueError if nothing is left."""
    cfg, dev = model.config, model.device
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    T = max_num_batched_tokens
    one_block = (1, 1, cfg.num_kv_heads, cfg.head_dim)  # a stand-in cache: nothing is written (slot -1)
    caches = [(torch.zeros(one_block, dtype=cfg.dtype, device=dev), torch.zeros(one_block, dtype=cfg.dtype, device=dev)) for _ in range(cfg.num_layers)]
    attn = AttentionMetadata(  # T one-token sequences, each attending over its own (unwritten) slot
        slot_mapping=torch.full((T,), -1, dtype=torch.int64, device=dev),
        block_tables=torch.zeros(T, 1, dtype=torch.int32, device=dev),
        seq_lens=torch.ones(T, dtype=torch.int32, device=dev),
        query_start_loc=torch.arange(T + 1, dtype=torch.int32, device=dev),
        max_seq_len=1,
    )
    ids = torch.zeros(T, dtype=torch.int64, device=dev)
    positions = torch.zeros(T, dtype=torch.int64, device=dev)
    model.forward(ids, positions, attn, caches, torch.arange(min(T, 256), device=dev))
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev)
    del caches, attn
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(dev).total_memory
    kv_bytes = int(total * gpu_memory_utilization) - peak
    if kv_bytes <= 0:
        raise ValueError(
            f"no GPU memory left for the KV cache: the model and one step take {peak / 2**30:.2f} GiB of "
            f"{total * gpu_memory_utilization / 2**30:.2f} GiB (gpu_memory_utilization={gpu_memory_utilization}); "
            "raise gpu_memory_utilization or lower max_num_batched_tokens"
        )
    return kv_bytes
