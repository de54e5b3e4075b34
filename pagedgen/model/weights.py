"""Streaming weight loading: each safetensors tensor is read once, straight into its parameter.

    build the model on the meta device (no memory)
    plan: read every file's header (names, shapes, dtypes), map each tensor to its parameter and
          shard, dry-run every weight loader on a meta tensor of that shape
          -> every error (missing file, corrupt header, unknown tensor, wrong shape, missing weight)
             before any data is read or any memory allocated
    materialise: every parameter ``torch.empty`` in the target dtype on the target device
    load: per tensor, ``safe_open`` -> ``get_tensor`` (a view of the memory-mapped file) ->
          ``param.weight_loader`` copies it into place, converting the dtype in the same pass

No full-checkpoint dict and no second copy of the weights: peak memory is the parameters plus one
checkpoint tensor (``tests/model/test_model_loading.py`` measures the RSS). Each tensor gets its own
``safe_open``: one open for a whole file keeps every page read so far mapped, and those pages
count in the process's resident memory until the file is closed — for a single-file checkpoint,
the whole file on top of the parameters.

Sharded checkpoints are listed by ``model.safetensors.index.json`` (its ``weight_map``); tied
embeddings share one parameter, and a checkpoint's copy of the tied head is skipped.

A pipeline stage (model/stages.py) skips the tensors of the modules other stages hold (its
placeholders' names), so it reads only its layers (and the embedding on the first stage, the
final norm and head on the last). A tied head on a last stage without the embedding loads the
embedding's tensor into its own copy.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from pagedgen.config import ModelConfig
from pagedgen.distributed.group import PPGroup, TPGroup, tp_size
from pagedgen.layers.loading import CheckpointSlice, WeightShapeError, weight_loader
from pagedgen.model import quantization
from pagedgen.model.base import CausalLM
from pagedgen.model.files import CheckpointError, read_json
from pagedgen.model.stages import PPMissingLayer

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_LAYER_INDEX = re.compile(r"\.(?:layers|h)\.(\d+)\.")

# safetensors dtype names -> torch dtypes of floating-point tensors
_FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_INT8 = "I8"  # the int8 weights of a quantized checkpoint (pagedgen.model.quantization)
# the quantized weights' dtypes: the parameter's torch dtype -> the safetensors dtype the checkpoint must have
_QUANTIZED = {torch.int8: (_INT8, "an int8 (I8)"), torch.float8_e4m3fn: ("F8_E4M3", "an FP8 e4m3 (F8_E4M3)")}
# the dtypes of an int4 checkpoint's tensors (a parameter's ``checkpoint_dtypes``, pagedgen.layers.quant_int4)
_PACKED_DTYPES = {"I32": torch.int32, "I64": torch.int64, **_FLOAT_DTYPES}


@dataclass
class TensorPlan:
    """One checkpoint tensor and where it goes."""

    file: str  # path of its safetensors file
    name: str  # its name in the checkpoint
    param_name: str  # the parameter it fills
    shard_id: object  # the part of a fused parameter, or None for all of it


def checkpoint_files(path: str) -> list[str]:
    """Paths of the safetensors files of the checkpoint folder ``path`` (the shards listed by the
    index, or model.safetensors).

    Raises:
        CheckpointError: the index is not JSON or has no ``weight_map``.
        FileNotFoundError: a shard the index lists is missing (naming it and the index).
    """
    index = os.path.join(path, INDEX_FILE)
    if not os.path.isfile(index):
        return [os.path.join(path, SINGLE_FILE)]
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(index, "has no weight_map (tensor name -> shard file)")
    files = sorted(set(weight_map.values()))
    missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise FileNotFoundError(f"weight shard {os.path.join(path, missing[0])}{more} listed in {index} is missing")
    return [os.path.join(path, f) for f in files]


def read_headers(files: list[str]) -> list[tuple[str, str, tuple[int, ...], str]]:
    """(file, name, shape, safetensors dtype) of every tensor, from the headers only.

    Raises:
        CheckpointError: a file is not a readable safetensors file (truncated, corrupt, random bytes).
    """
    from safetensors import SafetensorError, safe_open

    out = []
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    out.append((file, name, tuple(sl.get_shape()), sl.get_dtype()))
        except SafetensorError as exc:
            raise CheckpointError(file, f"is not a readable safetensors file, truncated or corrupt ({exc})") from exc
    return out


def _elsewhere(model: CausalLM, name: str, missing: tuple[str, ...]) -> bool:
    """Whether checkpoint tensor ``name`` belongs to a module another pipeline stage holds
    (``missing``: the placeholders' names, each ending in a dot)."""
    return bool(missing) and any(c.startswith(missing) for c in (name, f"{model.base_model_prefix}.{name}"))


def _target(model: CausalLM, name: str, params: dict) -> Optional[tuple[str, object]]:
    """(parameter name, shard id) that checkpoint tensor ``name`` fills, None if none does."""
    head = getattr(model, model.lm_head_name, None)
    if getattr(head, "tied_elsewhere", False) and name in (f"{model.embed_tokens_name}.weight", model.embed_tokens_name.split(".", 1)[1] + ".weight"):
        return f"{model.lm_head_name}.weight", None  # a tied head on a last stage without the embedding
    for candidate in (name, f"{model.base_model_prefix}.{name}"):
        parts = candidate.split(".")
        shard_id = None
        for i, part in enumerate(parts):
            if part in model.packed_modules_mapping:
                parts[i], shard_id = model.packed_modules_mapping[part]
                break
        param_name = ".".join(parts)
        if param_name in params:
            return param_name, shard_id
    return None


def _checkpoint_name(model: CausalLM, param_name: str, shard_id) -> str:
    """The checkpoint name a part of a fused parameter comes from (inverse of the mapping)."""
    parts = param_name.split(".")
    for key, (fused, sid) in model.packed_modules_mapping.items():
        if sid == shard_id and fused in parts:
            parts[parts.index(fused)] = key
            return ".".join(parts)
    return param_name


def plan_checkpoint(model: CausalLM, path: str, hf_config) -> list[TensorPlan]:
    """Every tensor of the checkpoint mapped to its parameter and checked, no data read.

    Raises:
        FileNotFoundError / CheckpointError: see ``checkpoint_files`` and ``read_headers``.
        ValueError: a tensor the model does not have (more layers than ``num_hidden_layers``, or
            another architecture's weights), a tensor of another kind than its parameter (float; int8 for
            a quantized layer, pagedgen.model.quantization), a shape other than config.json
            implies, or a weight the model needs that the checkpoint lacks.
    """
    params = dict(model.named_parameters())
    order = {name: i for i, name in enumerate(params)}
    head = getattr(model, model.lm_head_name)
    tied = getattr(head, "tied", False) or getattr(head, "tied_elsewhere", False)
    tied_head = f"{model.lm_head_name}.weight" if tied else None
    ignored = [re.compile(p) for p in model.ignored_weights]
    num_layers = hf_config.num_hidden_layers  # all stages' (model.config holds a pipeline stage's)
    missing = tuple(f"{n}." for n, m in model.named_modules() if isinstance(m, PPMissingLayer))

    headers = read_headers(checkpoint_files(path))
    layer_indices = [int(m.group(1)) for _, name, _, _ in headers if (m := _LAYER_INDEX.search(name))]
    if layer_indices and max(layer_indices) >= num_layers:
        raise ValueError(
            f"the checkpoint holds {max(layer_indices) + 1} decoder layers, but config.json says num_hidden_layers="
            f"{num_layers}: config.json does not describe these weights"
        )
    fields = ", ".join(f"{f}={getattr(hf_config, f, None)}" for f in model.shape_fields)
    plan: list[TensorPlan] = []
    shape_errors: list[tuple[int, str]] = []
    loaded: dict[str, set] = {}
    for file, name, shape, dtype in headers:
        if name == tied_head or any(p.search(name) for p in ignored):
            continue
        if _elsewhere(model, name, missing) and not (tied and _target(model, name, params)):
            continue  # another pipeline stage's
        target = _target(model, name, params)
        if target is None:
            raise ValueError(
                f"{file}: tensor {name!r} is not a weight of {model.config.architecture}: config.json does not "
                "describe these weights"
            )
        param_name, shard_id = target
        param = params[param_name]
        quant = _QUANTIZED.get(param.dtype)  # a quantized layer's weight (its scales are float)
        packed = getattr(param, "checkpoint_dtypes", None)  # an int4 layer's tensors: read in their own dtypes
        if packed is not None:
            if dtype not in packed:
                raise ValueError(f"{file}: tensor {name!r} has dtype {dtype}, but config.json's quantization_config "
                                 f"(quantization={model.config.quantization!r}) makes it one of {list(packed)}")
            quant = ("", "")
        elif quant is not None and dtype != quant[0]:
            raise ValueError(f"{file}: tensor {name!r} has dtype {dtype}, but config.json's quantization_config "
                             f"(quantization={model.config.quantization!r}) makes it {quant[1]} weight")
        if quant is None and dtype not in _FLOAT_DTYPES:
            hint = (" (quantized weights need config.json's quantization_config to name their layer)"
                    if dtype in (q for q, _ in _QUANTIZED.values()) else "")
            raise ValueError(f"{file}: tensor {name!r} has dtype {dtype}; only floating-point (unquantised) weights are supported{hint}")
        try:
            meta_dtype = _PACKED_DTYPES[dtype] if packed else param.dtype if quant else _FLOAT_DTYPES[dtype]
            weight_loader(param)(param, torch.empty(shape, dtype=meta_dtype, device="meta"), shard_id)
        except WeightShapeError as exc:
            shape_errors.append((order[param_name], f"weight {name!r} {exc} ({fields}): config.json does not describe these weights"))
            continue
        loaded.setdefault(param_name, set()).add(shard_id)
        plan.append(TensorPlan(file, name, param_name, shard_id))
    if shape_errors:
        shape_errors.sort()
        more = f" (and {len(shape_errors) - 1} more mismatched weights)" if len(shape_errors) > 1 else ""
        raise ValueError(shape_errors[0][1] + more)
    for param_name, param in params.items():
        got = loaded.get(param_name, set())
        shards = getattr(param, "shard_ids", ())
        if None in got or (shards and got >= set(shards)) or getattr(param, "optional", False):
            continue
        missing = [s for s in shards if s not in got] if shards else [None]
        raise ValueError(f"weight {_checkpoint_name(model, param_name, missing[0])!r} is missing from the checkpoint in {path!r}")
    return plan


def materialize(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Replace every meta parameter by an uninitialised one of ``dtype`` on ``device`` (ties and the
    ``weight_loader`` attributes kept) and move the buffers (RoPE tables) to ``device``."""
    memo: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and id(p) not in memo:  # int8 weights and their scales keep theirs (load_dtype)
                new = nn.Parameter(torch.empty(p.shape, dtype=getattr(p, "load_dtype", dtype), device=device), requires_grad=False)
                new.__dict__.update(p.__dict__)
                memo[id(p)] = new
            if p is not None:
                setattr(module, name, memo[id(p)])
        for name, b in list(module._buffers.items()):
            if b is not None:
                setattr(module, name, memo.setdefault(id(b), b.to(device)))


def read_weights(model: CausalLM, plan: list[TensorPlan], sharded: bool = False) -> None:
    """Copy every planned tensor into its parameter, one ``safe_open`` per tensor (see the module
    docstring for why). ``sharded`` (a tensor-parallel rank): each loader gets a
    ``CheckpointSlice`` and reads only its rank's rows or columns (``get_slice``)."""
    from safetensors import safe_open

    params = dict(model.named_parameters())
    for t in plan:
        param = params[t.param_name]
        with safe_open(t.file, framework="pt") as f:
            tensor = CheckpointSlice(f.get_slice(t.name)) if sharded else f.get_tensor(t.name)
            weight_loader(param)(param, tensor, t.shard_id)
            del tensor


def load_model(cls: type, path: str, hf_config, config: ModelConfig, device: torch.device, tp: Optional[TPGroup] = None,
               pp: Optional[PPGroup] = None) -> CausalLM:
    """Build ``cls`` for ``hf_config`` and load the checkpoint folder ``path`` into it (``tp``: this
    rank's tensor-parallel group; the rank then allocates and reads only its shards; ``pp``: its
    pipeline stage, which allocates and reads only its modules).

    Raises:
        ValueError: the config has a field the family cannot honour, or the weights do not match
            it (see ``plan_checkpoint``); FileNotFoundError / CheckpointError for unusable files.
    """
    groups = {k: v for k, v in (("tp", tp if tp_size(tp) > 1 else None), ("pp", pp)) if v is not None}
    quant = quantization.scheme(config.quantization, hf_config)
    with torch.device("meta"):
        model = cls(hf_config, config, **groups)
    quantization.before_loading(model, quant)  # int8 parameters for a quantized checkpoint
    plan = plan_checkpoint(model, path, hf_config)
    materialize(model, config.dtype, device)
    read_weights(model, plan, sharded=tp_size(tp) > 1)
    quantization.after_loading(model, quant)  # online int8, or the checkpoint's scales checked
    return model.eval()
