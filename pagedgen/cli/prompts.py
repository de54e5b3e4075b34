"""From an input row to an engine request: its prompt and its SamplingParams.

A row's prompt is its ``--prompt-field`` (a string, or a list of token ids), or its
``--messages-field`` (a conversation ``[{"role", "content"}, ...]`` rendered with the chat template,
as ``LLM.chat`` does), or, in the OpenAI batch format, the request body's ``prompt`` / ``messages``
with the body's sampling fields over the command line's. Text is tokenized with special tokens, as
``LLM.generate`` does, and, like ``LLM.generate``, many rows in one tokenizer call
(``RequestBuilder.build_many``: one call per row costs several times as much, 170 vs 32 µs a row of
stories260K's tokenizer on 2 cores; if the tokenizer refuses one text, one call per row, so that
only that row fails); text is cut to its last ``--truncate-prompt-tokens`` tokens
when asked (vLLM's ``SamplingParams.truncate_prompt_tokens``; pagedgen's SamplingParams has no such
field, so the command line cuts before adding the request). A rendered chat is tokenized here
without special tokens (the template writes BOS).
A prompt longer than ``max_model_len`` is a bad row with a reason that suggests the flag.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Union

from pagedgen.cli import openai_batch, scoring, structured
from pagedgen.cli.errors import BadRow
from pagedgen.cli.readers import Row
from pagedgen.sampling_params import SamplingParams


@dataclass(frozen=True)
class PromptSpec:
    """Where a row's prompt is and how it becomes tokens.

    Attributes:
        mode: "prompt" (``prompt_field``), "messages" (``messages_field``) or "openai".
        prompt_field, messages_field: field (column) names.
        index_field, output_field: names the output adds to each row (a row may not have them).
        chat_template: a Jinja template overriding the tokenizer's, or None.
        truncate_prompt_tokens: keep the last N prompt tokens (-1: max_model_len), or None.
        schema_field: a field holding a row's own JSON Schema (``cli/structured.py``), or None;
        compact_json: that schema's JSON without whitespace (``--disable-any-whitespace``).
        close_at_max_tokens: a row's or body's JSON constraint closed near its token limit
            (``--close-at-max-tokens``, default; StructuredOutputsParams' field of that name).
        pair_field: with ``--task score``, the field of each row's second text (the first is
            ``prompt_field``); the Request's prompt is then ``{"pair": {"text_1", "text_2"}}`` (cli/scoring.py).
    """

    mode: str
    prompt_field: str = "prompt"
    messages_field: Optional[str] = None
    index_field: str = "index"
    output_field: str = "completions"
    chat_template: Optional[str] = None
    truncate_prompt_tokens: Optional[int] = None
    schema_field: Optional[str] = None
    compact_json: bool = False
    close_at_max_tokens: bool = True
    pair_field: Optional[str] = None


@dataclass
class Request:
    """One row made ready for ``add_request``: ``prompt`` is ``{"prompt": text}`` (from ``build``,
    to be tokenized) or ``{"prompt_token_ids": [...]}`` (``build_many`` tokenizes the texts)."""

    prompt: dict
    params: SamplingParams
    openai: Optional[openai_batch.OpenAIRequest] = None
    lora: Optional[object] = None  # its LoRARequest (cli/lora.py), None for the base model


MISSING_FIELD = "no field "  # how a row without the prompt's field is reported (main.py words the stop for it)


def missing_field(name: str, flag: str, fields: dict) -> str:
    """Why a row without the field ``name`` cannot run, naming the row's fields and those ``flag``
    (--prompt-field: a string or token ids; --messages-field: a list of messages) could take."""
    if flag == "--messages-field":
        fit = [k for k, v in fields.items() if isinstance(v, list) and v and all(isinstance(m, dict) for m in v)]
    else:
        fit = [k for k, v in fields.items() if isinstance(v, str) or (isinstance(v, list) and v and all(isinstance(t, int) for t in v))]
    hint = f"use {flag}" + (f" {fit[0]}" if len(fit) == 1 else f" with one of {', '.join(map(str, fit))}" if fit else "")
    return f"{MISSING_FIELD}{name!r} (fields: {', '.join(map(str, fields))}); {hint}"


class RequestBuilder:
    """Builds a ``Request`` per row; raises ``BadRow`` (with the reason) for a row that cannot run.

    Args:
        tokenizer: the LLM's Hugging Face tokenizer.
        spec: where prompts are (``PromptSpec``).
        params: the command line's SamplingParams (a row without its own fields shares it).
        max_model_len: the engine's limit on prompt + generated tokens (a prompt may fill it).
    """

    def __init__(self, tokenizer, spec: PromptSpec, params: SamplingParams, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.spec = spec
        self.params = params
        self.max_model_len = max_model_len
        self.rows_with_schema = 0  # rows that had their own --schema-field (a run with none warns)
        self._custom_ids: dict[str, int] = {}  # OpenAI batch: custom_id -> its line (stdin is not read twice)
        self.adapters = None  # cli/lora.py's RowAdapters when --lora is given: a row's adapter

    def build(self, row: Row) -> Request:
        """The row's Request (with its adapter under ``--lora``); BadRow when it cannot run."""
        request = self._build(row)
        if self.adapters is not None:
            request.lora = self.adapters.default if self.spec.mode == "openai" else self.adapters(row.fields)
        return request

    def _build(self, row: Row) -> Request:
        if row.error is not None:
            raise BadRow(row.error)
        fields = row.fields
        spec = self.spec
        if spec.mode == "openai":
            req = openai_batch.parse_request(fields)
            first = self._custom_ids.setdefault(req.custom_id, row.line)
            if first != row.line:
                raise BadRow(openai_batch.duplicate_id_error(req.custom_id, row.line, first))
            params = self._with(structured.body_overrides(req.overrides, spec.compact_json, spec.close_at_max_tokens))
            truncate = self._truncation(req.truncate_prompt_tokens, params)
            if req.kind == "chat":
                ids = self._chat_ids(req.messages, req.add_generation_prompt, req.continue_final_message)
                return Request(self._fit(ids, truncate), params, req)
            return Request(self._prompt(req.prompt, "body.prompt", truncate), params, req)
        for name in (spec.index_field, spec.output_field):
            if name in fields:
                raise BadRow(f"the row has its own field {name!r}, which the output adds; choose another name with "
                             f"{'--index-field' if name == spec.index_field else '--output-field'}")
        if self.params.prompt_logprobs is not None and "prompt_logprobs" in fields:
            raise BadRow("the row has its own field 'prompt_logprobs', which --prompt-logprobs adds to the output")
        truncate = self._truncation(None, self.params)
        params = structured.row_params(self.params, fields, spec.schema_field, spec.compact_json, spec.close_at_max_tokens)
        if spec.schema_field is not None and fields.get(spec.schema_field) is not None:
            self.rows_with_schema += 1
        if spec.pair_field is not None:
            return Request({"pair": scoring.pair_of(fields, spec.prompt_field, spec.pair_field)}, params)
        if spec.mode == "messages":
            if spec.messages_field not in fields:
                raise BadRow(missing_field(spec.messages_field, "--messages-field", fields))
            return Request(self._fit(self._chat_ids(fields[spec.messages_field], True, False), truncate), params)
        if spec.prompt_field not in fields:
            raise BadRow(missing_field(spec.prompt_field, "--prompt-field", fields))
        return Request(self._prompt(fields[spec.prompt_field], spec.prompt_field, truncate), params)

    def build_many(self, rows: list[Row]) -> list[tuple[Row, Union[Request, str]]]:
        """``build`` for each row, in order: (row, its Request) or (row, why it cannot run). The
        text prompts are tokenized together in one tokenizer call, with special tokens (exactly
        the ids the engine would make of the text, as ``LLM.generate`` batches them), an empty one
        starting from BOS."""
        built: list[tuple[Row, Union[Request, str]]] = []
        for row in rows:
            try:
                built.append((row, self.build(row)))
            except BadRow as exc:
                built.append((row, exc.reason))
        texts = [i for i, (_, r) in enumerate(built) if isinstance(r, Request) and "prompt" in r.prompt]
        if texts:
            try:
                encoded = self.tokenizer([built[i][1].prompt["prompt"] for i in texts], add_special_tokens=True)["input_ids"]
            except Exception:  # one row the tokenizer refuses fails the whole call: then one call per row
                encoded = [self._encode_one(built[i][1].prompt["prompt"]) for i in texts]
            for i, ids in zip(texts, encoded):
                row, request = built[i]
                try:
                    if isinstance(ids, str):
                        raise BadRow(ids)
                    request.prompt = {"prompt_token_ids": self._nonempty(list(ids))}
                except BadRow as exc:
                    built[i] = (row, exc.reason)
        return built

    def _encode_one(self, text: str):
        """The token ids of ``text`` (with special tokens), or why the tokenizer refused it."""
        try:
            return self.tokenizer(text, add_special_tokens=True)["input_ids"]
        except Exception as exc:  # the tokenizer's own errors (TypeError, ValueError, Rust exceptions)
            return f"the tokenizer cannot tokenize the prompt ({type(exc).__name__}: {str(exc)[:200]!a})"

    def _with(self, overrides: dict) -> SamplingParams:
        if not overrides:
            return self.params
        try:
            return dataclasses.replace(self.params, **overrides)
        except (ValueError, TypeError) as exc:
            raise BadRow(str(exc)) from None

    def _truncation(self, requested: Optional[int], params: SamplingParams) -> Optional[int]:
        """The prompt truncation that applies: the request's, else the command line's, else the
        SamplingParams' own field if it has one."""
        for fallback in (self.spec.truncate_prompt_tokens, getattr(params, "truncate_prompt_tokens", None)):
            requested = fallback if requested is None else requested
        return requested

    def _prompt(self, prompt, where: str, truncate: Optional[int]) -> dict:
        """The engine prompt of a row's text or token ids. Text not to be cut goes to the engine as
        text (tokenized there once, its length checked there)."""
        if isinstance(prompt, str):
            if truncate is None:
                return {"prompt": prompt}
            ids = self._nonempty(list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"]))
        elif isinstance(prompt, list):
            for j, t in enumerate(prompt):
                if not isinstance(t, int) or isinstance(t, bool):
                    raise BadRow(f"{where}[{j}] must be an int token id, got {type(t).__name__} {t!r:.50}")
            ids = self._nonempty(list(prompt))  # token ids (checked against the vocabulary by the engine)
        else:
            raise BadRow(f"{where} must be a string or a list of token ids, got {type(prompt).__name__}")
        return self._fit(ids, truncate)

    def _chat_ids(self, messages, add_generation_prompt: bool, continue_final_message: bool) -> list[int]:
        conversation = normalize_messages(messages)
        if self.spec.chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise BadRow("the tokenizer has no chat template: pass one with --chat-template FILE")
        import jinja2

        try:
            text = self.tokenizer.apply_chat_template(
                conversation, chat_template=self.spec.chat_template, tokenize=False,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            )
        except (jinja2.TemplateError, ValueError, TypeError) as exc:
            raise BadRow(f"the chat template failed on this conversation: {exc}") from None
        return self._nonempty(list(self.tokenizer(text, add_special_tokens=False)["input_ids"]))

    def _nonempty(self, ids: list[int]) -> list[int]:
        if not ids:  # an empty prompt starts from BOS, as in LLM.generate
            if self.tokenizer.bos_token_id is None:
                raise BadRow("the prompt is empty and the tokenizer has no BOS token to start from")
            ids = [self.tokenizer.bos_token_id]
        return ids

    def _fit(self, ids: list[int], truncate: Optional[int]) -> dict:
        """``{"prompt_token_ids": ids}`` cut to the last ``truncate`` tokens (-1: max_model_len);
        BadRow if still longer than max_model_len."""
        if truncate is not None:
            ids = ids[-(self.max_model_len if truncate == -1 else truncate):]
        if len(ids) > self.max_model_len:
            raise BadRow(f"the prompt has {len(ids)} tokens, more than max_model_len={self.max_model_len}: "
                         f"pass --truncate-prompt-tokens N to keep its last N tokens")
        return {"prompt_token_ids": ids}


def normalize_messages(messages) -> list[dict]:
    """A conversation as a list of {"role": str, "content": str}; OpenAI content parts
    (``[{"type": "text", "text": ...}]``) are joined with newlines. Raises BadRow."""
    if not isinstance(messages, list) or not messages:
        raise BadRow(f"messages must be a non-empty list of {{'role', 'content'}} objects, got {type(messages).__name__}")
    out = []
    for j, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise BadRow(f"message {j}: only text content parts ({{'type': 'text', 'text': ...}}) are supported")
            content = "\n".join(p["text"] for p in content)
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(content, str):
            raise BadRow(f"message {j} must be an object with a str 'role' and 'content', got {m!r:.100}")
        out.append({**m, "content": content})
    return out
