"""Command-line flags and typed values generated from dataclass fields (EngineArgs, SamplingParams).

One description per argument: a field's name gives its flag (``max_num_seqs`` -> ``--max-num-seqs``),
its type hint gives the parser (int, float, str, bool as ``--x/--no-x``, lists, dicts as JSON),
its default is the flag's default, and its help text comes from the field metadata or from the
owning class's docstring (``Args:`` / ``Attributes:`` sections). The same converters turn strings
(lm_eval ``model_args``, environment variables) into typed values. The pattern is vLLM's
``EngineArgs.add_cli_args`` (vllm/engine/arg_utils.py), without its config layers.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import types
import typing
from typing import Any, Callable, Optional, Union

_NONE_WORDS = ("none", "null")
_TRUE_WORDS = ("1", "true", "yes", "on")
_FALSE_WORDS = ("0", "false", "no", "off")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)
_SIZE_POWER = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def docstring_fields(doc: Optional[str], section: str) -> dict[str, str]:
    """``{name: text}`` of a Google-style docstring section (``Args:`` or ``Attributes:``).

    An entry is ``name: text`` one indent level below the section title; deeper-indented lines
    continue it; ``a, b: text`` documents several names at once. The section ends at the next line
    indented no deeper than its title.
    """
    out: dict[str, str] = {}
    lines = (doc or "").expandtabs().splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == f"{section}:")
    except StopIteration:
        return out
    title_indent = len(lines[start]) - len(lines[start].lstrip())
    entry_indent = None
    names: list[str] = []
    for line in lines[start + 1:]:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent <= title_indent:
            break
        if entry_indent is None:
            entry_indent = indent
        match = re.match(r"^([\w, ]+):\s*(.*)$", line.strip()) if indent == entry_indent else None
        if match:
            names = [n.strip() for n in match.group(1).split(",") if n.strip()]
            for n in names:
                out[n] = match.group(2)
        else:
            for n in names:
                out[n] = f"{out[n]} {line.strip()}".strip()
    return out


def _strip_optional(tp) -> tuple[Any, bool]:
    """(the type without None, whether None is allowed)."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        nullable = len(args) < len(typing.get_args(tp))
        return (args[0] if len(args) == 1 else Union[tuple(args)]), nullable
    return tp, False


def _union_members(tp) -> tuple:
    return typing.get_args(tp) if typing.get_origin(tp) in (Union, types.UnionType) else (tp,)


