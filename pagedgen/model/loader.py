"""Reads a Hugging Face checkpoint folder: config.json (checked, then parsed by transformers), the
tokenizer, generation_config.json; ``load_model`` builds the model through the registry and streams
the safetensors weights into it (``pagedgen.model.weights``).

Only safetensors are read: pickled ``.bin`` checkpoints are refused (they can run code when loaded).
Every problem with a file is an error naming the file: ``FileNotFoundError`` for a missing one,
``CheckpointError`` (a ``ValueError``, from ``files``) for one that is there but unusable.

Imports run one way: ``loader`` -> ``weights`` -> ``files`` (``CheckpointError``, ``read_json``).
"""
from __future__ import annotations

import glob
import os
from typing import Optional, Union

import torch

from pagedgen.config import ModelConfig
from pagedgen.model import quantization, registry, weights
from pagedgen.model.base import layer_sliding_windows
from pagedgen.model.files import CheckpointError, read_json
from pagedgen.model.quantization import resolve_quantization

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: config.json fields every family needs (transformers would silently fill in its defaults)
REQUIRED_CONFIG_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings")

#: Files of which at least one makes a folder a tokenizer folder for transformers' AutoTokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "sentencepiece.bpe.model", "tekken.json")


def check_model_folder(path: str) -> None:
    """Raise FileNotFoundError naming what is missing: the folder, config.json or the weights."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model folder not found: {path!r}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"config.json is missing in the model folder {path!r}")
    if not (
        os.path.isfile(os.path.join(path, "model.safetensors"))
        or os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    ):
        found = [f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth", ".safetensors"))]
        hint = f" (found {found}; only safetensors weights are read)" if found else ""
        raise FileNotFoundError(
            f"weights are missing in the model folder {path!r}: expected model.safetensors or "
            f"model.safetensors.index.json{hint}"
        )


def resolve_dtype(dtype: Union[str, torch.dtype], hf_config) -> torch.dtype:
    """``"auto"`` takes the checkpoint's dtype (float32 if unset); else float32/bfloat16/float16."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16, got {dtype}")
        return dtype
    if not isinstance(dtype, str):
        raise TypeError(f"dtype must be a str or torch.dtype, got {type(dtype).__name__}")
    if dtype == "auto":
        saved = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(saved, str):
            saved = _DTYPES.get(saved.replace("torch.", ""), torch.float32)
        return saved if saved in _DTYPES.values() else torch.float32
    name = dtype.replace("torch.", "")
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16, got {dtype!r}")
    return _DTYPES[name]


def load_hf_config(path: str):
    """The transformers config of the checkpoint folder ``path``, checked before anything is built.

    Raises:
        FileNotFoundError: the folder, config.json or the weights are missing.
        CheckpointError: config.json is not JSON, lacks a required field (transformers would fill in
            a default silently), or transformers cannot parse it.
        ValueError: an unsupported architecture (listing the supported ones), or a field the
            family cannot honour (e.g. an unsupported RoPE type), naming the field.
    """
    from transformers import AutoConfig

    check_model_folder(path)
    file = os.path.join(path, "config.json")
    raw = read_json(file)
    _, cls = registry.resolve_architecture(raw.get("architectures"), file, raw.get("model_type"))
    try:
        hf_config = AutoConfig.from_pretrained(path)
    except Exception as exc:  # transformers' own error, with the file named
        raise CheckpointError(file, f"transformers cannot read it: {exc}") from exc
    aliases = dict(getattr(hf_config, "attribute_map", {}))  # hidden_size -> n_embd (GPT-2)
    for field in REQUIRED_CONFIG_FIELDS + cls.required_config_fields:
        if field not in raw and aliases.get(field) not in raw:
            name = field if field not in aliases else f"{field} (or {aliases[field]})"
            raise CheckpointError(file, f"the required field {name} is missing")
    cls.check_config(hf_config)
    return hf_config


