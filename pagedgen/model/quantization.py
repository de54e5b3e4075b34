"""``LLM(quantization=...)``: which quantization a model runs with, read from the argument and
config.json's ``quantization_config``, checked before any weight is read, and applied to the model's
linear layers (the per-layer work is ``pagedgen.layers.quant``'s). docs/quantization.md.

    quantization      config.json                         the model
    None (default)    no quantization_config              float weights, as before
    None / "compressed-tensors"
                      quant_method "compressed-tensors",  int8 weights + per-channel scales read from the
                      format "int-quantized" (W8A8)       checkpoint; activations quantized per row
                                                          (dynamic, "token") or by the static input_scale
    "int8"            no quantization_config              the float checkpoint's linear layers quantized
                                                          at load (per output channel, symmetric),
                                                          dynamic per-row activation scales
    None / "compressed-tensors"
                      format "float-quantized" (FP8)      float8_e4m3fn weights + per-channel or
                                                          per-tensor scales; activations stay in the
                                                          model dtype (W8A16, also for a config that
                                                          asks for dynamic per-token FP8 activations)
    None / "fp8"      quant_method "fp8" (vLLM's format)  float8_e4m3fn weights + per-tensor
                                                          ``weight_scale``, or block-wise
                                                          ``weight_scale_inv`` with ``weight_block_size``
                                                          (DeepSeek-V3 / Qwen3-FP8), W8A16 (static
                                                          activation scales refused)
    "fp8"             no quantization_config              the float checkpoint's linear layers quantized
                                                          to float8_e4m3fn at load, per output channel
    None / "gptq" / "awq" / "compressed-tensors"
                      quant_method "gptq", "awq", or      int4 W4A16: 4-bit codes, a scale (and zero
                      format "pack-quantized"             point) per group of input features; activations
                                                          in the model dtype (model/quantization_int4.py
                                                          reads the config, layers/quant_int4.py the tensors)

The lm_head, the embeddings and the modules of compressed-tensors' ``ignore`` list (AWQ's / GPTQ's
``modules_to_not_convert``) stay in float. Everything else vLLM names (awq_marlin, bitsandbytes, other
compressed-tensors formats) is refused with a ValueError naming the field, as are configs pagedgen
cannot honour (int8 asymmetric, other bit widths, act-order GPTQ, a KV-cache scheme).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from torch import nn

from pagedgen.layers.linear import LinearBase
from pagedgen.layers.quant import finish_int8, make_int8_params, quantize_linear_int8
from pagedgen.layers.quant_fp8 import finish_fp8, make_fp8_params, quantize_linear_fp8
from pagedgen.layers.quant_int4 import finish_int4, make_int4_params
from pagedgen.model.quantization_int4 import awq_scheme, gptq_scheme, pack_quantized_scheme

#: the values of ``LLM(quantization=...)`` pagedgen runs
QUANTIZATION_METHODS = ("int8", "fp8", "compressed-tensors", "awq", "gptq")
#: the methods that quantize a float checkpoint at load when it has no quantization_config
ONLINE = ("int8", "fp8")
#: vLLM's names pagedgen knows but does not run yet (a clear error instead of "unknown")
NOT_YET = ("awq_marlin", "gptq_marlin", "bitsandbytes", "gguf", "modelopt", "marlin")


@dataclass(frozen=True)
class QuantScheme:
    """How a model's linear layers are quantized.

    Attributes:
        method: "int8" / "fp8" (online from a float checkpoint, or "fp8" read from vLLM's fp8 format)
            or "compressed-tensors" (int8 or FP8 in the checkpoint).
        static_input: activations use the checkpoint's static per-tensor ``input_scale`` (else dynamic per row).
        ignore: compressed-tensors' ``ignore`` entries (fp8's ``ignored_layers``): module names, or ``re:`` regexes over them.
        weights: "int8" (W8A8, layers/quant.py) or "fp8" (float8_e4m3fn, W8A16, layers/quant_fp8.py).
        online: the float checkpoint's layers are quantized after loading.
        block: the (rows, columns) of one block-wise scale (fp8's ``weight_block_size``,
            compressed-tensors' ``block_structure``); () for none.
        block_scale_name: the checkpoint's name of the block scales (fp8: ``weight_scale_inv``).
        fmt: int4 W4A16 (``weights="int4"``, layers/quant_int4.py): the checkpoint's layout, "gptq",
            "awq" or "pack-quantized" (compressed-tensors).
        group_size: int4: input features per scale (32, 64, 128; -1 per output channel).
        symmetric: int4: no zero points in the checkpoint (the zero is 8).
        zero_offset: int4: added to each stored zero point (1 for GPTQ's v1 format, which stores z - 1).
    """

    method: str
    static_input: bool = False
    ignore: tuple = ()
    weights: str = "int8"
    online: bool = False
    block: tuple = ()
    block_scale_name: str = "weight_scale"
    fmt: str = ""
    group_size: int = 0
    symmetric: bool = True
    zero_offset: int = 0

    def ignores(self, names: list) -> bool:
        """True when the checkpoint module names ``names`` (the parts of one layer) are all ignored;
        ValueError when only some are (a fused layer is quantized whole or not at all)."""
        hits = [any(_matches(n, e) for e in self.ignore) for n in names]
        if any(hits) and not all(hits):
            raise ValueError(f"quantization_config.ignore names {[n for n, h in zip(names, hits) if h]} but not "
                             f"{[n for n, h in zip(names, hits) if not h]}: the parts of a fused layer must be quantized alike")
        return bool(hits) and all(hits)


def _matches(name: str, entry: str) -> bool:
    if entry.startswith("re:"):
        return re.match(entry[3:], name) is not None
    return name == entry or name.endswith("." + entry) or entry.endswith("." + name)


def resolve_quantization(quantization: Optional[str], hf_config) -> str:
    """The quantization method of a model: ``quantization`` as given (``LLM(quantization=...)``), or
    the checkpoint's (``quantization_config.quant_method``) when None; "" for none. Checks the
    checkpoint's config (``scheme``) too.

    Raises:
        TypeError: ``quantization`` not a str or None.
        ValueError: an unknown or unsupported method (naming the allowed ones), a method the
            checkpoint does not have, "int8" / "fp8" on a checkpoint that is already quantized otherwise, or a
            ``quantization_config`` pagedgen cannot run (naming the field).
    """
    if quantization is not None and not isinstance(quantization, str):
        raise TypeError(f"LLM quantization must be a str or None, got {type(quantization).__name__}")
    qc = getattr(hf_config, "quantization_config", None)
    saved = None if qc is None else _get(qc, "quant_method")
    if quantization is not None:
        q = quantization.strip().lower()
        q = "compressed-tensors" if q == "compressed_tensors" else q
        if q in ("none", ""):
            q = ""
        elif q not in QUANTIZATION_METHODS:
            if q in NOT_YET:
                raise ValueError(f"LLM quantization={quantization!r} is not supported yet (issue 46); supported: {QUANTIZATION_METHODS}")
            raise ValueError(f"LLM quantization must be None or one of {QUANTIZATION_METHODS}, got {quantization!r}")
        if saved is not None and q != saved:
            what = {"int8": "a float checkpoint", "fp8": "a float checkpoint or one in the fp8 format"}.get(q, "this checkpoint")
            raise ValueError(f"LLM quantization={quantization!r} does not fit the checkpoint: its config.json has "
                             f"quantization_config.quant_method={saved!r} (quantization={q!r} needs {what}); pass quantization=None")
        if q in ("compressed-tensors", "awq", "gptq") and saved is None:
            raise ValueError(f"LLM quantization={q!r} needs a checkpoint whose config.json has a quantization_config; "
                             "for a float checkpoint pass quantization='int8' (or 'fp8')")
    else:
        q = saved or ""
        if q and q not in QUANTIZATION_METHODS:
            why = "is not supported yet (issue 46)" if q in NOT_YET else "is unknown"
            raise ValueError(f"config.json quantization_config.quant_method={q!r} {why}; supported: {QUANTIZATION_METHODS}")
    scheme(q, hf_config)  # ValueError for a config pagedgen cannot run
    return q


def _get(obj, key: str, default=None):
    return obj.get(key, default) if isinstance(obj, dict) else getattr(obj, key, default)


def scheme(method: str, hf_config) -> Optional[QuantScheme]:
    """The ``QuantScheme`` of a resolved method (None for ""), from config.json's
    ``quantization_config`` for "compressed-tensors". ValueError naming the field it cannot honour."""
    if not method:
        return None
    qc = getattr(hf_config, "quantization_config", None)
    if method in ONLINE and qc is None:
        return QuantScheme(method, weights=method, online=True)
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    field = "config.json quantization_config"
    if method == "fp8":
        return _fp8_scheme(qc, field)
    if method == "gptq":
        return gptq_scheme(qc, field, QuantScheme)
    if method == "awq":
        return awq_scheme(qc, field, QuantScheme)
    fmt = qc.get("format")
    if fmt == "float-quantized":
        return _float_quantized_scheme(qc, field)
    if fmt == "pack-quantized":
        return pack_quantized_scheme(qc, field, QuantScheme)
    if fmt != "int-quantized":
        raise ValueError(f"{field}.format={fmt!r} is not supported yet (issue 46): pagedgen runs compressed-tensors "
                         "'int-quantized' (W8A8 int8), 'float-quantized' (FP8) and 'pack-quantized' (int4 W4A16)")
    if qc.get("kv_cache_scheme") is not None:
        raise ValueError(f"{field}.kv_cache_scheme is set: a quantized KV cache from the checkpoint is not supported yet")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ValueError(f"{field}.config_groups is missing or empty")
    statics = set()
    for gname, g in groups.items():
        where = f"{field}.config_groups.{gname}"
        if "Linear" not in (g.get("targets") or []):
            raise ValueError(f"{where}.targets={g.get('targets')!r}: pagedgen runs groups that target 'Linear'")
        w, a = g.get("weights") or {}, g.get("input_activations")
        _check_args(w, f"{where}.weights", ("channel",), dynamic=(False,))
        if a is None:
            raise ValueError(f"{where}.input_activations is null (weight-only int8, W8A16) is not supported yet: pagedgen runs W8A8")
        _check_args(a, f"{where}.input_activations", ("token", "tensor"), dynamic=(True, False))
        if bool(a.get("dynamic")) != (a.get("strategy") == "token"):
            raise ValueError(f"{where}.input_activations: dynamic={a.get('dynamic')} with strategy={a.get('strategy')!r} is not "
                             "supported (dynamic 'token' or static 'tensor')")
        statics.add(not a.get("dynamic"))
    if len(statics) > 1:
        raise ValueError(f"{field}.config_groups mix static and dynamic activation scales: not supported")
    return QuantScheme("compressed-tensors", static_input=statics.pop(), ignore=_ignore_list(qc, "ignore", field))


def _ignore_list(qc: dict, key: str, field: str) -> tuple:
    ignore = qc.get(key) or []
    if not isinstance(ignore, list) or not all(isinstance(e, str) for e in ignore):
        raise ValueError(f"{field}.{key} must be a list of module names, got {ignore!r}")
    return tuple(ignore)


def _float_quantized_scheme(qc: dict, field: str) -> QuantScheme:
    """compressed-tensors ``float-quantized``: FP8 e4m3 weights per channel or per tensor; the
    activations run in the model dtype (W8A16): none, or dynamic per-token FP8 (accepted, not applied)."""
    if qc.get("kv_cache_scheme") is not None:
        raise ValueError(f"{field}.kv_cache_scheme is set: a quantized KV cache from the checkpoint is not supported yet")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ValueError(f"{field}.config_groups is missing or empty")
    blocks = set()
    for gname, g in groups.items():
        where = f"{field}.config_groups.{gname}"
        if "Linear" not in (g.get("targets") or []):
            raise ValueError(f"{where}.targets={g.get('targets')!r}: pagedgen runs groups that target 'Linear'")
        w = g.get("weights") or {}
        _check_args(w, f"{where}.weights", ("channel", "tensor", "block"), dynamic=(False,), kind="float")
        blocks.add(_block(w.get("block_structure"), f"{where}.weights.block_structure") if w.get("strategy") == "block" else ())
        a = g.get("input_activations")
        if a is not None:  # FP8_DYNAMIC's per token, FP8_BLOCK's per group of 128: accepted, run as W8A16
            _check_args(a, f"{where}.input_activations", ("token", "group"), dynamic=(True,), kind="float")
    if len(blocks) > 1:
        raise ValueError(f"{field}.config_groups mix block structures {sorted(blocks)}: not supported")
    return QuantScheme("compressed-tensors", ignore=_ignore_list(qc, "ignore", field), weights="fp8", block=blocks.pop())


def _block(block, where: str) -> tuple:
    """(rows, columns) of a block-wise scale; ValueError naming ``where`` unless two positive ints."""
    if not isinstance(block, (list, tuple)) or len(block) != 2 or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block):
        raise ValueError(f"{where} must be two positive ints [rows, columns] (e.g. [128, 128]), got {block!r}")
    return tuple(block)


def _fp8_scheme(qc: dict, field: str) -> QuantScheme:
    """vLLM's / transformers' ``fp8`` format: per-tensor FP8 e4m3 weights, W8A16."""
    block = qc.get("weight_block_size")
    block = () if block is None else _block(block, f"{field}.weight_block_size")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"{field}.activation_scheme={qc.get('activation_scheme')!r} is not supported: pagedgen runs FP8 "
                         "weights with activations in the model dtype (W8A16), from a 'dynamic' checkpoint")
    if qc.get("kv_cache_scheme") is not None:
        raise ValueError(f"{field}.kv_cache_scheme is set: a quantized KV cache from the checkpoint is not supported yet")
    key = "ignored_layers" if qc.get("ignored_layers") is not None else "modules_to_not_convert"  # vLLM's / transformers' name
    return QuantScheme("fp8", ignore=_ignore_list(qc, key, field), weights="fp8", block=block, block_scale_name="weight_scale_inv")


def _check_args(args: dict, where: str, strategies: tuple, dynamic: tuple, kind: str = "int") -> None:
    for key, allowed in (("num_bits", (8,)), ("type", (kind,)), ("symmetric", (True,)), ("strategy", strategies),
                         ("dynamic", dynamic)):
        if args.get(key, False if key == "dynamic" else None) not in allowed:
            what = ("symmetric 8-bit int weights per channel and activations per token or tensor" if kind == "int" else
                    "symmetric 8-bit float (e4m3) weights per channel or tensor, activations in the model dtype or dynamic per token")
            raise ValueError(f"{where}.{key}={args.get(key)!r} is not supported (allowed: {list(allowed)}): pagedgen runs {what}")


def _checkpoint_names(model: nn.Module, name: str) -> list:
    """The checkpoint module names behind the model's module ``name`` (a fused one's parts)."""
    parts = [k for k, (fused, _) in model.packed_modules_mapping.items() if name.split(".")[-1] == fused]
    names = [name.rsplit(".", 1)[0] + "." + p if "." in name else p for p in parts] or [name]
    return names + [n.split(".", 1)[1] for n in names if n.startswith(model.base_model_prefix + ".")]


def quantized_linears(model: nn.Module, plan: QuantScheme):
    """(name, module) of the linear layers ``plan`` quantizes: every ``LinearBase`` but the ignored
    ones; for a checkpoint, only those HF builds as ``nn.Linear`` (GPT-2's ``Conv1D`` layers stay float)."""
    for name, module in model.named_modules():
        if not isinstance(module, LinearBase):
            continue
        conv1d_stays_float = module.layout == "conv1d" and plan.method not in ("gptq", "awq")  # AutoGPTQ / AutoAWQ pack Conv1D too
        if not plan.online and (conv1d_stays_float or plan.ignores(_checkpoint_names(model, name))):
            continue
        yield name, module


def before_loading(model: nn.Module, plan: Optional[QuantScheme]) -> None:
    """A checkpoint with int8 or FP8 weights: the quantized layers get int8 / float8_e4m3fn parameters
    and their scales (``make_int8_params`` / ``make_fp8_params``) before the plan maps the
    checkpoint's tensors to them."""
    if plan is not None and not plan.online:
        for name, module in quantized_linears(model, plan):
            try:
                if plan.weights == "int4":
                    make_int4_params(module, plan, name)
                elif plan.weights == "fp8":
                    make_fp8_params(module, plan.block, plan.block_scale_name)
                else:
                    make_int8_params(module, plan.static_input)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from exc


def after_loading(model: nn.Module, plan: Optional[QuantScheme]) -> None:
    """Loaded: the scales checked (``finish_int8`` / ``finish_fp8``), or the float weights quantized
    (online "int8" / "fp8")."""
    if plan is None:
        return
    fp8 = plan.weights == "fp8"
    run = (quantize_linear_fp8 if fp8 else quantize_linear_int8) if plan.online else (finish_fp8 if fp8 else finish_int8)
    if plan.weights == "int4":
        run = finish_int4
    for name, module in quantized_linears(model, plan):
        try:
            run(module)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from exc
