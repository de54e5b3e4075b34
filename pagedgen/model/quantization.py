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

The lm_head, the embeddings and the modules of compressed-tensors' ``ignore`` list stay in float.
Everything else vLLM names (fp8, awq, gptq, other compressed-tensors formats) is refused with a
ValueError naming the field, as are configs pagedgen cannot honour (asymmetric, other bit widths,
group strategies, a KV-cache scheme).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from torch import nn

from pagedgen.layers.linear import LinearBase
from pagedgen.layers.quant import finish_int8, make_int8_params, quantize_linear_int8

#: the values of ``LLM(quantization=...)`` pagedgen runs
QUANTIZATION_METHODS = ("int8", "compressed-tensors")
#: vLLM's names pagedgen knows but does not run yet (a clear error instead of "unknown")
NOT_YET = ("fp8", "awq", "gptq", "awq_marlin", "gptq_marlin", "bitsandbytes", "gguf", "modelopt", "marlin")


@dataclass(frozen=True)
class QuantScheme:
    """How a model's linear layers are quantized.

    Attributes:
        method: "int8" (online, from a float checkpoint) or "compressed-tensors" (int8 in the checkpoint).
        static_input: activations use the checkpoint's static per-tensor ``input_scale`` (else dynamic per row).
        ignore: compressed-tensors' ``ignore`` entries: module names, or ``re:`` regexes over them.
    """

    method: str
    static_input: bool = False
    ignore: tuple = ()

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
            checkpoint does not have, "int8" on a checkpoint that is already quantized, or a
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
            what = "a float checkpoint" if q == "int8" else "this checkpoint"
            raise ValueError(f"LLM quantization={quantization!r} does not fit the checkpoint: its config.json has "
                             f"quantization_config.quant_method={saved!r} (quantization={q!r} needs {what}); pass quantization=None")
        if q == "compressed-tensors" and saved is None:
            raise ValueError("LLM quantization='compressed-tensors' needs a checkpoint whose config.json has a quantization_config; "
                             "for a float checkpoint pass quantization='int8'")
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
    if method == "int8":
        return QuantScheme("int8")
    qc = hf_config.quantization_config
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    field = "config.json quantization_config"
    fmt = qc.get("format")
    if fmt != "int-quantized":
        raise ValueError(f"{field}.format={fmt!r} is not supported yet (issue 46): pagedgen runs compressed-tensors 'int-quantized' (W8A8 int8)")
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
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(e, str) for e in ignore):
        raise ValueError(f"{field}.ignore must be a list of module names, got {ignore!r}")
    return QuantScheme("compressed-tensors", static_input=statics.pop(), ignore=tuple(ignore))


def _check_args(args: dict, where: str, strategies: tuple, dynamic: tuple) -> None:
    for key, allowed in (("num_bits", (8,)), ("type", ("int",)), ("symmetric", (True,)), ("strategy", strategies),
                         ("dynamic", dynamic)):
        if args.get(key, False if key == "dynamic" else None) not in allowed:
            raise ValueError(f"{where}.{key}={args.get(key)!r} is not supported (allowed: {list(allowed)}): pagedgen runs "
                             "symmetric 8-bit int weights per channel and activations per token or tensor")


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
        if plan.method == "compressed-tensors" and (module.layout == "conv1d" or plan.ignores(_checkpoint_names(model, name))):
            continue
        yield name, module


def before_loading(model: nn.Module, plan: Optional[QuantScheme]) -> None:
    """A checkpoint with int8 weights: the quantized layers get int8 parameters and their scales
    (``make_int8_params``) before the plan maps the checkpoint's tensors to them."""
    if plan is not None and plan.method == "compressed-tensors":
        for _, module in quantized_linears(model, plan):
            make_int8_params(module, plan.static_input)


def after_loading(model: nn.Module, plan: Optional[QuantScheme]) -> None:
    """Loaded: the scales checked (``finish_int8``), or the float weights quantized (online "int8")."""
    if plan is None:
        return
    for name, module in quantized_linears(model, plan):
        try:
            finish_int8(module) if plan.method == "compressed-tensors" else quantize_linear_int8(module)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from exc
