"""``LLM``: the offline batch-generation API, with the names of vLLM's ``vllm.LLM``.

    from pagedgen import LLM, SamplingParams
    llm = LLM("../shared/models/stories260K")
    outputs = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=32))
    print(outputs[0].outputs[0].text)
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator, Optional, Union
from typing import Sequence as Seq

import torch

from pagedgen.beam_search import BeamSearchOutput, BeamSearchParams
from pagedgen.call_lock import CallLock
from pagedgen.engine import offline
from pagedgen.engine.build import build_engine
from pagedgen.engine.llm_engine import LLMEngine
from pagedgen.llm_args import LLMArgs, check_use_tqdm, with_plain_numbers
from pagedgen.llm_pooling import PoolingCalls
from pagedgen.llm_recording import RecordingCalls
from pagedgen.lora.request import LoRARequest
from pagedgen.outputs import RequestOutput
from pagedgen.sampling_params import SamplingParams

PromptsType = Union[str, Seq[str], Seq[Seq[int]]]
ChatMessage = dict  # {"role": str, "content": str}


class LLM(PoolingCalls, RecordingCalls):
    """Loads a Hugging Face checkpoint (an architecture of pagedgen.model.registry) and generates
    completions for lists of prompts.

    ``generate``, ``chat`` and ``beam_search`` run a batch to the end; ``generate_stream`` pulls
    prompts lazily from any iterable and yields results as they finish; ``llm_engine`` is the
    request-level engine underneath (``add_request`` / ``step`` / ``abort_request``).

    Threads: calls on one LLM are serialised by a lock (``generate``, ``chat``, ``beam_search`` and
    ``generate_stream``, which holds it from its first item until it is exhausted or closed), so
    threads sharing an LLM each get the results they would get alone, one call at a time. A call
    made by a thread while it is inside a ``generate_stream`` of the same LLM (in the loop over it)
    raises RuntimeError at once instead of waiting for itself forever. The engine itself
    (``llm_engine``) is not thread-safe: drive it from one thread.

    Interrupts: a call stopped by any exception, KeyboardInterrupt included, aborts its requests
    and leaves the KV block pool whole; the next call's greedy and seeded outputs equal a fresh
    LLM's (see ``pagedgen.engine.llm_engine``).

    Args:
        model: path of a checkpoint folder (config.json, model.safetensors or a sharded
            model.safetensors.index.json, tokenizer files, optional generation_config.json).
        tokenizer: tokenizer folder, if not the model folder.
        dtype: "auto" (the checkpoint's), "float32", "bfloat16" or "float16".
        block_size: tokens per KV block (16 by default).
        num_kv_blocks: size the KV cache in blocks; overrides ``kv_cache_memory_bytes``.
        kv_cache_memory_bytes: size the KV cache in bytes (all layers, keys and values). Default:
            on the CPU 25% of the available memory (``kv_sizing.DEFAULT_CPU_KV_FRACTION``), capped at
            what ``max_num_seqs`` sequences of ``max_model_len`` tokens can use; on a GPU what
            ``gpu_memory_utilization`` leaves after a profiling forward pass.
        max_num_seqs: most sequences in one step.
        max_num_batched_tokens: most tokens in one step; longer prompts are prefilled in chunks.
            Default max(4096, max_num_seqs); for an encoder (a prompt computed whole) at least max_model_len.
        max_model_len: most tokens (prompt + output) per sequence; default and upper bound the
            model's ``max_position_embeddings``. The KV cache must hold one sequence of this many
            tokens (else ValueError: a larger cache, or a smaller max_model_len).
        seed: the key of the random draws of requests without their own seed (docs/sampling.md).
        enforce_extension: raise instead of falling back to the PyTorch reference ops when the
            compiled extension ``pagedgen._C`` is missing.
        enable_prefix_caching: share the cached full blocks of equal prompt prefixes between
            requests (and across ``generate`` calls) instead of recomputing them.
        preemption_mode: "recompute" (free a preempted request's blocks, prefill it again later) or
            "swap" (copy its blocks to CPU swap space and back).
        swap_space_bytes: CPU swap space for "swap" (default: min(4 GiB, the KV cache's size)).
        kv_cache_dtype: "auto" (the model's dtype) or a 1-byte cache, "int8", "fp8" (= "fp8_e4m3"),
            "fp8_e4m3", "fp8_e5m2": one byte a value plus one bf16 scale per token and KV head, about
            twice the blocks in the same memory (docs/kv_cache_dtype.md). CPU only for now.
        device: "cpu", "cuda" or "cuda:N" (default: "cuda" when a GPU is available, else "cpu").
            Weights and the KV cache live there.
        gpu_memory_utilization: on a GPU, the share of its memory that weights, activations and
            the KV cache may take; the KV cache gets what a profiling forward pass leaves (vLLM's
            rule). Ignored when ``num_kv_blocks`` or ``kv_cache_memory_bytes`` is given.
        enforce_eager: on a GPU, do not capture decode steps in CUDA graphs.
        batch_invariant: a request's tokens and logprobs do not depend, bit for bit, on the other
            requests of its steps (docs/determinism.md). None (the default): on for the CPU, off on
            GPUs; True on a GPU raises ValueError (no such mode there yet).
        distributed_executor_backend: where the model runs. None (the default): in this process.
            "mp": in a worker process that holds the model, the KV cache and the sampler and gets
            each step as a plain-data record (docs/architecture.md); end it with ``shutdown()``
            or ``with LLM(...) as llm:``. The worker is spawned: a script's top level must be
            guarded by ``if __name__ == "__main__":``, as for any spawned process. "pickle": the same worker in this process behind a pickled
            boundary (for tests and debugging).
        tensor_parallel_size: worker processes that each hold a shard of the weights and of the KV
            cache (Megatron-style: heads and MLP features split, an all-reduce after each
            row-parallel layer; docs/architecture.md). Must divide the attention and KV heads and
            be at most the CPU cores (ValueError before any process starts); > 1 implies
            ``distributed_executor_backend="mp"``; each worker gets cores // (tensor_parallel_size x
            pipeline_parallel_size) threads.
        pipeline_parallel_size: pipeline stages, worker processes that each hold a run of the
            decoder layers and their KV cache (the embedding on the first, the final norm and head
            on the last), handing activations on; each step runs as micro-batches, one per stage,
            in flight together (docs/architecture.md). Layers split as vLLM does (5 over 2: 3 + 2);
            must be at most the decoder layers, and tensor_parallel_size x pipeline_parallel_size at
            most the CPU cores (ValueError before any process starts); > 1 implies
            ``distributed_executor_backend="mp"``.
        speculative_config: speculative decoding, vLLM's names (docs/speculative.md): a dict
            {"method": "ngram" | "draft_model", "num_speculative_tokens": k, "model": draft path,
            "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"}, checked before
            anything is loaded (ValueError naming the field and its range). In process only
            (distributed_executor_backend=None, tensor_parallel_size=1). "ngram": outputs equal
            speculation off, token for token. "draft_model": a second, small model in the same
            engine proposes the drafts; its KV cache has the same blocks as the model's, so each
            block of the pool (``num_kv_blocks``, ``kv_cache_memory_bytes``) costs both models'
            bytes. The draft must share the model's vocabulary and tokenizer (ValueError), reach
            ``max_model_len`` positions and have no sliding window; it runs in the model's dtype.
            Greedy outputs equal speculation off token for token; sampled ones follow the model's
            distribution (Leviathan et al.'s rejection sampling), a function of the request's seed.
        runner, convert, pooler_config: pooling models (docs/pooling.md): runner "auto" (the
            architecture decides: ``*ForSequenceClassification`` pools), "generate" or "pooling";
            convert "auto", "none", "embed" (pool a ``*ForCausalLM``'s hidden states) or "classify";
            pooler_config a dict of ``PoolerConfig`` fields (pooling_type LAST/MEAN/CLS/ALL/STEP...).
        quantization: None (the checkpoint's ``quantization_config``, or float weights), "int8"
            (a float checkpoint's linear layers quantized at load: int8 W8A8), "fp8" (FP8 e4m3
            W8A16: quantized at load, or read from an ``fp8``-format checkpoint),
            "compressed-tensors" (int8 W8A8, FP8 W8A16 or int4 W4A16 weights read from the
            checkpoint), "gptq" or "awq" (int4 W4A16 checkpoints; act-order GPTQ refused).
            ValueError for others (docs/quantization.md).
        enable_lora: serve PEFT LoRA adapters, one per request (``lora_request=`` of the calls;
            docs/lora.md): Llama-family generation models; with tensor parallelism and
            speculative decoding, not with pipeline stages (ValueError).
        max_loras: adapters one step may run (device slots; more wait their turn). Default 1.
        max_lora_rank: the largest adapter rank ``r`` accepted. Default 16.
        max_cpu_loras: adapters kept loaded in host memory (LRU; default ``max_loras``).

    Raises:
        FileNotFoundError: the folder, config.json or the safetensors weights are missing (of the
            draft model too: its errors name ``speculative_config['model']``).
        ValueError: unsupported architecture, a bad argument value, or a KV cache smaller than one
            sequence of ``max_model_len`` tokens.
        TypeError: an argument of the wrong type.
        RuntimeError: ``enforce_extension=True`` and the extension is not available.
    """

    def __init__(
        self,
        model: str,
        *,
        tokenizer: Optional[str] = None,
        dtype: Union[str, torch.dtype] = "auto",
        block_size: int = 16,
        num_kv_blocks: Optional[int] = None,
        kv_cache_memory_bytes: Optional[int] = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: Optional[int] = None,
        max_model_len: Optional[int] = None,
        seed: int = 0,
        enforce_extension: bool = False,
        enable_prefix_caching: bool = True,
        preemption_mode: str = "recompute",
        swap_space_bytes: Optional[int] = None,
        kv_cache_dtype: str = "auto",
        device: Union[str, torch.device, None] = None,
        gpu_memory_utilization: float = 0.9,
        enforce_eager: bool = False,
        batch_invariant: Optional[bool] = None,
        distributed_executor_backend: Optional[str] = None,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        speculative_config: Optional[dict[str, Any]] = None,
        runner: str = "auto",
        convert: str = "auto",
        pooler_config: Optional[dict[str, Any]] = None,
        quantization: Optional[str] = None,
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        max_cpu_loras: Optional[int] = None,
    ) -> None:
        args = LLMArgs(
            model=model, tokenizer=tokenizer, dtype=dtype, block_size=block_size, num_kv_blocks=num_kv_blocks,
            kv_cache_memory_bytes=kv_cache_memory_bytes, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len, seed=seed,
            enforce_extension=enforce_extension, enable_prefix_caching=enable_prefix_caching,
            preemption_mode=preemption_mode, swap_space_bytes=swap_space_bytes, kv_cache_dtype=kv_cache_dtype, device=device,
            gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
            batch_invariant=batch_invariant, distributed_executor_backend=distributed_executor_backend,
            tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
            speculative_config=speculative_config, runner=runner, convert=convert, pooler_config=pooler_config,
            quantization=quantization,
            enable_lora=enable_lora, max_loras=max_loras, max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras,
        )
        # the argument checks first (llm_args.py: errors before anything is loaded), then the configs,
        # the tokenizer, the model, the KV cache's size, the executor and the engine (engine/build.py)
        args = with_plain_numbers(args)  # numpy ints (a value read from an array) as Python ints
        built = build_engine(args)
        self.llm_engine = built.engine
        self.processor = built.engine.processor
        self.cache_config = built.engine.cache_config
        self.scheduler_config = built.engine.scheduler_config
        self.tokenizer = built.tokenizer
        self.model_config = built.model_config
        self.matmul_config = built.matmul_config
        self.model = built.models.model  # None when the model lives in worker processes
        self.draft_model = built.models.draft_model  # speculative decoding's draft model (method "draft_model"), beside the model
        self.device = built.device
        self.seed = args.seed  # the draw key of requests without their own seed
        self._lock = CallLock()  # one call at a time (call_lock.py)

    def shutdown(self) -> None:
        """End the worker processes of ``distributed_executor_backend="mp"``, after which its calls
        raise RuntimeError (in process there is nothing to end). Idempotent. Leaving
        ``with LLM(...) as llm:`` calls it; garbage collection and interpreter exit end the
        workers too."""
        self.llm_engine.executor.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    @property
    def engine(self) -> LLMEngine:
        """The same object as ``llm_engine`` (the older name)."""
        return self.llm_engine

    @property
    def detokenizer(self):
        return self.processor.detokenizer

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Tokens that end a completion or a beam (from generation_config.json / config.json)."""
        return self.llm_engine.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: frozenset[int]) -> None:
        self.llm_engine.eos_token_ids = frozenset(ids)
        self.processor.grammars.eos_token_ids = frozenset(ids)  # structured outputs end on these

    # ----- generation ------------------------------------------------------------------------------
    def generate(self, prompts: PromptsType, sampling_params: Union[SamplingParams, Seq[SamplingParams], None] = None, *, use_tqdm: bool = True,
                 on_error: Optional[str] = None, lora_request: Union[LoRARequest, Seq[Optional[LoRARequest]], None] = None) -> list[RequestOutput]:
        """Generate completions for every prompt; results in the order of ``prompts``.

        Args:
            prompts: a str, or a list of prompts: str, token-id lists (bare str and token-id
                lists not mixed), ``{"prompt": str}`` or ``{"prompt_token_ids": [...]}``.
            sampling_params: one SamplingParams for all prompts, or one per prompt (default: vLLM's
                defaults, i.e. temperature 1.0 and max_tokens 16).
            use_tqdm: show a progress bar of finished requests (all n completions) with output tok/s.
            on_error: a completion that fails alone mid-generation (a structured-output grammar at
                a dead end, or over llguidance's parser limits) while the others run on. None
                (vLLM's behaviour): it finishes "stop" at that point, with a warning. "return": it
                finishes "error", its output's ``error`` says why, the other requests complete.
                "raise": RuntimeError naming the prompt and why, the call's other requests aborted.
            lora_request: a LoRARequest for all prompts, or one (or None: the base model) per
                prompt (``LLM(enable_lora=True)``; docs/lora.md).

        Returns:
            one RequestOutput per prompt (``request_id`` and ``index`` its position), holding its
            ``n`` completions ordered by index. An empty list gives [].

        Raises:
            TypeError / ValueError: bad prompts or parameters (naming the index and the allowed
                range), raised before any work starts; the LLM stays usable.
            RuntimeError: requests added with ``llm_engine.add_request`` are still unfinished, or
                this thread is inside a ``generate_stream`` of this LLM; a request that failed
                with ``on_error="raise"`` (the LLM stays usable, as after any failed call).
        """
        check_use_tqdm(use_tqdm)
        with self._lock.held("generate"):
            return offline.generate(self.llm_engine, prompts, sampling_params, use_tqdm, on_error, lora_request)

    def chat(
        self,
        messages: Union[Seq[ChatMessage], Seq[Seq[ChatMessage]]],
        sampling_params: Union[SamplingParams, Seq[SamplingParams], None] = None,
        *,
        chat_template: Optional[str] = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        use_tqdm: bool = True,
        on_error: Optional[str] = None,
        lora_request: Union[LoRARequest, Seq[Optional[LoRARequest]], None] = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations rendered with the tokenizer's chat template.

        Args:
            messages: one conversation (a list of {"role": str, "content": str}) or a list of them.
            sampling_params: as in ``generate``: one, or one per conversation.
            chat_template: a Jinja template to use instead of the tokenizer's.
            add_generation_prompt: end the prompt with the template's cue for the assistant's turn.
            continue_final_message: let the reply continue the last message (no end-of-turn after
                it); not together with ``add_generation_prompt``.
            use_tqdm: show a progress bar.
            on_error, lora_request: as in ``generate``.

        Returns:
            one RequestOutput per conversation; ``prompt`` is the rendered text. The rendered text
            is tokenized without adding special tokens (the template writes BOS if it wants one).

        Raises:
            ValueError: no chat template (the tokenizer has none and none was given), a message
                without a str role and content, or both add_generation_prompt and
                continue_final_message.
            TypeError: messages of the wrong shape.
            RuntimeError: as ``generate``.
        """
        check_use_tqdm(use_tqdm)
        with self._lock.held("chat"):
            return offline.chat(self.llm_engine, messages, sampling_params, chat_template, add_generation_prompt, continue_final_message,
                                use_tqdm, on_error, lora_request)

    def beam_search(self, prompts: PromptsType, params: BeamSearchParams, *, use_tqdm: bool = True,
                    lora_request: Union[LoRARequest, Seq[Optional[LoRARequest]], None] = None) -> list[BeamSearchOutput]:
        """Beam search for each prompt; beams of one prompt share their common history's KV blocks.

        Each step, every running beam's next-token log-probabilities are computed in the shared
        batch; the top ``2 * beam_width`` continuations are ranked, the best ``beam_width`` that did
        not end run on (forking their parent's block table, copy-on-write), and the ones ending in
        EOS or at ``max_tokens`` enter the finished pool scored ``cum_logprob / length **
        length_penalty``. Selection and stopping follow transformers' ``generate(num_beams=...)``
        (see ``pagedgen.engine.beam_group``), so results match it.

        Args:
            prompts: as in ``generate``.
            params: a BeamSearchParams (beam_width, max_tokens, ignore_eos, length_penalty,
                early_stopping).
            use_tqdm: show a progress bar of finished prompts.
            lora_request: as in ``generate``.

        Returns:
            one BeamSearchOutput per prompt, in input order, its sequences best first.

        Raises:
            TypeError / ValueError: bad prompts or params (before any work starts).
            RuntimeError: as ``generate``.
        """
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        check_use_tqdm(use_tqdm)
        with self._lock.held("beam_search"):
            return offline.beam_search(self.llm_engine, prompts, params, use_tqdm, lora_request)

    def generate_stream(
        self,
        prompts: Iterable,
        sampling_params: Optional[SamplingParams] = None,
        *,
        max_in_flight: Optional[int] = None,
        use_tqdm: bool = False,
        on_error: Optional[str] = None,
        lora_request: Optional[LoRARequest] = None,
    ) -> Iterator[RequestOutput]:
        """Generate for prompts pulled lazily from any iterable, yielding results as they finish.

        At most ``max_in_flight`` requests are queued or running at a time; the next prompts are
        pulled as requests finish, so a generator over a file of any size works and memory stays
        flat in the number of prompts (nothing of a finished request is kept).

        Args:
            prompts: an iterable of prompts as ``generate`` takes them one by one (a str, a token-id
                list, ``{"prompt": ...}`` / ``{"prompt_token_ids": ...}``), or of ``(prompt,
                SamplingParams)`` tuples for per-item parameters. A single str is one prompt.
            sampling_params: for the items without their own (default: vLLM's defaults).
            max_in_flight: most requests in flight (default: 4 * max_num_seqs).
            use_tqdm: show a progress bar of finished requests.
            on_error: as in ``generate`` ("raise": after the outputs finished before it are yielded).
            lora_request: one LoRARequest (or None) for every item.

        Yields:
            RequestOutputs in the order they finish, each with ``index`` (and ``request_id``, as
            a str) its position in ``prompts``.

        Raises:
            TypeError / ValueError: at once for bad arguments; for a bad item, after the items
                before it have finished and been yielded, naming its index (``prompts[i]``).
            Exception: whatever ``prompts`` raises while it is iterated, after the items it gave
                before have finished and been yielded.
            RuntimeError: as ``generate``, at the first item.
        Closing the generator early (``close()``, ``break`` out of a loop that drops it), or a
        KeyboardInterrupt (from the source too), aborts the requests in flight. The stream holds the LLM's lock until it is exhausted or closed.
        """
        check_use_tqdm(use_tqdm)
        outputs = offline.stream(self.llm_engine, prompts, sampling_params, max_in_flight, use_tqdm, on_error, lora_request)  # checks now, runs when pulled
        return self._lock.held_over("generate_stream", outputs)
