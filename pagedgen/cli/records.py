"""Output lines: the input row's own fields, plus its index and completions (or an error).

Output line (JSONL; the index comes first, so that a resume reads it without parsing the row)::

    {"index": 0, <the row's fields>, "completions": [{"text", "token_ids", "finish_reason", "stop_reason"}]}

With ``--logprobs K`` each completion also has ``cumulative_logprob`` and ``logprobs`` (per token
``{"<token id>": {"logprob", "rank", "decoded_token"}}``); with ``--prompt-logprobs K`` the row has
``prompt_logprobs`` (the first entry null). A non-finite number (a logprob of -inf) is written as the
string "-Infinity" ("Infinity", "NaN"): every line is strict JSON. Errors-file line::

    {"index": 3, "line": 4, "error": "not valid JSON (...)", "row": <the fields, or the raw line's text>}
"""
from __future__ import annotations

import base64
import datetime
import decimal
import json
import math
from typing import Optional

from pagedgen.cli import openai_batch
from pagedgen.cli.prompts import PromptSpec, Request
from pagedgen.cli.readers import Row

_RAW_CHARS = 1000  # of an unreadable row's text kept in the errors file


def _logprobs_json(entries: Optional[list]) -> Optional[list]:
    if entries is None:
        return None
    return [None if e is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                                    for t, lp in e.items()} for e in entries]


def completions_json(out, with_logprobs: bool) -> list[dict]:
    """The completions of RequestOutput ``out`` as JSON-ready dicts, ordered by index."""
    result = []
    for c in out.outputs:
        d = {"text": c.text, "token_ids": list(c.token_ids), "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if with_logprobs:
            d["cumulative_logprob"] = c.cumulative_logprob
            d["logprobs"] = _logprobs_json(c.logprobs)
        result.append(d)
    return result


def output_line(row: Row, request: Request, out, spec: PromptSpec, created: int, model_name: str) -> bytes:
    """The output line of a finished row."""
    if hasattr(out.outputs, "score"):  # --task score: one float
        return _dumps({spec.index_field: row.index, **row.fields, spec.output_field: out.outputs.score})
    if hasattr(out.outputs, "data"):  # a pooling model's (--task): the vector, the probabilities or the per-token rewards
        return _dumps({spec.index_field: row.index, **row.fields, spec.output_field: _pooled_json(out)})
    if request.openai is not None:
        record = openai_batch.response_record(row.index, request.openai, out, request.params.logprobs, created, model_name)
    else:
        record = {spec.index_field: row.index, **row.fields,
                  spec.output_field: completions_json(out, request.params.logprobs is not None)}
        if request.params.prompt_logprobs is not None:
            record["prompt_logprobs"] = _logprobs_json(out.prompt_logprobs)
    return _dumps(record)


def _pooled_json(out):
    """A pooled result as JSON: a list of float (an embedding, per-token rows as lists), or for a
    classification {"probs": [...], "label": name} (the label from config.json id2label)."""
    label = getattr(out, "label", None)
    data = out.outputs.data.tolist()
    return data if label is None else {"probs": data, "label": label}


def error_line(row: Row, reason: str, spec: PromptSpec) -> bytes:
    """The errors-file line of a row that could not run."""
    if spec.mode == "openai":
        return _dumps(openai_batch.error_record(row.index, row.line, row.fields, reason))
    raw = row.fields if row.fields is not None else row.span.decode("utf-8", "replace").strip()[:_RAW_CHARS]
    return _dumps({spec.index_field: row.index, "line": row.line, "error": reason, "row": raw})


def _dumps(record: dict) -> bytes:
    """One line of strict JSON: a non-finite float (a logprob or cumulative_logprob of -inf, a NaN
    read from an input row) is written as the string "NaN", "Infinity" or "-Infinity" (protobuf's
    JSON mapping of floats), never as the bare NaN / Infinity that JSON parsers reject."""
    try:
        text = json.dumps(record, ensure_ascii=False, default=_json_default, allow_nan=False)
    except ValueError:  # the rare record holding one: converted, then written
        text = json.dumps(_finite(record), ensure_ascii=False, default=_json_default, allow_nan=False)
    return text.encode("utf-8") + b"\n"


def _finite(value):
    """``value`` with each non-finite float (also inside lists, tuples, dicts and numpy values) as a string."""
    if isinstance(value, float):
        return value if math.isfinite(value) else "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if not isinstance(value, (str, int, bool, type(None))) and hasattr(value, "tolist"):  # numpy scalars and arrays
        return _finite(value.tolist())
    return value


def _json_default(value):
    """JSON for the non-JSON values a Parquet row can hold: dates and times in ISO 8601, decimals
    as exact strings, durations in seconds, bytes as text (or base64 when not UTF-8), anything
    else as its str()."""
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, (bytes, bytearray)):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return base64.b64encode(value).decode("ascii")
    if hasattr(value, "tolist"):  # numpy scalars and arrays
        return value.tolist()
    return str(value)
