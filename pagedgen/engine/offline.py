"""``LLM``'s calls on its engine (vLLM's "offline inference"): the one entry of each call into the
engine, and the loops over ``LLMEngine.step`` under them.

    generate / chat / beam_search        processor.process_batch / process_chats / beam_batch
                                         -> run: queue every request, step until all finished,
                                            results in input order
    stream (generate_stream)             the arguments checked at once; then, as the caller pulls,
                                         windows of prompts pulled lazily, processed
                                         (processor.process_stream_items) and queued, stepped,
                                         results yielded as they finish

Each step goes down once and its reply comes back up once: ``LLMEngine.step`` schedules (core),
runs the model through the executor (worker, sample) and returns the ``RequestOutput`` of every
request that finished in it (processor.make_output).

Any error or interrupt (KeyboardInterrupt included, and closing a stream early) aborts every
request of the call before it propagates; the engine repairs its block pool, so the next call runs
as on a fresh engine. The caller (``LLM``) holds its lock around each call (``call_lock.py``).
"""
from __future__ import annotations

import itertools
import numbers
from typing import Iterable, Iterator, Optional

from pagedgen.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagedgen.engine.beam_group import beam_score
from pagedgen.engine.llm_engine import LLMEngine
from pagedgen.engine.processor import Request
from pagedgen.outputs import RequestOutput
from pagedgen.progress import Progress
from pagedgen.sampling_params import SamplingParams


ON_ERROR = (None, "return", "raise")


