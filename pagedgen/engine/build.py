"""Building an ``LLMEngine`` from ``LLM(...)``'s arguments, once, in this order (each error is
raised before the steps after it run):

    check_llm_args                 types, ranges, device, extension (llm_args.py): nothing loaded yet
    ModelConfig                    config.json (model/loader.py), its quantization (model/quantization.py), the parallel
                                   sizes against it and the CPU cores (one message)
    MatmulConfig, max_model_len    the draft's config.json against the target's (spec_decode/draft_checks.py)
    tokenizer, EOS token ids       the draft's tokenizer against the target's
    load_models                    executor/factory.py: in process, the model (and draft) here
    CacheConfig                    KV blocks (core/kv_sizing.py); on a GPU by default what a profiling
                                   forward pass leaves (executor/factory.py); swap space
    SchedulerConfig
    make_executor                  executor/factory.py: in process, or worker processes
    RequestProcessor, LLMEngine

The engine side (this module) holds no model and imports nothing of ``worker`` or ``sample``: the
executor factory is the one door to them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

import torch

from pagedgen.config import CacheConfig, ModelConfig, SchedulerConfig
from pagedgen.core import kv_sizing
from pagedgen.core.blocks import cdiv
from pagedgen.engine.llm_engine import LLMEngine
from pagedgen.engine.pooling_checks import resolve_runner
from pagedgen.engine.processor import RequestProcessor
from pagedgen.executor.factory import ExecutorConfig, LoadedModels, load_models, make_executor, profile_kv_cache_bytes
from pagedgen.layers.matmul import MatmulConfig, choose_matmul
from pagedgen.llm_args import LLMArgs, check_llm_args, cores_problem
from pagedgen.lora.config import LoRAConfig
from pagedgen.lora.peft import LoRAChecker, ModelShapes
from pagedgen.model import loader
from pagedgen.spec_decode.draft_checks import check_draft_tokenizer, check_speculative_model, naming_the_draft
from pagedgen.structured_output.grammar import GrammarCompiler


@dataclass(frozen=True)
class BuiltEngine:
    """An engine and what ``LLM`` keeps of its making.

    Attributes:
        engine: the engine (its ``cache_config``, ``scheduler_config``, ``processor``, ``executor``).
        tokenizer: the Hugging Face tokenizer (the processor's).
        model_config: the model's, in the resolved dtype.
        matmul_config: how the linear layers multiply (layers/matmul/).
        device: where the weights and the KV cache live.
        models: the model (and the draft model) when they live in this process, else None.
    """

    engine: LLMEngine
    tokenizer: Any
    model_config: ModelConfig
    matmul_config: MatmulConfig
    device: torch.device
    models: LoadedModels


def build_engine(args: LLMArgs) -> BuiltEngine:
    """The engine of ``LLM(**args)`` (see the module docstring for the order of the steps; ``LLM``'s
    docstring for the errors)."""
    spec_config, device = check_llm_args(args)  # TypeError / ValueError before anything is loaded
    model = os.fspath(args.model)
    hf_config = loader.load_hf_config(model)
    model_config = loader.model_config_from_hf(hf_config, loader.resolve_dtype(args.dtype, hf_config), args.quantization)
    pooling = resolve_runner(args.runner, args.convert, args.pooler_config, hf_config, model_config.architecture, os.fspath(args.model))
    if pooling is not None and (args.distributed_executor_backend is not None or args.tensor_parallel_size * args.pipeline_parallel_size > 1
                                or spec_config is not None):
        raise ValueError("LLM: a pooling model (runner='pooling', convert, or a *ForSequenceClassification checkpoint) runs in "
                         "process only: distributed_executor_backend=None, tensor_parallel_size=pipeline_parallel_size=1 and "
                         "no speculative_config")
    backend, tp, pp = args.distributed_executor_backend, args.tensor_parallel_size, args.pipeline_parallel_size
    if tp * pp > 1:
        loader.check_parallel(hf_config, model_config, tp, pp, (cores_problem(tp, pp),))  # ValueError before any process
        backend = "mp"
    batch_invariant = device.type == "cpu" if args.batch_invariant is None else args.batch_invariant
    matmul_config = choose_matmul(model_config.dtype, device, batch_invariant)  # ValueError before loading
    max_model_len = args.max_model_len
    if max_model_len is None:
        max_model_len = model_config.max_position_embeddings
    elif max_model_len > model_config.max_position_embeddings:
        raise ValueError(
            f"LLM max_model_len must be <= the model's max_position_embeddings "
            f"({model_config.max_position_embeddings}), got {max_model_len}"
        )
    max_num_batched_tokens = args.max_num_batched_tokens or max(4096, args.max_num_seqs)
    if pooling is not None and pooling.whole_prompt:
        # an encoder computes each prompt whole in one step (bidirectional attention: no chunks), so
        # the step's budget covers the longest prompt, max_model_len, as vLLM sets it for encoder-only models
        max_num_batched_tokens = max(max_num_batched_tokens, max_model_len)
    draft = None if spec_config is None else check_speculative_model(spec_config, model_config, max_model_len)

    tokenizer = loader.load_tokenizer(os.fspath(args.tokenizer) if args.tokenizer is not None else model)
    eos_token_ids = loader.load_eos_token_ids(model, hf_config, tokenizer)
    if draft is not None:
        with naming_the_draft(spec_config.model):
            check_draft_tokenizer(spec_config.model, tokenizer)  # ValueError before any weights load

    lora = _lora(args, hf_config, model_config, pooling)  # (LoRAConfig, ModelShapes) or None
    # pooling steps are prefills: no decode graphs; LoRA's row groups change every step: none either
    use_graphs = device.type == "cuda" and not args.enforce_eager and pooling is None and lora is None
    executor_config = ExecutorConfig(
        backend=backend, model=model, hf_config=hf_config, model_config=model_config, device=device,
        matmul_config=matmul_config, max_model_len=max_model_len, seed=args.seed,
        cuda_graph_max_seqs=args.max_num_seqs if use_graphs else 0, tensor_parallel_size=tp, pipeline_parallel_size=pp,
        draft=None if draft is None else (spec_config.model, *draft),
        pooling=pooling is not None, lora=lora,
    )
    models = load_models(executor_config)
    cache_config = _cache_config(args, model_config, None if draft is None else draft[1], device, models, max_model_len, max_num_batched_tokens)
    scheduler_config = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        preemption_mode=args.preemption_mode,
        max_loras=0 if lora is None else lora[0].max_loras,
    )
    executor = make_executor(executor_config, cache_config, models)
    grammars = GrammarCompiler(tokenizer, model_config.vocab_size, eos_token_ids)  # structured outputs, compiled on first use
    processor = RequestProcessor(tokenizer, model_config.vocab_size, max_model_len, args.max_num_seqs, grammars)
    if lora is not None:
        processor.loras = LoRAChecker(*lora)
    engine = LLMEngine(cache_config, scheduler_config, executor, processor, eos_token_ids, spec_config)
    engine.pooling = pooling
    engine.quantization = model_config.quantization
    engine.grammars.forward_on_host = device.type == "cpu"  # a mask filled beside the forward needs a core of its own
    return BuiltEngine(engine, tokenizer, model_config, matmul_config, device, models)


def _lora(args: LLMArgs, hf_config, model_config: ModelConfig, pooling) -> Optional[tuple[LoRAConfig, ModelShapes]]:
    """LoRA's config and the shapes an adapter must fit, when ``enable_lora``; ValueError for a
    pooling model or a model without the Llama family's gated MLP."""
    if not args.enable_lora:
        return None
    if pooling is not None:
        raise ValueError("LLM enable_lora=True: LoRA adapters run on generation models only, not with a pooling model (runner='pooling')")
    intermediate = getattr(hf_config, "intermediate_size", None)
    if not isinstance(intermediate, int):
        raise ValueError(f"LLM enable_lora=True: {model_config.architecture} is not supported; LoRA runs on the Llama family "
                         "(Llama, Mistral, Qwen2/3, Gemma)")
    return LoRAConfig.from_args(args.max_loras, args.max_lora_rank, args.max_cpu_loras), ModelShapes.of(model_config, intermediate)


def _cache_config(args: LLMArgs, model_config: ModelConfig, draft_config: Optional[ModelConfig], device: torch.device,
                  models: LoadedModels, max_model_len: int, max_num_batched_tokens: int) -> CacheConfig:
    """The KV cache: ``num_kv_blocks``, or the blocks ``kv_cache_memory_bytes`` holds, or the
    device's default (core/kv_sizing.py); CPU swap space for swap preemption. ValueError when it
    cannot hold one sequence of ``max_model_len`` tokens or the swap space one block."""
    # a block of the pool holds its tokens' keys and values in the model's cache and, with a draft
    # model, in the draft's (the same block ids, spec_decode/draft_model.py): one budget for both
    block_size, kv_bytes = args.block_size, args.kv_cache_memory_bytes
    swap_block_bytes = model_config.kv_bytes_per_token(args.kv_cache_dtype) * block_size  # the draft's cache stays "auto"
    block_bytes = swap_block_bytes + (0 if draft_config is None else draft_config.kv_bytes_per_token() * block_size)
    sized_by = kv_sizing.sizing_source(args.num_kv_blocks, kv_bytes, device.type, args.gpu_memory_utilization)
    if args.num_kv_blocks is None and kv_bytes is None and device.type == "cuda":
        kv_bytes = profile_kv_cache_bytes(models, max_num_batched_tokens, args.gpu_memory_utilization)
    num_blocks = kv_sizing.num_kv_blocks(block_bytes, args.num_kv_blocks, kv_bytes, args.max_num_seqs * cdiv(max_model_len, block_size))
    num_cpu_blocks = 0
    if args.preemption_mode == "swap":
        # swap space holds the model's blocks only (a draft recomputes its cache after a swap-in)
        swap_bytes = args.swap_space_bytes if args.swap_space_bytes is not None else min(4 << 30, num_blocks * swap_block_bytes)
        num_cpu_blocks = swap_bytes // swap_block_bytes
        if num_cpu_blocks < 1:
            raise ValueError(f"LLM swap_space_bytes must hold at least one block ({swap_block_bytes} bytes), got {swap_bytes}")
    cache_config = CacheConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        enable_prefix_caching=args.enable_prefix_caching,
        num_cpu_blocks=num_cpu_blocks,
        sliding_window=model_config.sliding_window,
        cache_dtype=args.kv_cache_dtype,
    )
    kv_sizing.check_max_model_len(num_blocks, block_size, block_bytes, max_model_len, args.max_model_len is not None, sized_by)
    return cache_config
