"""PEFT LoRA adapter folders: read, mapped onto pagedgen's projections, checked against the model.

A folder as ``peft``'s ``save_pretrained`` writes it (https://huggingface.co/docs/peft,
"LoRA" and "Checkpoint format"):

    adapter_config.json          peft_type "LORA", r, lora_alpha, use_rslora, target_modules, ...
    adapter_model.safetensors    (or adapter_model.bin, a torch pickle)
        base_model.model.model.layers.{i}.self_attn.{q,k,v,o}_proj.lora_A.weight   [r, in_features]
        base_model.model.model.layers.{i}.self_attn.{q,k,v,o}_proj.lora_B.weight   [out_features, r]
        base_model.model.model.layers.{i}.mlp.{gate,up,down}_proj.lora_{A,B}.weight

The delta of a projection is ``x A^T B^T * scale``, ``scale = lora_alpha / r`` (``lora_alpha /
sqrt(r)`` with ``use_rslora``). q/k/v map onto the parts of ``qkv_proj``, gate/up onto those of
``gate_up_proj`` (``TARGETS``). Refused with a ValueError naming the adapter: ``modules_to_save``,
adapters of embeddings or the lm_head, DoRA, LoRA biases, ``fan_in_fan_out``, per-module
``rank_pattern`` / ``alpha_pattern``, a target other than the seven projections, a rank over
``max_lora_rank``, a layer or shape the model does not have.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Optional

import torch

from pagedgen.lora.request import LoRARequest

#: PEFT's module name -> (pagedgen's layer attribute, part index inside it, number of parts)
TARGETS = {
    "q_proj": ("self_attn.qkv_proj", 0, 3),
    "k_proj": ("self_attn.qkv_proj", 1, 3),
    "v_proj": ("self_attn.qkv_proj", 2, 3),
    "o_proj": ("self_attn.o_proj", 0, 1),
    "gate_proj": ("mlp.gate_up_proj", 0, 2),
    "up_proj": ("mlp.gate_up_proj", 1, 2),
    "down_proj": ("mlp.down_proj", 0, 1),
}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")
CONFIG_FILE, SAFETENSORS_FILE, BIN_FILE = "adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"


@dataclass(frozen=True)
class ModelShapes:
    """What an adapter must fit: the decoder layers and each target's (in_features, out_features)."""

    num_layers: int
    features: dict  # PEFT module name -> (in, out)

    @classmethod
    def of(cls, model_config, intermediate_size: int) -> "ModelShapes":
        h, q, kv, i = model_config.hidden_size, model_config.num_heads * model_config.head_dim, model_config.num_kv_heads * model_config.head_dim, intermediate_size
        return cls(model_config.num_layers, {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                                             "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)})


@dataclass(frozen=True)
class AdapterInfo:
    """A checked adapter: its rank, scale and the (layer, PEFT module) pairs it adapts."""

    rank: int
    scale: float
    modules: frozenset  # {(layer index, PEFT module name)}


class AdapterError(ValueError):
    """An adapter folder that cannot be used (the message says why)."""


def _read_config(path: str) -> dict:
    if not os.path.isdir(path):
        raise AdapterError(f"folder not found: {path!r}")
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise AdapterError(f"no {CONFIG_FILE} in {path!r} (a PEFT adapter folder, as save_pretrained writes it)")
    try:
        with open(file) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise AdapterError(f"cannot read {file!r}: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{file!r} is not a JSON object")
    return config


def _check_config(config: dict, max_lora_rank: int) -> tuple[int, float]:
    """(rank, scale) of a PEFT LoRA config; AdapterError for what pagedgen does not run."""
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"peft_type {config.get('peft_type')!r} is not supported: only LORA")
    if config.get("modules_to_save"):
        raise AdapterError(f"modules_to_save {config['modules_to_save']} is not supported: only LoRA deltas of the attention and MLP projections")
    if config.get("use_dora"):
        raise AdapterError("DoRA (use_dora=true) is not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"LoRA biases (bias={config['bias']!r}) are not supported: only bias='none'")
    if config.get("fan_in_fan_out"):
        raise AdapterError("fan_in_fan_out=true (Conv1D layers) is not supported")
    for name in ("rank_pattern", "alpha_pattern", "layers_pattern", "layers_to_transform"):
        if config.get(name):
            raise AdapterError(f"{name} is not supported: one r and lora_alpha for every module")
    r, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise AdapterError(f"r must be an int >= 1, got {r!r}")
    if r > max_lora_rank:
        raise AdapterError(f"rank r={r} is over max_lora_rank={max_lora_rank} (LLM(max_lora_rank=...))")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise AdapterError(f"lora_alpha must be a number, got {alpha!r}")
    targets = config.get("target_modules")
    names = [targets] if isinstance(targets, str) else list(targets or [])
    unknown = sorted(t for t in names if t.split(".")[-1] not in TARGETS)
    if unknown:
        raise AdapterError(f"target_modules {unknown} not supported: LoRA applies to {sorted(TARGETS)}")
    return r, alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def _tensor_shapes(path: str) -> dict:
    """{key: shape} of the adapter's weights, without reading the safetensors data."""
    st, binary = os.path.join(path, SAFETENSORS_FILE), os.path.join(path, BIN_FILE)
    if os.path.isfile(st):
        from safetensors import safe_open
        try:
            with safe_open(st, framework="pt") as f:
                return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        except Exception as exc:  # noqa: BLE001 - a broken file, named
            raise AdapterError(f"cannot read {st!r}: {exc}") from None
    if os.path.isfile(binary):
        return {k: tuple(v.shape) for k, v in _load_bin(binary).items()}
    raise AdapterError(f"no {SAFETENSORS_FILE} or {BIN_FILE} in {path!r}")


def _load_bin(file: str) -> dict:
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001
        raise AdapterError(f"cannot read {file!r}: {exc}") from None


def _modules(shapes: dict, rank: int, model: ModelShapes) -> frozenset:
    """The (layer, module) pairs of the weights ``shapes``, each with an A and a B of the model's shapes."""
    found: dict = {}
    for key, shape in shapes.items():
        m = _KEY.search(key)
        if m is None:
            raise AdapterError(f"weight {key!r} is not supported: only lora_A / lora_B of {sorted(TARGETS)} in the decoder layers")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in TARGETS:
            raise AdapterError(f"weight {key!r}: target module {module!r} not supported (LoRA applies to {sorted(TARGETS)})")
        if layer >= model.num_layers:
            raise AdapterError(f"weight {key!r}: layer {layer}, but the model has {model.num_layers} layers")
        fin, fout = model.features[module]
        want = (rank, fin) if ab == "A" else (fout, rank)
        if tuple(shape) != want:
            raise AdapterError(f"weight {key!r} has shape {list(shape)}, the model needs {list(want)} (an adapter of another base model?)")
        found.setdefault((layer, module), set()).add(ab)
    half = sorted(k for k, v in found.items() if len(v) != 2)
    if half:
        raise AdapterError(f"layer {half[0][0]} {half[0][1]} has lora_A or lora_B, not both")
    if not found:
        raise AdapterError("the adapter has no LoRA weights")
    return frozenset(found)


def check_adapter(path: str, model: ModelShapes, max_lora_rank: int) -> AdapterInfo:
    """Read ``path``'s config and weight shapes and check them against the model (AdapterError)."""
    rank, scale = _check_config(_read_config(path), max_lora_rank)
    return AdapterInfo(rank, scale, _modules(_tensor_shapes(path), rank, model))


def load_adapter(path: str, model: ModelShapes, max_lora_rank: int) -> tuple[AdapterInfo, dict]:
    """The checked adapter and its weights: {(layer, PEFT module): (A [r, in], B [out, r])}, float32 on the CPU."""
    info = check_adapter(path, model, max_lora_rank)
    st = os.path.join(path, SAFETENSORS_FILE)
    if os.path.isfile(st):
        from safetensors.torch import load_file
        tensors = load_file(st)
    else:
        tensors = _load_bin(os.path.join(path, BIN_FILE))
    weights: dict = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        pair = weights.setdefault((int(m.group(1)), m.group(2)), [None, None])
        pair[0 if m.group(3) == "A" else 1] = t.float()
    return info, {k: tuple(v) for k, v in weights.items()}


class LoRAChecker:
    """The driver's checks of ``lora_request`` arguments, before any work (tensor-light: shapes only).

    Args:
        config: the LLM's ``LoRAConfig``, or None when ``enable_lora`` is off (then any adapter is refused).
        model: the model's ``ModelShapes``.

    Each adapter is checked once per (id, path); the ids seen keep their path for the LLM's life.
    """

    def __init__(self, config, model: Optional[ModelShapes]) -> None:
        self.config, self.model = config, model
        self._paths: dict[int, str] = {}  # lora_int_id -> its path (the prefix cache's key stays one adapter)
        self._checked: dict[tuple[int, str], AdapterInfo] = {}

    def check(self, lora, where: str) -> Optional[LoRARequest]:
        """``lora`` (a LoRARequest or None) checked; errors name ``where`` (``prompts[i]``) and the adapter."""
        if lora is None:
            return None
        if not isinstance(lora, LoRARequest):
            raise TypeError(f"{where} lora_request must be a LoRARequest or None, got {type(lora).__name__}")
        name = f"{where} lora_request {lora.lora_name!r} (lora_int_id={lora.lora_int_id}, lora_path={lora.lora_path!r})"
        if self.config is None:
            raise ValueError(f"{name}: LoRA is off; make the LLM with LLM(..., enable_lora=True)")
        known = self._paths.get(lora.lora_int_id)
        if known is not None and os.path.realpath(known) != os.path.realpath(lora.lora_path):
            raise ValueError(f"{name}: lora_int_id {lora.lora_int_id} was already given path {known!r}; one id, one adapter")
        key = (lora.lora_int_id, lora.lora_path)
        if key not in self._checked:
            try:
                self._checked[key] = check_adapter(lora.lora_path, self.model, self.config.max_lora_rank)
            except AdapterError as exc:
                raise ValueError(f"{name}: {exc}") from None
        return lora

    def check_all(self, lora_request, n: int, where: str = "prompts") -> list[Optional[LoRARequest]]:
        """One adapter per request of a call of ``n``: ``lora_request`` one (or None) for all, or a
        list of ``n``. The same id twice with two paths in one call is refused too."""
        if isinstance(lora_request, (list, tuple)):
            if len(lora_request) != n:
                raise ValueError(f"lora_request must be one LoRARequest (or None) for all, or a list of one per prompt ({n}), got {len(lora_request)}")
            out = [self.check(lr, f"{where}[{i}]") for i, lr in enumerate(lora_request)]
        else:
            one = self.check(lora_request, f"{where}[0..{n - 1}]" if n else where)
            out = [one] * n
        seen: dict[int, tuple[int, str]] = {}
        for i, lr in enumerate(out):
            if lr is None:
                continue
            first = seen.setdefault(lr.lora_int_id, (i, lr.lora_path))
            if os.path.realpath(first[1]) != os.path.realpath(lr.lora_path):
                raise ValueError(f"{where}[{i}] lora_request {lr.lora_name!r}: lora_int_id {lr.lora_int_id} has path "
                                 f"{lr.lora_path!r} here and {first[1]!r} at {where}[{first[0]}]; one id, one adapter")
        self._remember(out)
        return out

    def check_one(self, lora, where: str) -> Optional[LoRARequest]:
        """One request's adapter (``add_request``), checked and remembered."""
        out = self.check(lora, where)
        self._remember([out])
        return out

    def _remember(self, loras) -> None:
        for lr in loras:  # accepted: their ids keep their paths for the LLM's life
            if lr is not None:
                self._paths.setdefault(lr.lora_int_id, lr.lora_path)
