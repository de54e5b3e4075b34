"""``EngineArgs``: the arguments of ``LLM(...)`` as one dataclass, written once.

The fields are exactly the keyword arguments of ``LLM.__init__`` (names, defaults and types; a test
compares them with ``inspect.signature``), each with its help text (taken from ``LLM``'s docstring).
From that one description come the command-line flags (``--max-num-seqs``,
``--enable-prefix-caching/--no-enable-prefix-caching``), a dict for Ray actors or lm_eval
``model_args`` (values may be strings there: they are converted to the field's type), and the LLM::

    args = EngineArgs.from_dict({"model": "../shared/models/stories260K", "max_num_seqs": "8"})
    llm = args.create_llm()

The pattern is vLLM's ``EngineArgs`` (vllm/engine/arg_utils.py).
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from pagedgen import arg_utils
from pagedgen.ops import kv_quant
from pagedgen.llm import LLM

_HELP = arg_utils.docstring_fields(LLM.__doc__, "Args")
_DTYPES = ("auto", "float32", "bfloat16", "float16")


def _arg(default=dataclasses.MISSING, *, name: str, **metadata):
    return field(default=default, metadata={"help": _HELP.get(name, ""), **metadata})


@dataclass
class EngineArgs:
    """The keyword arguments of ``LLM`` (see its docstring for each one's meaning and range).

    Values are checked by ``LLM`` itself when ``create_llm()`` builds it; ``from_dict`` and
    ``from_cli_args`` only convert strings to the fields' types.
    """

    model: str = _arg(name="model", metavar="PATH")
    tokenizer: Optional[str] = _arg(None, name="tokenizer", metavar="PATH")
    dtype: Union[str, torch.dtype] = _arg("auto", name="dtype", choices=_DTYPES)
    block_size: int = _arg(16, name="block_size")
    num_kv_blocks: Optional[int] = _arg(None, name="num_kv_blocks")
    kv_cache_memory_bytes: Optional[int] = _arg(None, name="kv_cache_memory_bytes")
    max_num_seqs: int = _arg(256, name="max_num_seqs")
    max_num_batched_tokens: Optional[int] = _arg(None, name="max_num_batched_tokens")
    max_model_len: Optional[int] = _arg(None, name="max_model_len")
    # --seed is the per-request SamplingParams.seed on pagedgen's command line; the engine's is --engine-seed
    seed: int = _arg(0, name="seed", flag="--engine-seed")
    enforce_extension: bool = _arg(False, name="enforce_extension")
    enable_prefix_caching: bool = _arg(True, name="enable_prefix_caching")
    preemption_mode: str = _arg("recompute", name="preemption_mode", choices=("recompute", "swap"))
    swap_space_bytes: Optional[int] = _arg(None, name="swap_space_bytes")
    kv_cache_dtype: str = _arg("auto", name="kv_cache_dtype", choices=kv_quant.CHOICES)
    device: Union[str, torch.device, None] = _arg(None, name="device")
    gpu_memory_utilization: float = _arg(0.9, name="gpu_memory_utilization")
    enforce_eager: bool = _arg(False, name="enforce_eager")
    batch_invariant: Optional[bool] = _arg(None, name="batch_invariant")
    distributed_executor_backend: Optional[str] = _arg(None, name="distributed_executor_backend")
    tensor_parallel_size: int = _arg(1, name="tensor_parallel_size")
    pipeline_parallel_size: int = _arg(1, name="pipeline_parallel_size")
    speculative_config: Optional[dict[str, Any]] = _arg(None, name="speculative_config", metavar="JSON")
    runner: str = _arg("auto", name="runner", choices=("auto", "generate", "pooling"))
    convert: str = _arg("auto", name="convert", choices=("auto", "none", "embed", "classify"))
    pooler_config: Optional[dict[str, Any]] = _arg(None, name="pooler_config", metavar="JSON")
    quantization: Optional[str] = _arg(None, name="quantization", choices=("int8", "fp8", "compressed-tensors", "awq", "gptq"))
    enable_lora: bool = _arg(False, name="enable_lora")
    max_loras: int = _arg(1, name="max_loras")
    max_lora_rank: int = _arg(16, name="max_lora_rank")
    max_cpu_loras: Optional[int] = _arg(None, name="max_cpu_loras")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, title: str = "engine (LLM arguments)") -> argparse.ArgumentParser:
        """Add one flag per field to ``parser`` (in an argument group named ``title``).

        ``model`` becomes the required ``--model``; bools ``--x/--no-x``; sizes in bytes accept
        units (``--kv-cache-memory-bytes 4GiB``); optional values accept ``none``. Returns parser.
        """
        group = parser.add_argument_group(title)
        hints = arg_utils.field_types(cls)
        for f in dataclasses.fields(cls):
            if f.default is dataclasses.MISSING:
                group.add_argument(arg_utils.flag_name(f), dest=arg_utils.flag_dest(f), required=True,
                                   metavar=f.metadata.get("metavar"), help=arg_utils.escape_help(f.metadata["help"]))
            else:
                arg_utils.add_field_flag(group, f, hints[f.name], f.metadata["help"], f.default)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        """The EngineArgs of a namespace parsed by a parser that ``add_cli_args`` filled."""
        return cls(**{f.name: getattr(args, arg_utils.flag_dest(f)) for f in dataclasses.fields(cls)})

    def to_dict(self) -> dict:
        """``{field: value}`` for every field (``LLM(**d)`` builds the same LLM)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, values: dict) -> "EngineArgs":
        """EngineArgs from a dict; strings for non-str fields are converted ("8" -> 8, "false" -> False,
        "none" -> None, "4GiB" for sizes).

        Raises:
            ValueError: an unknown key (the message lists the allowed ones), a missing ``model``,
                or a string that does not convert to its field's type (naming the field).
            TypeError: ``values`` is not a dict.
        """
        if not isinstance(values, dict):
            raise TypeError(f"EngineArgs.from_dict takes a dict, got {type(values).__name__}")
        converted = arg_utils.from_strings(cls, values, "EngineArgs")
        if "model" not in converted:
            raise ValueError("EngineArgs needs 'model' (the checkpoint folder)")
        return cls(**converted)

    def create_llm(self) -> LLM:
        """``LLM(**self.to_dict())`` (its errors: see ``LLM``)."""
        return LLM(**self.to_dict())
