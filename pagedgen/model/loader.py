"""Reads a Hugging Face checkpoint folder: config.json (through transformers), safetensors weights
(single file or sharded with ``model.safetensors.index.json``), generation_config.json.

Only safetensors are read: pickled ``.bin`` checkpoints are refused (they can run code when loaded).
"""
from __future__ import annotations

import json
import os
from typing import Union

import torch

from pagedgen.config import ModelConfig

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    """The transformers config of the checkpoint, checked to be a supported architecture."""
    from transformers import AutoConfig

    check_model_folder(path)
    hf_config = AutoConfig.from_pretrained(path)
    archs = list(getattr(hf_config, "architectures", None) or [])
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise ValueError(
            f"unsupported architecture {archs or hf_config.model_type!r} in {path!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if getattr(hf_config, "sliding_window", None):
        raise ValueError(f"sliding-window attention (sliding_window={hf_config.sliding_window}) is not supported")
    return hf_config


def model_config_from_hf(hf_config, dtype: torch.dtype) -> ModelConfig:
    """The fields of a ``LlamaConfig`` that the model needs."""
    num_heads = hf_config.num_attention_heads
    return ModelConfig(
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads,
        rms_norm_eps=hf_config.rms_norm_eps,
        max_position_embeddings=hf_config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        dtype=dtype,
    )


def load_safetensors(path: str, dtype: torch.dtype, device: Union[str, torch.device] = "cpu") -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint, by name, cast to ``dtype`` on ``device``."""
    from safetensors import safe_open

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        shard = os.path.join(path, name)
        if not os.path.isfile(shard):
            raise FileNotFoundError(f"weight shard {name!r} listed in the index is missing in {path!r}")
        with safe_open(shard, framework="pt", device="cpu") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key).to(device=device, dtype=dtype)
    return tensors


def load_eos_token_ids(path: str, hf_config, tokenizer) -> frozenset[int]:
    """EOS ids from generation_config.json, else config.json, else the tokenizer."""
    from transformers import GenerationConfig

    eos = None
    if os.path.isfile(os.path.join(path, "generation_config.json")):
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)