def check_on_error(on_error) -> None:
    """``on_error`` of a call must be one of ``ON_ERROR`` (ValueError naming them)."""
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be None (vLLM's behaviour), 'return' or 'raise', got {on_error!r}")


def generate(engine: LLMEngine, prompts, sampling_params, use_tqdm: bool, on_error: Optional[str] = None,
             lora_request=None) -> list[RequestOutput]:
    """``LLM.generate``: the prompts checked and tokenized, run to the end; one RequestOutput per
    prompt, in input order."""
    check_generates(engine, "generate")
    check_on_error(on_error)
    return run(engine, with_loras(engine, engine.processor.process_batch(prompts, sampling_params), lora_request), use_tqdm, on_error=on_error)


def chat(engine: LLMEngine, messages, sampling_params, chat_template: Optional[str], add_generation_prompt: bool,
         continue_final_message: bool, use_tqdm: bool, on_error: Optional[str] = None, lora_request=None) -> list[RequestOutput]:
    """``LLM.chat``: the conversations rendered, tokenized and run to the end, in input order."""
    check_generates(engine, "chat")
    check_on_error(on_error)
    requests = engine.processor.process_chats(messages, sampling_params, chat_template, add_generation_prompt, continue_final_message)
    return run(engine, with_loras(engine, requests, lora_request), use_tqdm, on_error=on_error)


def beam_search(engine: LLMEngine, prompts, params: BeamSearchParams, use_tqdm: bool, lora_request=None) -> list[BeamSearchOutput]:
    """``LLM.beam_search``: one BeamSearchOutput per prompt, in input order, its finished beams best
    first, each scored ``cum_logprob / length ** length_penalty`` (engine/beam_group.py)."""
    check_generates(engine, "beam_search")
    outputs = run(engine, with_loras(engine, engine.processor.beam_batch(prompts, params), lora_request), use_tqdm, desc="Beam search")
    return [
        BeamSearchOutput([
            BeamSearchSequence(
                tokens=out.prompt_token_ids + c.token_ids,
                output_token_ids=c.token_ids,
                text=c.text,
                cum_logprob=c.cumulative_logprob,
                score=beam_score(c.cumulative_logprob, len(c.token_ids), params.length_penalty),
                finish_reason=c.finish_reason,
            )
            for c in out.outputs
        ])
        for out in outputs
    ]


def with_loras(engine: LLMEngine, requests: list[Request], lora_request) -> list[Request]:
    """``requests`` with their adapters: ``lora_request`` one LoRARequest (or None) for all, or one
    per request; ValueError / TypeError naming ``prompts[i]`` and the adapter (pagedgen/lora/peft.py)."""
    for request, lora in zip(requests, engine.processor.loras.check_all(lora_request, len(requests))):
        request.lora_request = lora
    return requests


def run(engine: LLMEngine, requests: list[Request], use_tqdm: bool, desc: str = "Processed prompts",
        on_error: Optional[str] = None) -> list[RequestOutput]:
    """Queue every request, step until all have finished; results in input order (by
    ``Request.index``). Any error or interrupt aborts them all (the engine repairs the block pool)
    before it propagates; with ``on_error="raise"``, so does the first request that fails alone
    (``raise_failed``)."""
    if not requests:
        return []
    check_idle(engine)
    results: list[Optional[RequestOutput]] = [None] * len(requests)
    progress = Progress(use_tqdm, len(requests), desc, engine.num_generated_tokens)
    try:
        for request in requests:
            request.on_error = on_error
            engine.enqueue(request)
        while engine.has_unfinished_requests():
            outputs = engine.step()
            for out in outputs:
                raise_failed(out, on_error)
                results[out.index] = out
            progress.update(len(outputs), engine.num_generated_tokens)
    except BaseException:
        engine.abort_all()
        raise
    finally:
        progress.close()
    return results


def raise_failed(out: RequestOutput, on_error: Optional[str]) -> None:
    """With ``on_error="raise"``, RuntimeError naming the request that failed alone and why."""
    if on_error == "raise" and out.error is not None:
        raise RuntimeError(f"prompts[{out.index}] failed mid-generation: {out.error} (on_error='raise'; "
                           "on_error='return' returns it as finish_reason 'error' while the others complete)")


def stream(engine: LLMEngine, prompts: Iterable, sampling_params: Optional[SamplingParams], max_in_flight: Optional[int],
           use_tqdm: bool, on_error: Optional[str] = None, lora_request=None) -> Iterator[RequestOutput]:
    """``LLM.generate_stream``: the arguments checked now (TypeError / ValueError), the prompts run
    as the returned generator is pulled (see ``LLM.generate_stream`` for its contract)."""
    check_generates(engine, "generate_stream")
    check_on_error(on_error)
    if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
        raise TypeError(f"sampling_params must be a SamplingParams or None, got {type(sampling_params).__name__}")
    default = engine.processor.check_params(sampling_params, "sampling_params")
    if isinstance(lora_request, (list, tuple)):
        raise TypeError("generate_stream lora_request must be one LoRARequest (or None) for every item, not a list")
    lora = engine.processor.loras.check_one(lora_request, "generate_stream")
    if max_in_flight is None:
        max_in_flight = 4 * engine.scheduler_config.max_num_seqs
    elif isinstance(max_in_flight, bool) or not isinstance(max_in_flight, numbers.Integral):
        raise TypeError(f"max_in_flight must be an int, got {type(max_in_flight).__name__}")
    elif max_in_flight < 1:
        raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
    max_in_flight = int(max_in_flight)  # numpy's ints too
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    total = len(prompts) if hasattr(prompts, "__len__") else None
    return _stream(engine, iter(prompts), default, max_in_flight, use_tqdm, total, on_error, lora)


def _stream(engine: LLMEngine, items: Iterator, default: SamplingParams, max_in_flight: int, use_tqdm: bool,
            total: Optional[int], on_error: Optional[str] = None, lora=None) -> Iterator[RequestOutput]:
    """Keep up to ``max_in_flight`` requests queued or running, pulling the next items as requests
    finish; yield each RequestOutput as it finishes. A bad item's error (naming ``prompts[i]``) or
    the source's exception is raised after the items before it have finished and been yielded."""
    check_idle(engine)
    index, error, exhausted = 0, None, False
    progress = Progress(use_tqdm, total, "Processed prompts", engine.num_generated_tokens)
    try:
        while True:
            room = max_in_flight - engine.get_num_unfinished_requests()
            if not exhausted and error is None and room > 0:
                batch, exhausted, source_error = _pull(items, room)  # tokenized together: one tokenizer call
                requests, error = engine.processor.process_stream_items(index, batch, default)
                if error is None:  # a bad item comes before the source's failure
                    error = source_error
                for request in requests:  # those before a bad item; its error is raised at the end
                    request.on_error, request.lora_request = on_error, lora
                    engine.enqueue(request)
                index += len(batch)
            if not engine.has_unfinished_requests():
                break
            outputs = engine.step()
            progress.update(len(outputs), engine.num_generated_tokens)
            for out in outputs:
                raise_failed(out, on_error)
                yield out
        if error is not None:
            raise error
    except BaseException:  # an error, an interrupt, or close() at a yield: abort what is in flight
        engine.abort_all()
        raise
    finally:
        progress.close()


def _pull(items: Iterator, n: int) -> tuple[list, bool, Optional[Exception]]:
    """Up to ``n`` items of ``items``: (the items, whether the source ended, the exception it raised
    or None). A source that raises keeps the items it gave before: they run and are yielded, then
    its exception is raised (an interrupt, KeyboardInterrupt, is not caught: it aborts the stream)."""
    batch: list = []
    try:
        for item in itertools.islice(items, n):
            batch.append(item)
    except Exception as exc:  # noqa: BLE001 - re-raised by _stream once the admitted items are yielded
        return batch, True, exc
    return batch, len(batch) < n, None


def check_generates(engine: LLMEngine, call: str) -> None:
    """ValueError when the engine runs a pooling model (it has no language-model head to sample)."""
    if engine.pooling is not None:
        raise ValueError(f"LLM.{call}: this LLM runs a pooling model ({engine.pooling.architecture}, convert="
                         f"{engine.pooling.convert!r}); use embed / classify / score / reward / encode, or load it with runner='generate'")


def check_idle(engine: LLMEngine) -> None:
    """RuntimeError before any work when the executor refuses calls (shut down, a worker died) or
    the engine holds requests added with ``llm_engine.add_request`` that are not finished."""
    engine.executor.check_usable()
    n = engine.get_num_unfinished_requests()
    if n:
        raise RuntimeError(
            f"the engine holds {n} unfinished requests added with llm_engine.add_request: finish them "
            "(llm_engine.step()) or abort them (llm_engine.abort_request) before calling generate"
        )
