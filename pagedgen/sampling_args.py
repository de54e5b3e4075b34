"""Command-line flags for every ``SamplingParams`` field, generated from the dataclass.

``--temperature``, ``--top-p``, ``--max-tokens`` (``none``: up to max_model_len), ``--stop`` (repeatable),
``--stop-token-ids 2 13``, ``--logit-bias '{"50256": -100}'``, ``--ignore-eos/--no-ignore-eos``...;
help texts come from ``SamplingParams``'s docstring, defaults from its fields, so the flags follow
the class when a field is added.
"""
from __future__ import annotations

import argparse
import dataclasses

from pagedgen import arg_utils
from pagedgen.sampling_params import SamplingParams

_HELP = arg_utils.docstring_fields(SamplingParams.__doc__, "Attributes")


def sampling_fields() -> tuple[dataclasses.Field, ...]:
    """The fields of ``SamplingParams`` (one flag each), less ``structured_outputs``, whose flags
    are ``--json-schema``, ``--regex``, ``--choice`` and ``--schema-field`` (pagedgen/cli/structured.py)."""
    return tuple(f for f in dataclasses.fields(SamplingParams) if f.name != "structured_outputs")


def add_sampling_args(parser: argparse.ArgumentParser, title: str = "sampling (SamplingParams fields)") -> argparse.ArgumentParser:
    """Add ``--<field>`` for every SamplingParams field to ``parser``; defaults are the class's."""
    group = parser.add_argument_group(title)
    hints = arg_utils.field_types(SamplingParams)
    for f in sampling_fields():
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        arg_utils.add_field_flag(group, f, hints[f.name], _HELP.get(f.name, ""), default)
    return parser


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    """The SamplingParams of a parsed namespace. Raises ValueError/TypeError from SamplingParams."""
    return SamplingParams(**sampling_dict_from_args(args))


def sampling_dict_from_args(args: argparse.Namespace) -> dict:
    """``{field: value}`` of the sampling flags in ``args``."""
    return {f.name: getattr(args, arg_utils.flag_dest(f)) for f in sampling_fields()}


def sampling_params_from_dict(values: dict, where: str = "SamplingParams") -> SamplingParams:
    """SamplingParams from a dict whose str values for non-str fields are converted (as
    ``EngineArgs.from_dict`` does). Raises ValueError for unknown keys (listing the allowed ones)
    or values that do not convert, and whatever SamplingParams raises for bad values."""
    return SamplingParams(**arg_utils.from_strings(SamplingParams, values, where))
