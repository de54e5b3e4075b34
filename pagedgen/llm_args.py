"""The arguments of ``LLM(...)`` (``LLMArgs``) and their checks, before anything is loaded or started.

``check_llm_args`` raises ``TypeError`` (a wrong type), ``ValueError`` (a value outside its range,
named with the range, or arguments that do not go together) or ``FileNotFoundError`` (a tokenizer
folder that does not exist), and ``RuntimeError`` when ``enforce_extension`` finds no compiled
extension; what needs the checkpoint (dtype, the parallel sizes against the heads and layers,
``max_model_len`` against the model's positions, the KV cache's size) is checked as the engine is
built (``engine/build.py``).
"""
from __future__ import annotations

import dataclasses
import numbers
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch

from pagedgen import inputs, ops
from pagedgen.executor import BACKENDS
from pagedgen.lora.config import LoRAConfig
from pagedgen.pooling_params import PoolerConfig
from pagedgen.spec_decode.config import SpeculativeConfig


@dataclass(frozen=True)
class LLMArgs:
    """The keyword arguments of ``LLM(...)``, as given (see ``LLM``'s docstring for each one);
    ``engine/build.py`` builds the engine from them."""

    model: Any
    tokenizer: Any
    dtype: Any
    block_size: int
    num_kv_blocks: Optional[int]
    kv_cache_memory_bytes: Optional[int]
    max_num_seqs: int
    max_num_batched_tokens: Optional[int]
    max_model_len: Optional[int]
    seed: int
    enforce_extension: bool
    enable_prefix_caching: bool
    preemption_mode: str
    swap_space_bytes: Optional[int]
    kv_cache_dtype: str
    device: Any
    gpu_memory_utilization: float
    enforce_eager: bool
    batch_invariant: Optional[bool]
    distributed_executor_backend: Optional[str]
    tensor_parallel_size: int
    pipeline_parallel_size: int
    speculative_config: Any
    runner: str = "auto"
    convert: str = "auto"
    pooler_config: Any = None
    quantization: Optional[str] = None
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: Optional[int] = None


INT_ARGS = ("block_size", "num_kv_blocks", "kv_cache_memory_bytes", "max_num_seqs", "max_num_batched_tokens",
            "max_model_len", "seed", "swap_space_bytes", "tensor_parallel_size", "pipeline_parallel_size",
            "max_loras", "max_lora_rank", "max_cpu_loras")


def with_plain_numbers(args: LLMArgs) -> LLMArgs:
    """``args`` with numpy's (or any ``numbers.Integral``'s) ints of the int arguments made Python
    ints, and a ``numbers.Real`` ``gpu_memory_utilization`` a float (a value read from an array or
    a data frame); bools and other types are left for ``check_arg_types`` to refuse."""
    changes = {
        name: int(value) for name in INT_ARGS
        if isinstance(value := getattr(args, name), numbers.Integral) and not isinstance(value, (bool, int))
    }
    gmu = args.gpu_memory_utilization
    if isinstance(gmu, numbers.Real) and not isinstance(gmu, (bool, int, float)):
        changes["gpu_memory_utilization"] = float(gmu)
    return dataclasses.replace(args, **changes) if changes else args


