"""The KV cache's size on a GPU by vLLM's rule: what a profiling forward pass of the largest step
leaves of ``gpu_memory_utilization`` of the device's memory (``pagedgen/core/kv_sizing.py`` turns
the bytes into blocks)."""
from __future__ import annotations

import torch

from pagedgen.model.llama import LlamaForCausalLM
from pagedgen.ops import AttentionMetadata


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
