"""Building an engine's executor (``LLM(distributed_executor_backend=...)``), the one door from the
driver to the worker side: ``engine/build.py`` calls these three, in this order, and imports nothing
of ``worker`` or ``sample`` itself.

    load_models(config)                        in process: the model (and a draft model) loaded here
    profile_kv_cache_bytes(models, ...)        a GPU's default KV cache size (worker/kv_profile.py)
    make_executor(config, cache_config, models)
        None      InProcessExecutor(ModelRunner(model, cache_config, Sampler(seed), ...))
        "mp"      MultiprocExecutor(WorkerSpec(...))   each worker loads its own shard
        "pickle"  PicklingExecutor(WorkerSpec(...))    the same worker, in this process

In process the model is loaded before the KV cache is sized (on a GPU its size needs a profiling
forward pass of the model) and the model runner after (it allocates the cache); the workers get the
cache's size in their ``WorkerSpec`` and load the model themselves.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from pagedgen.config import CacheConfig, ModelConfig
from pagedgen.executor.multiproc import MultiprocExecutor
from pagedgen.executor.uniproc import InProcessExecutor, PicklingExecutor
from pagedgen.layers.matmul import MatmulConfig, prepare_matmuls
from pagedgen.model import loader
from pagedgen.sample.sampler import Sampler
from pagedgen.spec_decode.draft_checks import naming_the_draft
from pagedgen.worker import kv_profile
from pagedgen.worker.model_runner import ModelRunner
from pagedgen.lora.manager import LoRAManager
from pagedgen.worker.worker import WorkerSpec


@dataclass(frozen=True)
class ExecutorConfig:
    """What the executor is built from, checked by ``engine/build.py`` before anything loads.

    Attributes:
        backend: None (in process), "mp" (worker processes) or "pickle" (a worker in this process
            behind a pickled boundary); "mp" whenever ``tensor_parallel_size`` or
            ``pipeline_parallel_size`` is > 1.
        model: the checkpoint folder; ``hf_config`` and ``model_config`` read from it (the
            resolved dtype).
        device: where the weights and the KV cache live.
        matmul_config: how the linear layers multiply (layers/matmul/).
        max_model_len: most tokens of one sequence (sizes the model runner's block tables).
        seed: the draw key of requests without their own seed (the sampler's).
        cuda_graph_max_seqs: decode batches up to this size are captured in CUDA graphs (0: none;
            with more than one rank none are).
        tensor_parallel_size, pipeline_parallel_size: the worker ranks, their product.
        draft: method "draft_model": the draft's (folder, hf_config, ModelConfig); in process only.
    """

    backend: Optional[str]
    model: str
    hf_config: Any
    model_config: ModelConfig
    device: torch.device
    matmul_config: MatmulConfig
    max_model_len: int
    seed: int
    cuda_graph_max_seqs: int = 0
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    draft: Optional[tuple[str, Any, ModelConfig]] = None
    pooling: bool = False  # a pooling model (LLM(runner="pooling")): the runner pools instead of sampling
    lora: Optional[tuple] = None  # LoRA on: (LoRAConfig, ModelShapes), for the in-process runner or the workers


@dataclass(frozen=True)
class LoadedModels:
    """The models loaded in the driver's process: both None when the workers load theirs."""

    model: Optional[nn.Module] = None
    draft_model: Optional[nn.Module] = None  # speculative decoding's draft model, beside the model


def load_models(config: ExecutorConfig) -> LoadedModels:
    """In process (``backend`` None): the model and, with a draft, the draft model, loaded on
    ``config.device`` with their matmuls prepared. Errors reading the draft name
    ``speculative_config['model']``. With worker processes nothing is loaded here."""
    model = draft_model = None
    if config.backend is None:
        model = loader.load_model(config.model, config.hf_config, config.model_config, config.device)
        prepare_matmuls(model, config.matmul_config)
    if config.draft is not None:
        path, draft_hf, draft_config = config.draft
        with naming_the_draft(path):
            draft_model = loader.load_model(path, draft_hf, draft_config, config.device)
        prepare_matmuls(draft_model, config.matmul_config)
    return LoadedModels(model, draft_model)


def profile_kv_cache_bytes(models: LoadedModels, max_num_batched_tokens: int, gpu_memory_utilization: float) -> int:
    """Bytes a GPU leaves for the KV cache after a profiling forward pass of ``max_num_batched_tokens``
    tokens of the in-process model (vLLM's rule, worker/kv_profile.py). ValueError if none is left."""
    return kv_profile.cuda_kv_bytes(models.model, max_num_batched_tokens, gpu_memory_utilization)


def make_executor(config: ExecutorConfig, cache_config: CacheConfig, models: LoadedModels):
    """The executor of ``config.backend`` over a KV cache of ``cache_config``: in process a
    ``ModelRunner`` (it allocates the cache) over ``models``; else worker processes (or a pickled
    worker) built from a ``WorkerSpec``, each worker with cores // ranks torch threads."""
    if config.backend is None:
        runner = ModelRunner(models.model, cache_config, Sampler(config.seed), cuda_graph_max_seqs=config.cuda_graph_max_seqs,
                             max_model_len=config.max_model_len, draft_model=models.draft_model, pooling=config.pooling,
                             lora=None if config.lora is None else LoRAManager(models.model, *config.lora))
        return InProcessExecutor(runner)
    world = config.tensor_parallel_size * config.pipeline_parallel_size
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    spec = WorkerSpec(
        model=config.model,
        dtype=config.model_config.dtype,
        device=config.device,
        matmul_config=config.matmul_config,
        cache_config=cache_config,
        max_model_len=config.max_model_len,
        seed=config.seed,
        cuda_graph_max_seqs=config.cuda_graph_max_seqs if world == 1 else 0,  # collectives are not captured
        num_threads=torch.get_num_threads() if world == 1 else max(1, cores // world),
        tensor_parallel_size=config.tensor_parallel_size,
        pipeline_parallel_size=config.pipeline_parallel_size,
        quantization=config.model_config.quantization,
        lora=config.lora,
    )
    return MultiprocExecutor(spec) if config.backend == "mp" else PicklingExecutor(spec)
