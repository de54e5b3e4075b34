"""``LLM``: the offline batch-generation API, with the names of vLLM's ``vllm.LLM``.

    from pagedgen import LLM, SamplingParams
    llm = LLM("../shared/models/stories260K")
    outputs = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=32))
    print(outputs[0].outputs[0].text)
"""
from __future__ import annotations

import logging
import os
import time
from typing import Callable, Optional, Sequence as Seq, Union

import torch

from pagedgen import inputs, ops
from pagedgen.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagedgen.config import CacheConfig, SchedulerConfig
from pagedgen.engine import kv_sizing
from pagedgen.engine.beam_group import BeamGroup
from pagedgen.engine.block_manager import cdiv
from pagedgen.engine.detokenizer import Detokenizer
from pagedgen.engine.llm_engine import EngineStats, LLMEngine
from pagedgen.engine.model_runner import ModelRunner
from pagedgen.engine.sampler import Sampler, make_generator
from pagedgen.engine.sequence import Sequence
from pagedgen.model import loader
from pagedgen.model.llama import LlamaForCausalLM, rope_cos_sin
from pagedgen.outputs import CompletionOutput, RequestOutput
from pagedgen.sampling_params import SamplingParams

logger = logging.getLogger("pagedgen")

PromptsType = Union[str, Seq[str], Seq[Seq[int]]]


def _check_use_tqdm(use_tqdm) -> None:
    if not isinstance(use_tqdm, bool):
        raise TypeError(f"use_tqdm must be a bool, got {type(use_tqdm).__name__}")

ChatMessage = dict  # {"role": str, "content": str}


