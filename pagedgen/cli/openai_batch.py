"""The OpenAI batch file format, as vLLM's ``run_batch`` reads and writes it.

Input, one request per line (https://platform.openai.com/docs/api-reference/batch/request-input)::

    {"custom_id": "r1", "method": "POST", "url": "/v1/completions", "body": {"model": "m", "prompt": "Hi", "max_tokens": 8}}
    {"custom_id": "r2", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "Hi"}]}}

Output, one line per request (the batch output format; ids are deterministic so that a resumed run
writes the same bytes as an uninterrupted one)::

    {"id": "batch_req_0", "custom_id": "r1", "response": {"status_code": 200, "request_id": "pagedgen-batch-0",
     "body": {"id": "cmpl-0", "object": "text_completion", "created": ..., "model": "m", "choices": [...], "usage": {...}}},
     "error": null}

Body fields: OpenAI's (``max_tokens``, ``max_completion_tokens``, ``temperature``, ``top_p``, ``n``,
``stop``, ``seed``, ``presence_penalty``, ``frequency_penalty``, ``logit_bias``, ``logprobs``,
``top_logprobs``) and vLLM's extra sampling fields (``top_k``, ``min_p``, ``repetition_penalty``,
``ignore_eos``, ``min_tokens``, ``stop_token_ids``, ``skip_special_tokens``,
``spaces_between_special_tokens``, ``include_stop_str_in_output``, ``allowed_token_ids``, ``truncate_prompt_tokens``,
``add_generation_prompt``, ``continue_final_message``), and ``response_format`` (``text``,
``json_object``, or ``json_schema`` with its ``schema``: structured outputs). A field the body leaves out takes the
command line's value. Anything else (streaming, tools, echo, suffix...) makes the request a bad row.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from pagedgen.cli import structured
from pagedgen.cli.errors import BadRow

URLS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
_SAMPLING = ("n", "temperature", "top_p", "stop", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
             "repetition_penalty", "ignore_eos", "min_tokens", "stop_token_ids", "skip_special_tokens",
             "spaces_between_special_tokens", "include_stop_str_in_output", "allowed_token_ids")
_COMMON = set(_SAMPLING) | {"model", "max_tokens", "logit_bias", "user", "metadata", "stream", "best_of", "truncate_prompt_tokens",
                            "response_format"}
_FIELDS = {
    "completions": _COMMON | {"prompt", "logprobs", "echo", "suffix"},
    "chat": _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "add_generation_prompt",
                       "continue_final_message"},
}
_MUST_BE_OFF = {"stream": (None, False), "echo": (None, False), "suffix": (None, "")}


@dataclass
class OpenAIRequest:
    """One parsed batch request: its endpoint ``kind`` ("completions" or "chat"), prompt or
    messages, and the SamplingParams fields its body sets."""

    custom_id: str
    kind: str
    model: Optional[str]
    prompt: object = None
    messages: object = None
    overrides: dict = field(default_factory=dict)
    truncate_prompt_tokens: Optional[int] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


def duplicate_id_error(custom_id: str, line: int, first_line: int) -> str:
    """Why a request whose custom_id an earlier one (at ``first_line``) has cannot run."""
    return (f"custom_id {custom_id!r} repeats the one of line {first_line} (line {line}); OpenAI's batch API rejects "
            "an input file with a repeated custom_id: give every request its own")


def check_unique_ids(rows) -> None:
    """BadRow-worded CLIError for the first request of ``rows`` (readers.Row) whose custom_id an
    earlier one has, naming both lines; read before any work (a file is read twice)."""
    from pagedgen.cli.errors import CLIError

    first: dict[str, int] = {}
    for row in rows:
        custom_id = row.fields.get("custom_id") if isinstance(row.fields, dict) else None
        if not isinstance(custom_id, str):
            continue  # a bad row of its own, reported when the run reaches it
        if custom_id in first:
            raise CLIError(f"line {row.line}: {duplicate_id_error(custom_id, row.line, first[custom_id])}")
        first[custom_id] = row.line


def parse_request(line: dict) -> OpenAIRequest:
    """Check one batch input line and map its body to SamplingParams fields. Raises BadRow."""
    missing = [k for k in ("custom_id", "method", "url", "body") if k not in line]
    if missing:
        raise BadRow(f"an OpenAI batch request needs {', '.join(missing)} (it has: {', '.join(line)})")
    if not isinstance(line["custom_id"], str):
        raise BadRow("custom_id must be a string")
    if line["method"] != "POST":
        raise BadRow(f"method must be 'POST', got {line['method']!r}")
    kind = URLS.get(line["url"])
    if kind is None:
        raise BadRow(f"url {line['url']!r} is not supported; supported: {', '.join(URLS)}")
    body = line["body"]
    if not isinstance(body, dict):
        raise BadRow(f"body must be an object, got {type(body).__name__}")
    unknown = sorted(set(body) - _FIELDS[kind])
    if unknown:
        raise BadRow(f"body field(s) {', '.join(unknown)} not supported for {line['url']}; supported: {', '.join(sorted(_FIELDS[kind]))}")
    for name, allowed in _MUST_BE_OFF.items():
        if body.get(name) not in allowed:
            raise BadRow(f"body.{name}={body[name]!r} is not supported in a batch")
    req = OpenAIRequest(custom_id=line["custom_id"], kind=kind, model=body.get("model"))
    over = {k: body[k] for k in _SAMPLING if body.get(k) is not None}
    if body.get("response_format") is not None:  # structured outputs: json_schema or json_object (cli/structured.py)
        over["structured_outputs"] = structured.response_format(body["response_format"])
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens")) if kind == "chat" else body.get("max_tokens")
    if max_tokens is not None:
        over["max_tokens"] = max_tokens
    best_of = body.get("best_of")
    if best_of is not None and best_of != over.get("n", best_of):
        raise BadRow(f"body.best_of={best_of} other than n is not supported")
    if body.get("logit_bias") is not None:
        bias = body["logit_bias"]
        try:
            over["logit_bias"] = {int(k): v for k, v in bias.items()}
        except (AttributeError, ValueError):
            raise BadRow("body.logit_bias must map token ids (as strings) to numbers") from None
    if kind == "completions":
        if "prompt" not in body:
            raise BadRow("body.prompt is missing")
        prompt = body["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one prompt
        req.prompt = prompt
        if body.get("logprobs") is not None:
            over["logprobs"] = body["logprobs"]
    else:
        if "messages" not in body:
            raise BadRow("body.messages is missing")
        req.messages = body["messages"]
        if body.get("logprobs"):
            over["logprobs"] = body.get("top_logprobs") or 0
        elif body.get("top_logprobs") is not None:
            raise BadRow("body.top_logprobs needs logprobs: true")
        for name in ("add_generation_prompt", "continue_final_message"):
            if body.get(name) is not None:
                if not isinstance(body[name], bool):
                    raise BadRow(f"body.{name} must be true or false")
                setattr(req, name, body[name])
        if req.continue_final_message and "add_generation_prompt" not in body:
            req.add_generation_prompt = False
    truncate = body.get("truncate_prompt_tokens")
    if truncate is not None and (not isinstance(truncate, int) or isinstance(truncate, bool) or (truncate < 1 and truncate != -1)):
        raise BadRow(f"body.truncate_prompt_tokens must be a positive int or -1, got {truncate!r}")
    req.truncate_prompt_tokens = truncate
    req.overrides = over
    return req


def response_record(index: int, req: OpenAIRequest, out, logprobs: Optional[int], created: int, default_model: str) -> dict:
    """The batch output line (as a dict) of a finished request: ``out`` is its RequestOutput,
    ``logprobs`` its SamplingParams.logprobs."""
    chat = req.kind == "chat"
    choices = []
    for c in out.outputs:
        choice = {"index": c.index}
        if chat:
            choice["message"] = {"role": "assistant", "content": c.text}
            choice["logprobs"] = _chat_logprobs(c, logprobs or 0) if c.logprobs is not None else None
        else:
            choice["text"] = c.text
            choice["logprobs"] = _completion_logprobs(c) if c.logprobs is not None else None
        choice["finish_reason"] = c.finish_reason
        choice["stop_reason"] = c.stop_reason
        choices.append(choice)
    prompt_tokens = len(out.prompt_token_ids)
    completion_tokens = sum(len(c.token_ids) for c in out.outputs)
    body = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{index}",
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": req.model or default_model,
        "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens},
    }
    return {"id": f"batch_req_{index}", "custom_id": req.custom_id,
            "response": {"status_code": 200, "request_id": f"pagedgen-batch-{index}", "body": body}, "error": None}


def error_record(index: int, line: int, fields: Optional[dict], reason: str) -> dict:
    """The errors-file line of a request that could not run (an HTTP 400 in the batch output format)."""
    custom_id = fields.get("custom_id") if isinstance(fields, dict) and isinstance(fields.get("custom_id"), str) else None
    error = {"message": f"line {line}: {reason}", "type": "invalid_request_error", "param": None, "code": None}
    return {"id": f"batch_req_{index}", "custom_id": custom_id,
            "response": {"status_code": 400, "request_id": f"pagedgen-batch-{index}", "body": {"error": error}}, "error": None}


def _token_text(lp) -> str:
    return lp.decoded_token if lp.decoded_token is not None else ""


def _top(entry: dict, k: int) -> list:
    """The entry's k most likely tokens, best first (the sampled one may rank lower and is left out)."""
    return sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= k), key=lambda x: x[1].rank)


def _chat_logprobs(c, k: int) -> dict:
    """Chat completions' ``logprobs.content``: per token its text, logprob, UTF-8 bytes and its
    ``k`` most likely alternatives (``top_logprobs``)."""
    content = []
    for token_id, entry in zip(c.token_ids, c.logprobs):
        lp = entry[token_id]
        content.append({
            "token": _token_text(lp), "logprob": lp.logprob, "bytes": list(_token_text(lp).encode("utf-8")),
            "top_logprobs": [{"token": _token_text(t), "logprob": t.logprob, "bytes": list(_token_text(t).encode("utf-8"))}
                             for _, t in _top(entry, k)],
        })
    return {"content": content}


def _completion_logprobs(c) -> dict:
    """Legacy completions' ``logprobs``: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, token_logprobs, top, offsets, offset = [], [], [], [], 0
    for token_id, entry in zip(c.token_ids, c.logprobs):
        lp = entry[token_id]
        text = _token_text(lp)
        tokens.append(text)
        token_logprobs.append(lp.logprob)
        top.append({_token_text(t): t.logprob for t in entry.values()})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}
