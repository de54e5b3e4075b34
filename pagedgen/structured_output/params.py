"""Structured outputs: the constraint of one request, with vLLM's names (``StructuredOutputsParams``,
set as ``SamplingParams(structured_outputs=...)``; formerly ``guided_decoding``).

Exactly one kind of constraint per request:
    json          a JSON Schema (a dict, its JSON text, or a pydantic model class): the completion
                  is a JSON value that validates against it
    json_object   True: the completion is some JSON object (the schema ``{"type": "object"}``)
    regex         the completion full-matches this regular expression (Rust ``regex`` syntax)
    choice        the completion is one of these strings
    grammar       a context-free grammar: Lark (llguidance's dialect) or GBNF (llama.cpp's)

The constraint is compiled once per distinct value for the model's tokenizer and applied to every
step as a token bitmask (``pagedgen/structured_output/grammar.py``; docs/structured_outputs.md). Only the
fields' types and the one-kind rule are checked here; a schema, regex or grammar the backend
cannot compile is a ValueError when the request is added (naming the request), before any work.
"""
from __future__ import annotations

import json as _json
from dataclasses import dataclass, fields
from typing import Any, Optional, Union

_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_FIELDS = _KINDS + ("disable_any_whitespace", "close_at_max_tokens")


@dataclass
class StructuredOutputsParams:
    """The constraint of one request's completions (vLLM's ``StructuredOutputsParams``).

    Attributes:
        json: a JSON Schema: a dict, its JSON text, or a pydantic ``BaseModel`` subclass (its
            ``model_json_schema()``). Kept as a dict.
        regex: a regular expression the whole completion matches (Rust ``regex`` syntax).
        choice: a non-empty list of strings; the completion is one of them.
        grammar: a Lark grammar (llguidance's dialect, rule ``start``) or a GBNF grammar (rule ``root``).
        json_object: True: any JSON object.
        disable_any_whitespace: JSON without whitespace between tokens (compact); default False,
            as vLLM: the JSON may hold whitespace where the syntax allows it, at most one space
            or tab, or a newline and at most 8 spaces or tabs, at each place (``json_bounds``).
            JSON numbers are bounded either way (int64 / float64 digits; ``json_bounds``).
        close_at_max_tokens: (JSON) default True: a completion whose remaining tokens
            (``max_tokens``, else ``max_model_len``) come near what the shortest closing of its
            JSON needs is steered to close it (``structured_output/closing.py``), so that a
            completion cut by the limit is still valid JSON where the limit leaves room; the
            grammar is unchanged, and a completion that ends well before the limit is not
            touched. False: the model alone decides, and a completion cut by the limit may stop
            inside a string (vLLM's behaviour). No effect on regex, choice and grammar constraints.

    Raises:
        ValueError: no constraint or more than one, an empty choice list, a json str that is
            not JSON (naming the field).
        TypeError: a field of the wrong type.
    """

    json: Optional[Union[str, dict]] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: bool = False
    close_at_max_tokens: bool = True

    def __post_init__(self) -> None:
        if self.json is not None:
            self.json = _schema_dict(self.json)
        if self.regex is not None and not isinstance(self.regex, str):
            raise TypeError(f"StructuredOutputsParams.regex must be a str, got {type(self.regex).__name__}")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise TypeError(f"StructuredOutputsParams.grammar must be a str, got {type(self.grammar).__name__}")
        if self.grammar is not None and not self.grammar.strip():
            raise ValueError("StructuredOutputsParams.grammar must be a non-empty grammar, got ''")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not all(isinstance(c, str) for c in self.choice):
                raise TypeError("StructuredOutputsParams.choice must be a list of str")
            if not self.choice:
                raise ValueError("StructuredOutputsParams.choice must hold at least one string, got []")
            self.choice = list(self.choice)
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise TypeError(f"StructuredOutputsParams.json_object must be a bool, got {type(self.json_object).__name__}")
        for name in ("disable_any_whitespace", "close_at_max_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"StructuredOutputsParams.{name} must be a bool, got {type(getattr(self, name)).__name__}")
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"StructuredOutputsParams needs exactly one of {', '.join(_KINDS)}, got "
                f"{', '.join(given) if given else 'none'}"
            )
        self._key = (given[0], self._text(given[0]), self.disable_any_whitespace)  # not a field: no part of eq, repr or asdict

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name in _FIELDS and self.__dict__.get("_key") is not None:  # changed after construction:
            object.__setattr__(self, "_key", None)  # checked again, and the key recomputed, when next used

    def _text(self, kind: str) -> str:
        value = getattr(self, kind)
        if kind in ("json", "choice"):
            try:  # key order kept: it is the output's
                return _json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
            except (TypeError, ValueError) as exc:  # a set, an object, NaN: not JSON
                raise type(exc)(f"StructuredOutputsParams.{kind} must be JSON: {exc}") from None
        return "" if kind == "json_object" else value

    @property
    def kind(self) -> str:
        """The constraint's kind: "json", "regex", "choice", "grammar" or "json_object"."""
        return self.key[0]

    @property
    def key(self) -> tuple:
        """(kind, canonical text, disable_any_whitespace): equal keys compile to the same grammar.
        Fields changed since the last check are checked again first (ValueError / TypeError)."""
        if self._key is None:
            self.__post_init__()
        return self._key

    def __repr__(self) -> str:
        parts = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                 if getattr(self, f.name) not in (None, False) and not (f.name == "close_at_max_tokens")]
        if not self.close_at_max_tokens:
            parts.append("close_at_max_tokens=False")
        return f"StructuredOutputsParams({', '.join(parts)})"


def _schema_dict(schema: Any) -> dict:
    """A JSON Schema as a dict: from a dict, its JSON text, or a pydantic model class."""
    if isinstance(schema, dict):
        return schema
    if isinstance(schema, str):
        try:
            value = _json.loads(schema)
        except ValueError as exc:
            raise ValueError(f"StructuredOutputsParams.json is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"StructuredOutputsParams.json must be a JSON object (a schema), got {type(value).__name__}")
        return value
    if isinstance(schema, type) and callable(getattr(schema, "model_json_schema", None)):
        return schema.model_json_schema()  # a pydantic model class
    raise TypeError(f"StructuredOutputsParams.json must be a dict, a JSON str or a pydantic model class, got {type(schema).__name__}")


def check_sampling_params(sp) -> None:
    """The checks of ``SamplingParams.structured_outputs`` and of the fields it cannot go with."""
    if not isinstance(sp.structured_outputs, StructuredOutputsParams):
        raise TypeError(f"SamplingParams.structured_outputs must be a StructuredOutputsParams or None, got {type(sp.structured_outputs).__name__}")
    sp.structured_outputs.key  # fields changed after construction are checked again (LLM.generate clones its params)
    for name, value, off in (("ignore_eos", sp.ignore_eos, False), ("min_tokens", sp.min_tokens, 0),
                             ("allowed_token_ids", sp.allowed_token_ids, None)):
        if value != off:
            raise ValueError(f"SamplingParams.{name} cannot be combined with structured_outputs (the grammar decides which "
                             f"tokens may come and where the completion ends), got {name}={value!r}")
