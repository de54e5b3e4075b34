"""The command line's structured outputs (docs/cli.md, docs/structured_outputs.md).

One constraint for every row: ``--json-schema FILE`` (or the schema's JSON itself), ``--regex
PATTERN``, ``--choice A B C``, ``--grammar FILE`` (Lark or GBNF); ``--disable-any-whitespace``
for compact JSON; ``--no-close-at-max-tokens`` to let a JSON completion run into ``--max-tokens``
unsteered (``StructuredOutputsParams.close_at_max_tokens``, on by default). One per row:
``--schema-field NAME``, a field holding the row's JSON Schema (an object, or its JSON text); a
row whose field is missing or null takes the command line's constraint, if any. In the OpenAI batch format, a body's ``response_format`` (``{"type":
"json_schema", "json_schema": {"schema": {...}}}`` or ``{"type": "json_object"}``) does the same.
The two JSON flags apply to every constraint the command line builds, a row's and a body's too.
A schema the grammar backend refuses is a bad row (``--on-error``); a bad command-line constraint
stops the run before any row is read.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from typing import Optional

from pagedgen import arg_utils
from pagedgen.cli.errors import BadRow, CLIError
from pagedgen.sampling_args import sampling_fields
from pagedgen.sampling_params import SamplingParams
from pagedgen.structured_output.params import StructuredOutputsParams

FLAGS = ("--json-schema", "--regex", "--choice", "--grammar")


def add_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("structured outputs (one constraint for every row, or one per row)")
    group.add_argument("--json-schema", default=None, metavar="FILE",
                       help="every completion is JSON valid against this JSON Schema (a file, or the schema's JSON itself)")
    group.add_argument("--regex", default=None, metavar="PATTERN", help="every completion full-matches this regular expression")
    group.add_argument("--choice", nargs="+", default=None, metavar="TEXT", help="every completion is one of these strings")
    group.add_argument("--grammar", default=None, metavar="FILE", help="every completion follows this Lark or GBNF grammar (a file)")
    group.add_argument("--disable-any-whitespace", action="store_true", help="JSON without whitespace between tokens")
    group.add_argument("--close-at-max-tokens", action=argparse.BooleanOptionalAction, default=True,
                       help="near --max-tokens, steer a JSON completion (--json-schema, --schema-field, response_format) to close "
                            "its JSON so that a completion cut by the limit is still valid JSON (default: on; --no-close-at-max-tokens: "
                            "the model alone decides, as vLLM); no effect on --regex, --choice, --grammar")
    group.add_argument("--schema-field", default=None, metavar="NAME",
                       help="a field holding each row's own JSON Schema (object or JSON text); rows without it take the flags above")


def with_constraint(params: SamplingParams, args: argparse.Namespace) -> SamplingParams:
    """The command line's SamplingParams with its structured-output flags. Raises CLIError."""
    given = [(flag, getattr(args, flag[2:].replace("-", "_"))) for flag in FLAGS]
    given = [(flag, value) for flag, value in given if value is not None]
    if len(given) > 1:
        raise CLIError(f"{' and '.join(f for f, _ in given)}: give one structured-output constraint (or --schema-field per row)")
    if args.schema_field is not None and not args.schema_field.strip():
        raise CLIError(f"--schema-field must be a non-empty field name, got {args.schema_field!r}")
    if not given:
        return params
    flag, value = given[0]
    close = args.close_at_max_tokens  # carried by every kind (only JSON is steered), as by a row's and a body's constraint
    try:
        if flag == "--json-schema":
            spec = StructuredOutputsParams(json=_read(flag, value, inline_if=lambda t: t.lstrip().startswith("{")),
                                           disable_any_whitespace=args.disable_any_whitespace, close_at_max_tokens=close)
        elif flag == "--grammar":
            spec = StructuredOutputsParams(grammar=_read(flag, value, inline_if=lambda t: False), close_at_max_tokens=close)
        else:
            spec = StructuredOutputsParams(**{flag[2:]: value}, close_at_max_tokens=close)
        return dataclasses.replace(params, structured_outputs=spec)
    except (TypeError, ValueError) as exc:
        flags = {f.name: arg_utils.flag_name(f) for f in sampling_fields()}
        message = re.sub(r"SamplingParams\.(\w+)", lambda m: flags.get(m.group(1), m.group(0)), str(exc))
        if message != str(exc):  # another flag that cannot go with a constraint (--min-tokens 3): name both flags
            raise CLIError(message.replace("structured_outputs", flag)) from None
        raise CLIError(f"{flag}: {exc}") from None


def _read(flag: str, value: str, inline_if) -> str:
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise CLIError(f"cannot read {flag} {value!r}: {exc}") from None
    if inline_if(value):
        return value
    raise CLIError(f"{flag} {value!r}: no such file")


def row_params(params: SamplingParams, fields: dict, schema_field: Optional[str], compact: bool, close: bool = True) -> SamplingParams:
    """``params`` with the JSON Schema of the row's ``schema_field`` (if it has one), compact
    (``--disable-any-whitespace``) and closed near the limit (``--close-at-max-tokens``) as the
    command line says. Raises BadRow."""
    if schema_field is None or fields.get(schema_field) is None:
        return params
    try:
        spec = StructuredOutputsParams(json=fields[schema_field], disable_any_whitespace=compact, close_at_max_tokens=close)
        return dataclasses.replace(params, structured_outputs=spec)
    except (TypeError, ValueError) as exc:
        raise BadRow(f"{schema_field}: {exc}") from None


def body_overrides(overrides: dict, compact: bool, close: bool = True) -> dict:
    """An OpenAI body's SamplingParams fields with its response_format's constraint made compact
    when ``--disable-any-whitespace`` is given, and closed near the limit as
    ``--close-at-max-tokens`` says (a body has no field for either)."""
    spec = overrides.get("structured_outputs")
    if spec is None or ((not compact or spec.disable_any_whitespace) and spec.close_at_max_tokens == close):
        return overrides
    spec = dataclasses.replace(spec, disable_any_whitespace=spec.disable_any_whitespace or compact, close_at_max_tokens=close)
    return {**overrides, "structured_outputs": spec}


def response_format(value) -> Optional[StructuredOutputsParams]:
    """The constraint of an OpenAI body's ``response_format`` (None for ``{"type": "text"}``). Raises BadRow."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    try:
        if kind == "json_object":
            return StructuredOutputsParams(json_object=True)
        if kind == "json_schema":
            inner = value.get("json_schema")
            if not isinstance(inner, dict) or not isinstance(inner.get("schema"), (dict, str)):
                raise BadRow("body.response_format.json_schema must be an object with a 'schema' (a JSON Schema object)")
            return StructuredOutputsParams(json=inner["schema"])
    except (TypeError, ValueError) as exc:
        raise BadRow(f"body.response_format: {exc}") from None
    raise BadRow(f"body.response_format must have type 'text', 'json_object' or 'json_schema', got {json.dumps(value)[:100]}")