class LLM:
    """Loads a Hugging Face Llama checkpoint and generates completions for lists of prompts.

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
            Default max(4096, max_num_seqs).
        max_model_len: most tokens (prompt + output) per sequence; default and upper bound the
            model's ``max_position_embeddings``. The KV cache must hold one sequence of this many
            tokens (else ValueError: a larger cache, or a smaller max_model_len).
        seed: seed of the sampler's generator (requests without their own seed).
        enforce_extension: raise instead of falling back to the PyTorch reference ops when the
            compiled extension ``pagedgen._C`` is missing.
        enable_prefix_caching: share the cached full blocks of equal prompt prefixes between
            requests (and across ``generate`` calls) instead of recomputing them.
        preemption_mode: "recompute" (free a preempted request's blocks, prefill it again later) or
            "swap" (copy its blocks to CPU swap space and back).
        swap_space_bytes: CPU swap space for "swap" (default: min(4 GiB, the KV cache's size)).
        device: "cpu", "cuda" or "cuda:N" (default: "cuda" when a GPU is available, else "cpu").
            Weights and the KV cache live there.
        gpu_memory_utilization: on a GPU, the share of its memory that weights, activations and
            the KV cache may take; the KV cache gets what a profiling forward pass leaves (vLLM's
            rule). Ignored when ``num_kv_blocks`` or ``kv_cache_memory_bytes`` is given.
        enforce_eager: on a GPU, do not capture decode steps in CUDA graphs.

    Raises:
        FileNotFoundError: the folder, config.json or the safetensors weights are missing.
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
        device: Union[str, torch.device, None] = None,
        gpu_memory_utilization: float = 0.9,
        enforce_eager: bool = False,
    ) -> None:
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
        ):
            inputs.check_positive_int(name, value, opt)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"LLM seed must be an int, got {type(seed).__name__}")
        if not -(2**63) <= seed < 2**64:
            raise ValueError(f"LLM seed must be a 64-bit integer, got {seed}")
        if block_size > 1024:
            raise ValueError(f"LLM block_size must be in [1, 1024] tokens, got {block_size}")
        for name, flag in (("enforce_extension", enforce_extension), ("enable_prefix_caching", enable_prefix_caching), ("enforce_eager", enforce_eager)):
            if not isinstance(flag, bool):
                raise TypeError(f"LLM {name} must be a bool, got {type(flag).__name__}")
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
        device = inputs.resolve_device(device)
        if enforce_extension and not ops.extension_available(device.type):
            raise RuntimeError(ops.extension_error(device.type))

        model = os.fspath(model)
        hf_config = loader.load_hf_config(model)
        model_config = loader.model_config_from_hf(hf_config, loader.resolve_dtype(dtype, hf_config))
        max_model_len_given = max_model_len is not None
        if max_model_len is None:
            max_model_len = model_config.max_position_embeddings
        elif max_model_len > model_config.max_position_embeddings:
            raise ValueError(
                f"LLM max_model_len must be <= the model's max_position_embeddings "
                f"({model_config.max_position_embeddings}), got {max_model_len}"
            )
        max_num_batched_tokens = max_num_batched_tokens or max(4096, max_num_seqs)

        from transformers import AutoTokenizer

        tok_path = os.fspath(tokenizer) if tokenizer is not None else model
        self.tokenizer = AutoTokenizer.from_pretrained(tok_path)
        self.detokenizer = Detokenizer(self.tokenizer)
        self.eos_token_ids = loader.load_eos_token_ids(model, hf_config, self.tokenizer)

        weights = loader.load_safetensors(model, model_config.dtype)
        cos, sin = rope_cos_sin(hf_config, model_config.head_dim, max_model_len)
        self.model = LlamaForCausalLM(model_config, weights, cos, sin, device)
        del weights

        block_bytes = model_config.kv_bytes_per_token() * block_size
        sized_by = kv_sizing.sizing_source(num_kv_blocks, kv_cache_memory_bytes, device.type, gpu_memory_utilization)
        if num_kv_blocks is None and kv_cache_memory_bytes is None and device.type == "cuda":
            kv_cache_memory_bytes = kv_sizing.cuda_kv_bytes(self.model, max_num_batched_tokens, gpu_memory_utilization)
        num_blocks = kv_sizing.num_kv_blocks(block_bytes, num_kv_blocks, kv_cache_memory_bytes, max_num_seqs * cdiv(max_model_len, block_size))
        num_cpu_blocks = 0
        if preemption_mode == "swap":
            swap_bytes = swap_space_bytes if swap_space_bytes is not None else min(4 << 30, num_blocks * block_bytes)
            num_cpu_blocks = swap_bytes // block_bytes
            if num_cpu_blocks < 1:
                raise ValueError(f"LLM swap_space_bytes must hold at least one block ({block_bytes} bytes), got {swap_bytes}")
        cache_config = CacheConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=enable_prefix_caching,
            num_cpu_blocks=num_cpu_blocks,
        )
        kv_sizing.check_max_model_len(num_blocks, block_size, block_bytes, max_model_len, max_model_len_given, sized_by)
        scheduler_config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            preemption_mode=preemption_mode,
        )
        self.device = device
        self.model_config = model_config
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        use_graphs = device.type == "cuda" and not enforce_eager
        runner = ModelRunner(self.model, cache_config, Sampler(seed), cuda_graph_max_seqs=max_num_seqs if use_graphs else 0, max_model_len=max_model_len)
        self.engine = LLMEngine(cache_config, scheduler_config, runner, self.eos_token_ids)
        self._seed = seed

    # ----- inputs ----------------------------------------------------------------------------------
    def _tokenize(self, prompts: PromptsType) -> tuple[list[Optional[str]], list[list[int]]]:
        return inputs.tokenize_prompts(self.tokenizer, prompts, self.model_config.vocab_size)

    def _fill_empty(self, ids: list[list[int]]) -> list[list[int]]:
        return inputs.fill_empty(self.tokenizer, ids)

    def _check_params(self, ids: list[list[int]], sampling_params) -> list[SamplingParams]:
        cfg = self.scheduler_config
        return inputs.check_sampling_params(ids, sampling_params, self.model_config.vocab_size, cfg.max_model_len, cfg.max_num_seqs)

    # ----- generation ------------------------------------------------------------------------------
    def generate(self, prompts: PromptsType, sampling_params: Union[SamplingParams, Seq[SamplingParams], None] = None, *, use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate completions for every prompt; results in the order of ``prompts``.

        Args:
            prompts: a str, a list of str, or a list of token-id lists (not mixed).
            sampling_params: one SamplingParams for all prompts, or one per prompt (default: vLLM's
                defaults, i.e. temperature 1.0 and max_tokens 16).
            use_tqdm: show a progress bar of finished sequences (n per prompt) with output tokens/s.

        Returns:
            one RequestOutput per prompt, holding its ``n`` completions ordered by index. An empty
            list gives [].

        Raises:
            TypeError / ValueError: bad prompts or parameters (naming the index and the allowed
                range), raised before any work starts; the LLM stays usable.
        """
        texts, ids = self._tokenize(prompts)
        params = self._check_params(ids, sampling_params)
        return self._generate(texts, ids, params, use_tqdm)

    def chat(
        self,
        messages: Union[Seq[ChatMessage], Seq[Seq[ChatMessage]]],
        sampling_params: Union[SamplingParams, Seq[SamplingParams], None] = None,
        *,
        chat_template: Optional[str] = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        use_tqdm: bool = True,
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

        Returns:
            one RequestOutput per conversation; ``prompt`` is the rendered text. The rendered text
            is tokenized without adding special tokens (the template writes BOS if it wants one).

        Raises:
            ValueError: no chat template (the tokenizer has none and none was given), a message
                without a str role and content, or both add_generation_prompt and
                continue_final_message.
            TypeError: messages of the wrong shape.
        """
        if isinstance(messages, (list, tuple)) and messages and all(isinstance(m, dict) for m in messages):
            conversations = [messages]
        elif isinstance(messages, (list, tuple)) and all(isinstance(c, (list, tuple)) for c in messages):
            conversations = list(messages)
        else:
            raise TypeError("messages must be a conversation (a list of {'role', 'content'} dicts) or a list of conversations")
        if chat_template is not None and (not isinstance(chat_template, str) or not chat_template.strip()):
            raise ValueError(f"chat_template must be a non-empty Jinja template string, got {chat_template!r}")
        for i, conv in enumerate(conversations):
            if not conv:
                raise ValueError(f"conversation {i} is empty: it needs at least one message")
            for j, m in enumerate(conv):
                if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                    raise ValueError(f"conversation {i}, message {j} must be a dict with str 'role' and 'content', got {m!r}")
        if add_generation_prompt and continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be True")
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                "the tokenizer has no chat template: pass chat_template=... (a Jinja template string) to LLM.chat, "
                "or use LLM.generate with plain prompts"
            )
        if not conversations:
            return []
        import jinja2

        texts = []
        for i, conv in enumerate(conversations):
            try:
                texts.append(
                    self.tokenizer.apply_chat_template(
                        list(conv),
                        chat_template=chat_template,
                        add_generation_prompt=add_generation_prompt,
                        continue_final_message=continue_final_message,
                        tokenize=False,
                    )
                )
            except jinja2.TemplateError as exc:
                raise ValueError(f"the chat template failed on conversation {i}: {exc}") from exc
        ids = self._fill_empty([list(x) for x in self.tokenizer(texts, add_special_tokens=False)["input_ids"]])
        params = self._check_params(ids, sampling_params)
        return self._generate(texts, ids, params, use_tqdm)

    def _generate(self, texts: list[Optional[str]], ids: list[list[int]], params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        """Queue n sequences per prompt, run them all, gather them per prompt."""
        if not ids:
            return []
        _check_use_tqdm(use_tqdm)
        seqs: list[Sequence] = []
        try:
            for i, (p, sp) in enumerate(zip(ids, params)):
                seq = self.engine.add_sequence(i, p, sp, make_generator(sp.seed, 0), index=0, detokenizer=self._stream(sp, p))
                # completions 1..n-1 fork from completion 0 once the prompt is computed, sharing its blocks
                seq.pending_forks = [(j, make_generator(sp.seed, j), self._stream(sp, p)) for j in range(1, sp.n)]
                seqs.append(seq)
        except BaseException:
            self.engine.scheduler.abort_all()  # nothing half-queued survives into the next call
            raise
        self._run([sp.n for sp in params], use_tqdm)
        return [self._request_output(i, texts[i], [seq] + seq.forked) for i, seq in enumerate(seqs)]

    def beam_search(self, prompts: PromptsType, params: BeamSearchParams, *, use_tqdm: bool = True) -> list[BeamSearchOutput]:
        """Beam search for each prompt; beams of one prompt share their common history's KV blocks.

        Each step, every running beam's next-token log-probabilities are computed in the shared
        batch; the top ``2 * beam_width`` continuations are ranked, the best ``beam_width`` that did
        not end run on (forking their parent's block table, copy-on-write), and the ones ending in
        EOS or at ``max_tokens`` enter the finished pool scored ``cum_logprob / length **
        length_penalty``. Selection and stopping follow transformers' ``generate(num_beams=...)``
        (see ``pagedgen.engine.beam_group``), so results match it.

        Args:
            prompts: a str, a list of str, or a list of token-id lists.
            params: a BeamSearchParams (beam_width, max_tokens, ignore_eos, length_penalty,
                early_stopping).
            use_tqdm: show a progress bar of finished prompts.

        Returns:
            one BeamSearchOutput per prompt, in input order, its sequences best first.

        Raises:
            TypeError / ValueError: bad prompts or params (before any work starts).
        """
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        if params.beam_width > self.scheduler_config.max_num_seqs:
            raise ValueError(
                f"BeamSearchParams.beam_width must be at most max_num_seqs={self.scheduler_config.max_num_seqs}, got {params.beam_width}"
            )
        texts, ids = self._tokenize(prompts)  # empty prompts already start from BOS
        self._check_params(ids, SamplingParams(temperature=0))
        _check_use_tqdm(use_tqdm)
        groups = []
        for i, p in enumerate(ids):
            group = BeamGroup(params, len(p), self.eos_token_ids, self.scheduler_config.max_model_len)
            self.engine.add_beam_search(i, p, group)
            groups.append(group)
        self._run([1] * len(groups), use_tqdm, desc="Beam search", done=lambda: sum(g.done for g in groups))
        results = []
        for p, group in zip(ids, groups):
            sequences = [
                BeamSearchSequence(
                    tokens=p + h.token_ids,
                    output_token_ids=h.token_ids,
                    text=self.detokenizer.decode_in_context(h.token_ids, p),
                    cum_logprob=h.cum_logprob,
                    score=h.score,
                    finish_reason=h.finish_reason,
                )
                for h in group.finished
            ]
            results.append(BeamSearchOutput(sequences))
        return results

    def _stream(self, sp: SamplingParams, prompt_token_ids: list[int]):
        """An incremental detokenizer for a completion that has stop strings (else None)."""
        return self.detokenizer.stream(sp, prompt_token_ids) if sp.stop else None

    def _run(self, completions_per_request: list[int], use_tqdm: bool, desc: str = "Processed prompts", done: Optional[Callable[[], int]] = None) -> None:
        """Run the engine until done. The bar counts finished requests (a request is finished when
        all its completions are; ``done()``, when given, says how many are instead)."""
        if not use_tqdm:
            self.engine.run()
            return
        from tqdm.auto import tqdm

        bar = tqdm(total=len(completions_per_request), desc=desc, dynamic_ncols=True)
        remaining = list(completions_per_request)
        start, generated = time.perf_counter(), 0

        def on_step(finished: list[Sequence], num_tokens: int) -> None:
            nonlocal generated
            generated += num_tokens
            count = bar.n
            for seq in finished:
                remaining[seq.request_index] -= 1
                count += remaining[seq.request_index] == 0
            if done is not None:
                count = done()
            if count != bar.n:
                bar.update(count - bar.n)
                bar.set_postfix_str(f"output {generated / max(time.perf_counter() - start, 1e-9):.0f} tok/s", refresh=False)

        try:
            self.engine.run(on_step)
        finally:
            bar.close()

    def _request_output(self, index: int, text: Optional[str], seqs: list[Sequence]) -> RequestOutput:
        first = seqs[0]
        return RequestOutput(
            request_id=str(index),
            prompt=text,
            prompt_token_ids=first.prompt_token_ids,
            prompt_logprobs=self._decoded(first.prompt_logprobs, first.sampling_params),
            outputs=[self._completion(seq) for seq in seqs],
            finished=True,
            num_cached_tokens=first.num_cached_tokens or 0,
        )

    def _completion(self, seq: Sequence) -> CompletionOutput:
        sp = seq.sampling_params
        if not sp.detokenize:
            text = ""
        elif seq.detokenizer is not None:
            text = seq.detokenizer.text
        else:
            text = self.detokenizer.completion_text(seq.output_token_ids, sp, stopped_on_token=seq.finish_reason == "stop", prompt_token_ids=seq.prompt_token_ids)
        return CompletionOutput(
            index=seq.index,
            text=text,
            token_ids=seq.output_token_ids,
            cumulative_logprob=seq.cumulative_logprob,
            logprobs=self._decoded(seq.logprobs, sp),
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )

    def _decoded(self, logprobs: Optional[list], sp: SamplingParams) -> Optional[list]:
        """Fill ``Logprob.decoded_token`` (with ``detokenize``)."""
        if logprobs is not None and sp.detokenize:
            for entry in logprobs:
                for token_id, lp in (entry or {}).items():
                    lp.decoded_token = self.detokenizer.token_text(token_id)
        return logprobs

    def get_stats(self) -> EngineStats:
        """KV cache and scheduling counters since this LLM was made (see ``EngineStats``)."""
        return self.engine.stats()