def model_config_from_hf(hf_config, dtype: torch.dtype, quantization: Optional[str] = None) -> ModelConfig:
    """The engine's view of ``hf_config`` (see ``ModelConfig``); ``quantization``: ``LLM(quantization=...)``
    (None: the checkpoint's). ValueError/TypeError for a quantization that does not fit
    (``pagedgen.model.quantization.resolve_quantization``)."""
    architecture, cls = registry.resolve_architecture(hf_config.architectures)
    num_heads = hf_config.num_attention_heads
    num_layers = hf_config.num_hidden_layers
    windows = layer_sliding_windows(hf_config, num_layers)
    return ModelConfig(
        architecture=architecture,
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads,
        max_position_embeddings=cls.usable_positions(hf_config) if hasattr(cls, "usable_positions") else hf_config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        dtype=dtype,
        sliding_window=max(windows) if all(windows) else 0,
        quantization=resolve_quantization(quantization, hf_config),
    )


def load_model(path: str, hf_config, config: ModelConfig, device: Union[str, torch.device] = "cpu", tp=None, pp=None):
    """The model of the checkpoint folder ``path``, its weights streamed in (``weights.load_model``;
    ``tp``: a tensor-parallel rank's group, which loads only its shards; ``pp``: a pipeline stage,
    which loads only its layers)."""
    _, cls = registry.resolve_architecture([config.architecture])
    return weights.load_model(cls, path, hf_config, config, torch.device(device), tp, pp)


def check_parallel(hf_config, config: ModelConfig, tensor_parallel_size: int, pipeline_parallel_size: int = 1,
                   other_problems: tuple[str, ...] = ()) -> None:
    """Check the parallel sizes against the model, then build rank 0 of each pipeline stage on the
    meta device (no memory, no process).

    Raises:
        ValueError: one message listing every limit the sizes break (``tensor_parallel_size`` must
            divide the heads and KV heads; ``pipeline_parallel_size`` must be at most the decoder
            layers: stages split them as vLLM does, uneven counts allowed,
            ``distributed.group.stage_layers``), after ``other_problems`` (the CPU cores,
            ``llm_args.cores_problem``); or the first a layer's constructor finds (the MLP width),
            or its quantized parameters (an int4 group a row-parallel split would cut, FP8 blocks).
    """
    from pagedgen.distributed.group import PPGroup, TPGroup, stage_layers

    size, stages = tensor_parallel_size, pipeline_parallel_size
    _, cls = registry.resolve_architecture([config.architecture])
    problems = [p for p in other_problems if p]
    for name, total in (("num_attention_heads", config.num_heads), ("num_key_value_heads", config.num_kv_heads)):
        if total % size:
            problems.append(f"tensor_parallel_size={size} must divide {name} ({total}) of the model")
    if stages > config.num_layers:
        problems.append(f"pipeline_parallel_size={stages} must be <= num_hidden_layers ({config.num_layers}) of the model")
    if problems:
        raise ValueError("LLM " + "; ".join(problems))
    ranges = [stage_layers(config.num_layers, stages, s) for s in range(stages)]
    groups = {} if size == 1 else {"tp": TPGroup(0, size)}
    quant = quantization.scheme(config.quantization, hf_config)
    try:
        with torch.device("meta"):
            for s in sorted({0, stages - 1}):
                model = cls(hf_config, config, **groups, **({} if stages == 1 else {"pp": PPGroup(s, stages, *ranges[s])}))
                quantization.before_loading(model, quant)  # int4: a row-parallel split that cuts a group
    except ValueError as exc:
        raise ValueError(f"LLM tensor_parallel_size={size}: {exc}") from exc


def load_tokenizer(path: str):
    """transformers' AutoTokenizer of the folder ``path``.

    Raises:
        FileNotFoundError: the folder holds no tokenizer files (naming the ones expected).
        CheckpointError: transformers cannot load the tokenizer files there.
    """
    from transformers import AutoTokenizer

    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES) and not glob.glob(os.path.join(path, "*.tiktoken")):
        raise FileNotFoundError(
            f"no tokenizer files in {path!r} (expected one of {', '.join(TOKENIZER_FILES)}); "
            "pass tokenizer= (on the command line, --tokenizer) a folder that has them"
        )
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise CheckpointError(path, f"transformers cannot load the tokenizer: {exc}") from exc


def load_eos_token_ids(path: str, hf_config, tokenizer) -> frozenset[int]:
    """EOS ids from generation_config.json, else config.json, else the tokenizer."""
    from transformers import GenerationConfig

    eos = None
    if os.path.isfile(os.path.join(path, "generation_config.json")):
        read_json(os.path.join(path, "generation_config.json"))
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)