def parse_bool(text: str) -> bool:
    """"true/false", "yes/no", "on/off", "1/0" (any case) -> bool; else ValueError."""
    low = text.strip().lower()
    if low in _TRUE_WORDS:
        return True
    if low in _FALSE_WORDS:
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def parse_bytes(text: str) -> int:
    """A size in bytes: ``1073741824``, ``4GiB``, ``512MiB``, ``2GB`` (SI: 1000s), ``64k``."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"expected a size in bytes such as 4GiB, 512MiB or 1000000, got {text!r}")
    number, unit, binary = match.groups()
    base = 1024 if binary else 1000
    value = float(number) * base ** _SIZE_POWER[unit.lower()]
    if value != int(value):
        raise ValueError(f"a size in bytes must be a whole number of bytes, got {text!r}")
    return int(value)


def converter(tp, name: str = "") -> Callable[[str], Any]:
    """A function turning one command-line string into a value of type hint ``tp``.

    Optional types accept "none"/"null"; ints refuse floats; fields named ``*_bytes`` accept sizes
    with units (``4GiB``); ``list[int]`` accepts "1,2,3" or a JSON list; dicts are JSON objects
    (keys converted to the dict's key type). Raises ValueError with the expected form.
    """
    core, nullable = _strip_optional(tp)
    members = _union_members(core)

    def convert(text: str):
        if not isinstance(text, str):
            raise TypeError(f"expected a string to convert, got {type(text).__name__}")
        if nullable and text.strip().lower() in _NONE_WORDS:
            return None
        if bool in members:
            return parse_bool(text)
        if int in members:
            if name.endswith("_bytes"):
                return parse_bytes(text)
            try:
                return int(text.strip())
            except ValueError:
                raise ValueError(f"expected an integer, got {text!r}") from None
        if float in members:
            try:
                return float(text)
            except ValueError:
                raise ValueError(f"expected a number, got {text!r}") from None
        if str in members:
            return text
        origin = typing.get_origin(core)
        if origin is list:
            (item,) = typing.get_args(core) or (str,)
            if text.strip().startswith("["):
                values = _json(text)
                if not isinstance(values, list):
                    raise ValueError(f"expected a JSON list, got {text!r}")
                return [converter(item)(str(v)) for v in values]
            return [converter(item)(v) for v in text.split(",") if v.strip()]
        if origin is dict:
            key_type, value_type = typing.get_args(core) or (str, Any)
            obj = _json(text)
            if not isinstance(obj, dict):
                raise ValueError(f"expected a JSON object, got {text!r}")
            keys = converter(key_type)
            return {keys(str(k)): v for k, v in obj.items()}
        raise TypeError(f"no command-line form for the type {tp!r}")

    return convert


def _json(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"expected JSON ({exc.msg} at character {exc.pos}), got {text!r}") from None


def _argparse_type(fn: Callable[[str], Any], what: str) -> Callable[[str], Any]:
    """Wrap ``fn`` so that argparse reports its message ("argument --x: ...")."""

    def parse(text: str):
        try:
            return fn(text)
        except (ValueError, TypeError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = what  # argparse names the type in "invalid <name> value" messages
    return parse


def flag_name(f: dataclasses.Field) -> str:
    """``--max-num-seqs`` for ``max_num_seqs`` (or the field's ``metadata["flag"]``)."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def flag_dest(f: dataclasses.Field) -> str:
    """The argparse namespace attribute that holds the field's value."""
    return flag_name(f).lstrip("-").replace("-", "_")


def escape_help(text: str) -> str:
    """``text`` for argparse: reST backticks dropped, % escaped (help strings are %-formatted)."""
    return text.replace("``", "").replace("%", "%%")


def _with_default(text: str, default) -> str:
    """``text`` plus "(default: X)" unless it already says its default."""
    if "default" in text.lower():
        return text
    return f"{text} (default: {'none' if default is None else default})"


def add_field_flag(group, f: dataclasses.Field, tp, help_text: str, default) -> None:
    """Add the flag of dataclass field ``f`` (type hint ``tp``) to an argparse parser or group."""
    core, nullable = _strip_optional(tp)
    members = _union_members(core)
    flag, dest = flag_name(f), flag_dest(f)
    help_text = escape_help(help_text)
    kwargs: dict[str, Any] = dict(dest=dest, default=default)
    if "choices" in f.metadata:
        kwargs["choices"] = f.metadata["choices"]
    if members == (bool,):
        group.add_argument(flag, action=argparse.BooleanOptionalAction, help=_with_default(help_text, default), **kwargs)
        return
    if list in [typing.get_origin(m) or m for m in members] and str in members:
        # a str or a list of str (SamplingParams.stop): the flag is repeatable
        group.add_argument(flag, action="append", metavar="TEXT", help=f"{help_text} (repeatable)", **kwargs)
        return
    if typing.get_origin(core) is list:
        (item,) = typing.get_args(core) or (str,)
        group.add_argument(flag, nargs="+", type=_argparse_type(converter(item), "list item"), metavar="X",
                           help=f"{help_text} (one or more values)", **kwargs)
        return
    what = "size" if f.name.endswith("_bytes") else ("int" if int in members else "float" if float in members else "value")
    metavar = f.metadata.get("metavar") or ("BYTES" if what == "size" else f.name.upper())
    if "choices" in kwargs:
        metavar = None
    group.add_argument(flag, type=_argparse_type(converter(tp, f.name), what), metavar=metavar,
                       help=_with_default(help_text, default), **kwargs)


def field_types(cls) -> dict[str, Any]:
    """Resolved type hints of a dataclass's fields (annotations may be strings)."""
    return typing.get_type_hints(cls)


def from_strings(cls, values: dict, where: str) -> dict:
    """``values`` with every str given for a non-str field converted to the field's type.

    Raises ValueError naming the unknown keys and the allowed ones, or the field and the value
    that does not convert (``"EngineArgs.max_num_seqs: expected an integer, got 'x'"``).
    """
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(f"unknown {where} key(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(fields)}")
    hints = field_types(cls)
    out = {}
    for key, value in values.items():
        core, nullable = _strip_optional(hints[key])
        if isinstance(value, str) and (str not in _union_members(core) or nullable and value.strip().lower() in _NONE_WORDS):
            try:
                value = converter(hints[key], key)(value)
            except ValueError as exc:
                raise ValueError(f"{where}.{key}: {exc}") from None
        out[key] = value
    return out
