"""The checks of ``LLM(...)``'s arguments: types and ranges, before anything is loaded or started.

``check_llm_args`` raises ``TypeError`` (a wrong type), ``ValueError`` (a value outside its range,
named with the range) or ``FileNotFoundError`` (a tokenizer folder that does not exist); what
needs the checkpoint (dtype, the parallel sizes against the heads and layers,
``max_model_len`` against the model's positions, the KV cache's size) is checked by ``LLM`` as it
assembles the engine (llm.py).
"""
from __future__ import annotations

import os
from typing import Optional

from pagedgen import inputs
from pagedgen.executor import BACKENDS


def check_llm_args(
    *,
    model,
    tokenizer,
    block_size,
    num_kv_blocks,
    kv_cache_memory_bytes,
    max_num_seqs,
    max_num_batched_tokens,
    max_model_len,
    seed,
    enforce_extension,
    enable_prefix_caching,
    preemption_mode,
    swap_space_bytes,
    gpu_memory_utilization,
    enforce_eager,
    batch_invariant: Optional[bool],
    distributed_executor_backend,
    tensor_parallel_size,
    pipeline_parallel_size,
) -> None:
    """Check ``LLM(...)``'s keyword arguments (see ``LLM``'s docstring for each one's range)."""
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"LLM model must be a folder path, got {type(model).__name__}")
    for name, value, opt in (
        ("block_size", block_size, False),
        ("num_kv_blocks", num_kv_blocks, True),
        ("kv_cache_memory_bytes", kv_cache_memory_bytes, True),
        ("max_num_seqs", max_num_seqs, False),
        ("max_num_batched_tokens", max_num_batched_tokens, True),
        ("max_model_len", max_model_len, True),
        ("swap_space_bytes", swap_space_bytes, True),
        ("tensor_parallel_size", tensor_parallel_size, False),
        ("pipeline_parallel_size", pipeline_parallel_size, False),
    ):
        inputs.check_positive_int(name, value, opt)
    if distributed_executor_backend not in BACKENDS:
        raise ValueError(f"LLM distributed_executor_backend must be one of {BACKENDS}, got {distributed_executor_backend!r}")
    world = tensor_parallel_size * pipeline_parallel_size
    if world > 1:
        sizes = (
            f"tensor_parallel_size={tensor_parallel_size}" if pipeline_parallel_size == 1
            else f"tensor_parallel_size={tensor_parallel_size} x pipeline_parallel_size={pipeline_parallel_size} = {world} ranks"
        )
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        if world > cores and os.environ.get("PAGEDGEN_TP_OVERSUBSCRIBE", "") in ("", "0"):  # tests on small machines set it
            raise ValueError(f"LLM {sizes} must be <= the CPU cores this process may use ({cores})")
        if distributed_executor_backend == "pickle":
            raise ValueError(f"LLM {sizes} needs distributed_executor_backend='mp' (or None), got 'pickle'")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"LLM seed must be an int, got {type(seed).__name__}")
    if not -(2**63) <= seed < 2**64:
        raise ValueError(f"LLM seed must be a 64-bit integer, got {seed}")
    if block_size > 1024:
        raise ValueError(f"LLM block_size must be in [1, 1024] tokens, got {block_size}")
    for name, flag in (("enforce_extension", enforce_extension), ("enable_prefix_caching", enable_prefix_caching), ("enforce_eager", enforce_eager)):
        if not isinstance(flag, bool):
            raise TypeError(f"LLM {name} must be a bool, got {type(flag).__name__}")
    if batch_invariant is not None and not isinstance(batch_invariant, bool):
        raise TypeError(f"LLM batch_invariant must be a bool or None, got {type(batch_invariant).__name__}")
    if isinstance(gpu_memory_utilization, bool) or not isinstance(gpu_memory_utilization, (int, float)):
        raise TypeError(f"LLM gpu_memory_utilization must be a number, got {type(gpu_memory_utilization).__name__}")
    if tokenizer is not None:
        if not isinstance(tokenizer, (str, os.PathLike)):
            raise TypeError(f"LLM tokenizer must be a folder path, got {type(tokenizer).__name__}")
        if not os.path.isdir(tokenizer):
            raise FileNotFoundError(f"tokenizer folder not found: {os.fspath(tokenizer)!r}")
    if preemption_mode not in ("recompute", "swap"):
        raise ValueError(f"LLM preemption_mode must be 'recompute' or 'swap', got {preemption_mode!r}")
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"LLM gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")


def check_use_tqdm(use_tqdm) -> None:
    """``use_tqdm`` of a generation call must be a bool (TypeError)."""
    if not isinstance(use_tqdm, bool):
        raise TypeError(f"use_tqdm must be a bool, got {type(use_tqdm).__name__}")