def check_llm_args(args: LLMArgs) -> tuple[Optional[SpeculativeConfig], torch.device]:
    """Check ``LLM(...)``'s arguments, in this order: types and ranges (``check_arg_types``), the
    speculative config and where it may run, the device, the KV cache's sizing with worker
    processes on a GPU, the compiled extension. Returns the checked ``SpeculativeConfig`` (None
    without one) and the resolved device."""
    check_arg_types(args)
    spec_config = None if args.speculative_config is None else SpeculativeConfig.from_dict(args.speculative_config)
    backend, tp, pp = args.distributed_executor_backend, args.tensor_parallel_size, args.pipeline_parallel_size
    if spec_config is not None and (backend is not None or tp * pp > 1):
        raise ValueError(
            f"LLM speculative_config needs distributed_executor_backend=None (in process) and "
            f"tensor_parallel_size=pipeline_parallel_size=1, got {backend!r}, {tp} "
            f"and {pp}: drafts do not travel in the step record yet"
        )
    device = inputs.resolve_device(args.device)
    if backend is not None and device.type == "cuda" and args.num_kv_blocks is None and args.kv_cache_memory_bytes is None:
        # the driver sizes the KV cache, and on a GPU that needs a profiling forward pass of the model,
        # which only the worker holds: the size must be given (before anything is loaded)
        raise ValueError(
            f"LLM distributed_executor_backend={backend!r} on a GPU needs num_kv_blocks or "
            "kv_cache_memory_bytes (--num-kv-blocks / --kv-cache-memory-bytes): the KV cache cannot be sized "
            "by a profiling run, which needs the model in the driver; or pass distributed_executor_backend=None"
        )
    ops.isa.check_request(os.environ.get(ops.isa.ENV))  # a typo must not quietly run the reference ops
    if args.runner not in ("auto", "generate", "pooling"):
        raise ValueError(f"LLM runner must be 'auto', 'generate' or 'pooling', got {args.runner!r}")
    if args.convert not in ("auto", "none", "embed", "classify"):
        raise ValueError(f"LLM convert must be 'auto', 'none', 'embed' or 'classify', got {args.convert!r}")
    if args.runner == "generate" and args.convert in ("embed", "classify"):
        raise ValueError(f"LLM convert={args.convert!r} makes a pooling model: it needs runner='pooling' or 'auto', got runner='generate'")
    PoolerConfig.from_arg(args.pooler_config)  # TypeError / ValueError naming the field
    if ops.kv_quant.check_kv_cache_dtype(args.kv_cache_dtype) != "auto" and device.type == "cuda":
        raise ValueError(f"LLM kv_cache_dtype={args.kv_cache_dtype!r} runs on the CPU only for now (no CUDA kernel "
                         "reads the 1-byte cache yet): pass kv_cache_dtype='auto' or device='cpu'")
    if not isinstance(args.enable_lora, bool):
        raise TypeError(f"LLM enable_lora must be a bool, got {type(args.enable_lora).__name__}")
    if args.enable_lora:
        LoRAConfig.from_args(args.max_loras, args.max_lora_rank, args.max_cpu_loras)  # TypeError / ValueError naming the field
        if pp > 1:
            raise ValueError(f"LLM enable_lora=True needs pipeline_parallel_size=1, got {pp} (LoRA with pipeline stages is not supported yet)")
    if args.enforce_extension and not ops.extension_available(device.type):
        raise RuntimeError(ops.extension_error(device.type))
    return spec_config, device


