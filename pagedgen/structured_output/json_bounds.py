"""JSON a small model cannot run away with: bounded whitespace and bounded numbers (issue 51).

A JSON Schema compiled as it stands lets whitespace runs of any length sit between any two JSON
tokens, and numbers run on for any number of digits (``0.1000000000…``): a small model at
temperature 1 takes either and fills ``max_tokens`` in the middle of an object. Two bounds, both
enforced by llguidance (no grammar engine here):

- **whitespace**: llguidance's ``whitespace_pattern`` option (matched at most once between two JSON
  tokens): at most one space or tab, or one newline followed by at most ``MAX_INDENT`` spaces or
  tabs, so ``json.dumps(..., indent=2)``-style pretty printing stays possible a few levels deep.
  ``disable_any_whitespace=True`` allows none. A schema with its own top-level ``"x-guidance"``
  options keeps them (llguidance reads them instead of these defaults).
- **numbers**: a second matcher, the *number guard*, runs beside the schema's: a Lark grammar of
  the JSON token stream (strings, literals, punctuation, whitespace: all as loose as JSON lexes
  them) whose numbers hold what a float64 / int64 holds: an integer of at most 19 digits, a
  decimal of at most 17 significant digits (``0.`` and the digits after it: at most 17), an
  exponent of at most 3 digits. A token is allowed where both matchers allow it (the masks are
  ANDed). A schema that asks for numbers past these bounds (a bound, ``const``, ``enum`` or
  ``multipleOf`` of magnitude 1e17 or more, or non-zero below 1e-15) runs without the guard.

The guard's language contains every JSON text whose numbers are within the bounds, so the pair
allows exactly the schema's JSON with bounded numbers; its mask changes nothing unless the text
ends inside a number (``needs_guard_mask``), so it is computed only there.
"""
from __future__ import annotations

import re

MAX_INDENT = 8  # spaces or tabs after a newline between two JSON tokens
WHITESPACE_PATTERN = r"[ \t]?|\r?\n[ \t]{0,%d}" % MAX_INDENT  # llguidance's x-guidance whitespace_pattern

#: the number guard (llguidance's Lark dialect: ``&`` intersects two regexes)
GUARD_LARK = r"""
start: TEXT
INT: /-?(0|[1-9][0-9]{0,18})/
DEC: /-?/ (/0\.[0-9]{1,17}/ | (/[1-9][0-9]*\.[0-9]+/ & /[0-9.]{1,18}/))
NUM: (INT | DEC) /([eE][+-]?[0-9]{1,3})?/
NONNUM: /[ \t\n\r{}\[\],:]/ | /"([^"\\]|\\(?s:.))*"/ | "true" | "false" | "null"
TEXT: (NUM? NONNUM)* NUM?
"""

#: the characters a JSON number is made of: a text ending in one of them may end inside a number
NUMBER_BYTES = frozenset(b"0123456789.eE+-")
#: a token holding one of these could break a bound by itself, from outside a number
_NUMBER_RUN = re.compile(rb"[0-9.]+")
_LONG_EXPONENT = re.compile(rb"[eE][+-]?[0-9]{4}")
_BIG, _SMALL = 1e17, 1e-15


def json_defaults(compact: bool, schema) -> dict:
    """llguidance's JSON compile options (``grammar_from_json_schema(defaults=...)``, which the
    schema's own top-level ``"x-guidance"`` options override key by key): no whitespace between
    tokens when ``compact``, else ``WHITESPACE_PATTERN``; llguidance's own whitespace default
    (flexible) when the schema has ``"x-guidance"`` (a ``whitespace_pattern`` kept from here would
    override its ``whitespace_flexible``)."""
    if compact or (isinstance(schema, dict) and isinstance(schema.get("x-guidance"), dict)):
        return {"whitespace_flexible": not compact}
    return {"whitespace_pattern": WHITESPACE_PATTERN}


def wants_big_numbers(schema) -> bool:
    """True when a number in ``schema`` (a parsed JSON Schema) lies outside the guard's reach:
    magnitude 1e17 or more, or non-zero below 1e-15 (a bound, ``const``, ``enum``, ``multipleOf``...).
    Such a schema asks for long numbers itself and runs without the number guard."""
    stack = [schema]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and value != 0:
            if not _SMALL <= abs(value) < _BIG:
                return True
    return False


def guard_unsafe_tokens(tokens: list[bytes]) -> bool:
    """True when some token of the table (its bytes) could break a number bound on its own, so
    that the guard's mask must be computed at every step, not only inside numbers."""
    return any(_LONG_EXPONENT.search(t) or any(sum(48 <= c <= 57 for c in run) >= 17 for run in _NUMBER_RUN.findall(t))
               for t in tokens)


def needs_guard_mask(last_token: bytes | None, every_step: bool) -> bool:
    """Whether the guard's mask can differ from the schema's at this step: the output (whose last
    token's bytes are ``last_token``; None before the first) ends in a character of a number."""
    return every_step or (last_token is not None and last_token[-1:] != b"" and last_token[-1] in NUMBER_BYTES)
