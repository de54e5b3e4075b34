"""Requests in and out of the engine: a request's prompt and parameters checked and tokenized
(``RequestProcessor.process`` for ``add_request``, ``process_batch`` for a ``generate`` call,
``process_chats`` for ``chat``, ``beam_batch`` for ``beam_search``, ``process_stream_items`` for a
window of ``generate_stream``), its state while it runs (``Request``, with the incremental
detokenizers of its completions), and its ``RequestOutput`` once it has finished
(``make_output``). Tensor-free (the tokenizer runs here, the model does not).

Every check runs before the request touches the engine and raises TypeError / ValueError naming
the request (``request 'abc'`` for ``add_request``, ``prompts[3]`` for a ``generate`` call) and
the field, so a bad request leaves the engine exactly as it was.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from pagedgen import inputs
from pagedgen.beam_search import BeamSearchParams
from pagedgen.core.sequence import Sequence
from pagedgen.engine.beam_group import BeamGroup
from pagedgen.engine.detokenizer import Detokenizer
from pagedgen.lora.peft import LoRAChecker
from pagedgen.outputs import CompletionOutput, RequestOutput
from pagedgen.pooling_outputs import PoolingOutput, PoolingRequestOutput
from pagedgen.sampling_params import SamplingParams

Params = Union[SamplingParams, BeamSearchParams]


@dataclass(eq=False)
class Request:
    """One request while the engine runs it.

    Attributes:
        request_id: unique among the engine's unfinished requests.
        prompt: the prompt text (None when token ids were given); ``prompt_token_ids`` as fed to
            the model (an empty prompt starts from BOS).
        params: a validated private copy of its SamplingParams, or its BeamSearchParams.
        index: its position in a ``generate`` / ``generate_stream`` input (None otherwise).
        seqs: its completions so far, completion 0 first (the others fork from it when its prompt
            is computed); for beam search, the first beam.
        num_finished: completions finished. ``beam_group``: the search of a beam-search request.
        detokenizers: one incremental detokenizer per completion when the request has stop
            strings (completion j's is ``detokenizers[j]``), else Nones; [] for beam search.
        on_error: None (vLLM's behaviour: a completion its grammar ends mid-generation finishes
            "stop", with a warning), or "return" / "raise": it finishes "error", its reason in
            ``errors`` (completion index -> why) and the output's ``error`` (``on_error`` of ``LLM.generate``).
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: Params
    index: Optional[int] = None
    seqs: list[Sequence] = field(default_factory=list)
    num_finished: int = 0
    beam_group: Optional[BeamGroup] = None
    detokenizers: list = field(default_factory=list)
    on_error: Optional[str] = None
    errors: dict = field(default_factory=dict)
    pooling: Optional[object] = None  # a pooling request's PoolingSpec (engine/pooling.py); params then SamplingParams(max_tokens=1)
    lora_request: Optional[object] = None  # its LoRARequest (pagedgen/lora/request.py), None for the base model

    @property
    def is_finished(self) -> bool:
        if self.beam_group is not None:
            return self.beam_group.done
        return self.num_finished == self.params.n

    def live_seqs(self) -> list[Sequence]:
        """The sequences that still hold (or wait for) KV blocks."""
        seqs = self.beam_group.beams if self.beam_group is not None else self.seqs
        return [s for s in seqs if not s.is_finished]


class RequestProcessor:
    """Checks and tokenizes requests for one engine, and builds their outputs.

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        vocab_size: the model's vocabulary size (token ids must lie in [0, vocab_size)).
        max_model_len: most tokens of prompt + output; a prompt must leave room for one token.
        max_num_seqs: most sequences in a step (``n`` and ``beam_width`` cannot exceed it).
        grammars: compiles structured-output constraints (``structured_output/grammar.py``); None refuses them.
    """

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, max_num_seqs: int, grammars=None) -> None:
        self.tokenizer = tokenizer
        self.detokenizer = Detokenizer(tokenizer)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.grammars = grammars
        self.loras = LoRAChecker(None, None)  # the lora_request checks (pagedgen/lora/peft.py); engine/build.py sets LoRA's when on
        self._last_checked: Optional[tuple[SamplingParams, SamplingParams]] = None  # (caller's object, checked copy)

    # ----- in ------------------------------------------------------------------------------------
    def process(self, request_id: str, prompt, params: Optional[Params]) -> Request:
        """One request of ``add_request``: ``prompt`` as ``inputs.parse_prompt`` takes it; ``params``
        a SamplingParams (None: vLLM's defaults) or a BeamSearchParams. Errors name the request
        (``request 'request_id' prompt ...``) and the field."""
        name = f"request {request_id!r} prompt"
        text, ids = inputs.tokenize_prompt(self.tokenizer, prompt, self.vocab_size, name)
        inputs.check_prompt_length(ids, self.max_model_len, name)
        return self._request(request_id, text, ids, self.check_params(params, f"request {request_id!r} sampling_params"))

    def process_batch(self, prompts, sampling_params) -> list[Request]:
        """The requests of a ``generate`` call: ``prompts`` as ``inputs.tokenize_prompts`` takes them
        (texts tokenized in one call), ``sampling_params`` one SamplingParams (or None) for all, or
        one per prompt. Request ids are the indices."""
        texts, ids = inputs.tokenize_prompts(self.tokenizer, prompts, self.vocab_size)
        return self._batch(texts, ids, sampling_params)

    def process_chats(self, messages, sampling_params, chat_template: Optional[str], add_generation_prompt: bool,
                      continue_final_message: bool) -> list[Request]:
        """The requests of a ``chat`` call: each conversation rendered with the chat template
        (``inputs.render_chats``), tokenized without special tokens (the template writes BOS if it
        wants one); ``sampling_params`` as in ``process_batch``."""
        texts = inputs.render_chats(self.tokenizer, messages, chat_template, add_generation_prompt, continue_final_message)
        ids = inputs.fill_empty(self.tokenizer, [list(x) for x in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]) if texts else []
        return self._batch(texts, ids, sampling_params)

    def _batch(self, texts: list[Optional[str]], ids: list[list[int]], sampling_params) -> list[Request]:
        params = inputs.check_sampling_params(ids, sampling_params, self.vocab_size, self.max_model_len, self.max_num_seqs)
        for i, sp in enumerate(params):  # each distinct constraint compiled (and checked) once
            self.check_structured_outputs(sp, f"sampling_params[{i}]" if isinstance(sampling_params, (list, tuple)) else "sampling_params")
        return [self._request(str(i), t, p, sp, i) for i, (t, p, sp) in enumerate(zip(texts, ids, params))]

    def process_stream_items(self, first_index: int, items: list, default: SamplingParams) -> tuple[list[Request], Optional[Exception]]:
        """The requests of ``generate_stream`` items ``first_index ..``: each a prompt or a (prompt,
        SamplingParams) tuple; ``default`` (already checked) for the others. Texts are tokenized in
        one call. Stops at the first bad item: returns the requests before it and its error
        (TypeError / ValueError naming ``prompts[i]``), or None."""
        parsed, error = [], None
        for index, item in enumerate(items, start=first_index):
            try:
                if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], SamplingParams):
                    item, params = item[0], self.check_params(item[1], f"sampling_params of prompts[{index}]")
                elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], (str, dict)):
                    raise TypeError(
                        f"prompts[{index}] is a (prompt, sampling_params) tuple whose second element must be a "
                        f"SamplingParams, got {type(item[1]).__name__}"
                    )
                else:
                    params = default
                text, ids = inputs.parse_prompt(item, f"prompts[{index}]")
                if ids is not None:
                    inputs.check_token_ids(ids, self.vocab_size, f"prompts[{index}]")
            except (TypeError, ValueError) as exc:
                error = exc
                break
            parsed.append((index, text, ids, params))
        texts = [text for _, text, ids, _ in parsed if ids is None]
        encoded = iter(self.tokenizer(texts, add_special_tokens=True)["input_ids"] if texts else ())
        requests = []
        for index, text, ids, params in parsed:
            name = f"prompts[{index}]"
            try:
                if ids is None:
                    ids = list(next(encoded))
                    inputs.check_token_ids(ids, self.vocab_size, f"{name} (as tokenized)")  # a tokenizer may hold ids past the model's vocabulary
                ids = inputs.fill_empty(self.tokenizer, [ids], [name])[0]
                inputs.check_prompt_length(ids, self.max_model_len, name)
            except ValueError as exc:
                return requests, exc
            requests.append(self._request(str(index), text, ids, params, index))
        return requests, error

    def beam_batch(self, prompts, params: BeamSearchParams) -> list[Request]:
        """The requests of a ``beam_search`` call: ``prompts`` as in ``process_batch``; ids are the indices."""
        texts, ids = inputs.tokenize_prompts(self.tokenizer, prompts, self.vocab_size)
        params = self.check_params(params, "params")
        for i, p in enumerate(ids):
            inputs.check_prompt_length(p, self.max_model_len, f"prompts[{i}]")
        return [self._request(str(i), t, p, params, i) for i, (t, p) in enumerate(zip(texts, ids))]

    def check_params(self, params: Optional[Params], where: str) -> Params:
        """A checked SamplingParams copy (``inputs.checked_params``), or a BeamSearchParams whose
        width fits max_num_seqs. Raises TypeError / ValueError starting with ``where``."""
        if params is None:
            params = SamplingParams()
        if isinstance(params, BeamSearchParams):
            if params.beam_width > self.max_num_seqs:
                raise ValueError(f"{where} (a BeamSearchParams).beam_width must be at most max_num_seqs={self.max_num_seqs}, "
                                 f"got {params.beam_width}")
            return params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"{where} must be a SamplingParams or a BeamSearchParams, got {type(params).__name__}")
        # many requests with one SamplingParams (a data set through add_request): the checked copy
        # of the last one is reused while the caller's object still equals it (the engine never
        # changes a checked copy; a generate call shares one per SamplingParams the same way)
        last = self._last_checked
        if last is not None and last[0] is params and params == last[1]:
            return last[1]
        checked = inputs.checked_params(params, where, self.vocab_size, self.max_num_seqs)
        self.check_structured_outputs(checked, where)
        self._last_checked = (params, checked)
        return checked

    def check_structured_outputs(self, params: SamplingParams, where: str) -> None:
        """Compile ``params.structured_outputs`` (once per distinct constraint). Raises ValueError
        ``"{where}.structured_outputs: <the backend's message>"``."""
        spec = params.structured_outputs
        if spec is None:
            return
        if self.grammars is None:
            raise ValueError(f"{where}.structured_outputs: this engine has no grammar compiler")
        self.grammars.check(spec, f"{where}.structured_outputs")

    def _request(self, request_id: str, text: Optional[str], ids: list[int], params: Params, index: Optional[int] = None) -> Request:
        """A checked request, with an incremental detokenizer per completion when it has stop
        strings (else None: a completion's text is decoded once, at the end)."""
        request = Request(request_id, text, ids, params, index)
        if isinstance(params, SamplingParams):
            request.detokenizers = [self.detokenizer.stream(params, ids) if params.stop else None for _ in range(params.n)]
        return request

    # ----- out -----------------------------------------------------------------------------------
    def make_output(self, request: Request) -> RequestOutput:
        """The RequestOutput of a finished request (completions ordered by index; for beam search,
        the finished beams best first, ``cumulative_logprob`` their summed log-probabilities); a
        pooling request's PoolingRequestOutput."""
        first = request.seqs[0]
        if request.pooling is not None:
            return PoolingRequestOutput(request.request_id, PoolingOutput(first.pooled), request.prompt_token_ids,
                                        first.num_cached_tokens or 0, True, request.index)
        if request.beam_group is not None:
            outputs = [
                CompletionOutput(
                    index=rank,
                    text=self.detokenizer.decode_in_context(h.token_ids, request.prompt_token_ids),
                    token_ids=h.token_ids,
                    cumulative_logprob=h.cum_logprob,
                    finish_reason=h.finish_reason,
                )
                for rank, h in enumerate(request.beam_group.finished)
            ]
            prompt_logprobs = None
        else:
            outputs = [self._completion(seq, request.errors) for seq in request.seqs]
            prompt_logprobs = self._decoded(first.prompt_logprobs, request.params)
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=outputs,
            finished=True,
            num_cached_tokens=first.num_cached_tokens or 0,
            index=request.index,
            error=next(iter(request.errors.values()), None),
        )

    def _completion(self, seq: Sequence, errors: dict) -> CompletionOutput:
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
            finish_reason="error" if seq.index in errors else seq.finish_reason,
            stop_reason=None if seq.index in errors else seq.stop_reason,
        )

    def _decoded(self, logprobs: Optional[list], sp: SamplingParams) -> Optional[list]:
        """Fill ``Logprob.decoded_token`` (with ``detokenize``)."""
        if logprobs is not None and sp.detokenize:
            for entry in logprobs:
                for token_id, lp in (entry or {}).items():
                    lp.decoded_token = self.detokenizer.token_text(token_id)
        return logprobs