def check_arg_types(args: LLMArgs) -> None:
    """The types and ranges of ``LLM(...)``'s keyword arguments (see ``LLM``'s docstring for each one's range)."""
    model, tokenizer, seed = args.model, args.tokenizer, args.seed
    tensor_parallel_size, pipeline_parallel_size = args.tensor_parallel_size, args.pipeline_parallel_size
    distributed_executor_backend, gpu_memory_utilization = args.distributed_executor_backend, args.gpu_memory_utilization
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"LLM model must be a folder path, got {type(model).__name__}")
    for name, value, opt in (
        ("block_size", args.block_size, False),
        ("num_kv_blocks", args.num_kv_blocks, True),
        ("kv_cache_memory_bytes", args.kv_cache_memory_bytes, True),
        ("max_num_seqs", args.max_num_seqs, False),
        ("max_num_batched_tokens", args.max_num_batched_tokens, True),
        ("max_model_len", args.max_model_len, True),
        ("swap_space_bytes", args.swap_space_bytes, True),
        ("tensor_parallel_size", tensor_parallel_size, False),
        ("pipeline_parallel_size", pipeline_parallel_size, False),
    ):
        inputs.check_positive_int(name, value, opt)
    if distributed_executor_backend not in BACKENDS:
        raise ValueError(f"LLM distributed_executor_backend must be one of {BACKENDS}, got {distributed_executor_backend!r}")
    world = tensor_parallel_size * pipeline_parallel_size
    if world > 1 and distributed_executor_backend == "pickle":
        raise ValueError(f"LLM {parallel_sizes(tensor_parallel_size, pipeline_parallel_size)} needs "
                         f"distributed_executor_backend='mp' (or None), got 'pickle'")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"LLM seed must be an int, got {type(seed).__name__}")
    if not -(2**63) <= seed < 2**64:
        raise ValueError(f"LLM seed must be a 64-bit integer, got {seed}")
    if args.block_size > 1024:
        raise ValueError(f"LLM block_size must be in [1, 1024] tokens, got {args.block_size}")
    for name, flag in (("enforce_extension", args.enforce_extension), ("enable_prefix_caching", args.enable_prefix_caching), ("enforce_eager", args.enforce_eager)):
        if not isinstance(flag, bool):
            raise TypeError(f"LLM {name} must be a bool, got {type(flag).__name__}")
    if args.quantization is not None and not isinstance(args.quantization, str):
        raise TypeError(f"LLM quantization must be a str or None, got {type(args.quantization).__name__}")
    if args.batch_invariant is not None and not isinstance(args.batch_invariant, bool):
        raise TypeError(f"LLM batch_invariant must be a bool or None, got {type(args.batch_invariant).__name__}")
    if isinstance(gpu_memory_utilization, bool) or not isinstance(gpu_memory_utilization, (int, float)):
        raise TypeError(f"LLM gpu_memory_utilization must be a number, got {type(gpu_memory_utilization).__name__}")
    if tokenizer is not None:
        if not isinstance(tokenizer, (str, os.PathLike)):
            raise TypeError(f"LLM tokenizer must be a folder path, got {type(tokenizer).__name__}")
        if not os.path.isdir(tokenizer):
            raise FileNotFoundError(f"tokenizer folder not found: {os.fspath(tokenizer)!r}")
    if args.preemption_mode not in ("recompute", "swap"):
        raise ValueError(f"LLM preemption_mode must be 'recompute' or 'swap', got {args.preemption_mode!r}")
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"LLM gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")


def parallel_sizes(tensor_parallel_size: int, pipeline_parallel_size: int) -> str:
    """The parallel sizes as a message names them: ``tensor_parallel_size=2`` or
    ``tensor_parallel_size=2 x pipeline_parallel_size=2 = 4 ranks``."""
    if pipeline_parallel_size == 1:
        return f"tensor_parallel_size={tensor_parallel_size}"
    world = tensor_parallel_size * pipeline_parallel_size
    return f"tensor_parallel_size={tensor_parallel_size} x pipeline_parallel_size={pipeline_parallel_size} = {world} ranks"


def cores_problem(tensor_parallel_size: int, pipeline_parallel_size: int) -> Optional[str]:
    """Why the ranks do not fit the CPU cores this process may use (one worker process a rank), or
    None; ``PAGEDGEN_TP_OVERSUBSCRIBE=1`` lifts the limit (tests on small machines set it). The
    engine reports it with the sizes' other problems (``loader.check_parallel``)."""
    world = tensor_parallel_size * pipeline_parallel_size
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if world > cores and os.environ.get("PAGEDGEN_TP_OVERSUBSCRIBE", "") in ("", "0"):
        return f"{parallel_sizes(tensor_parallel_size, pipeline_parallel_size)} must be <= the CPU cores this process may use ({cores})"
    return None


def check_use_tqdm(use_tqdm) -> None:
    """``use_tqdm`` of a generation call must be a bool (TypeError)."""
    if not isinstance(use_tqdm, bool):
        raise TypeError(f"use_tqdm must be a bool, got {type(use_tqdm).__name__}")
