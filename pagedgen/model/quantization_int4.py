"""The int4 W4A16 checkpoint formats' ``quantization_config`` (issue 46), read and checked before any
weight is read: GPTQ (``quant_method: "gptq"``), AWQ (``"awq"``, version ``gemm``) and
compressed-tensors ``pack-quantized`` W4A16. Each gives a ``QuantScheme`` with ``weights="int4"``;
the per-layer work (the tensors, their unpacking and the kernel's layout) is
``pagedgen.layers.quant_int4``'s. docs/quantization.md.

    format                 config fields read                                     refused (ValueError naming the field)
    gptq                   bits, group_size, sym, desc_act, checkpoint_format,   bits != 4, a group size not in INT4_GROUP_SIZES,
                           lm_head, dynamic, modules_to_not_convert               desc_act true (act-order), lm_head true,
                                                                                  per-module "dynamic" overrides, another checkpoint_format
    awq                    bits / w_bit, group_size / q_group_size, zero_point,   bits != 4, a group size not allowed, zero_point
                           version, modules_to_not_convert                        false, a version other than "gemm"
    compressed-tensors     config_groups[*].weights (num_bits, type, strategy,    other bits / types / strategies, actorder,
    pack-quantized         group_size, symmetric, dynamic, actorder), ignore      input activations (W4A16 only), groups that
                                                                                  differ in group size or symmetry, kv_cache_scheme
"""
from __future__ import annotations

#: the group sizes the int4 kernel runs (input features per scale); -1: one group per output channel
INT4_GROUP_SIZES = (32, 64, 128, -1)
#: GPTQ's checkpoint formats: "gptq" (v1, AutoGPTQ) stores each zero point minus 1, "gptq_v2" (GPTQModel) as it is
GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}


def _group_size(value, where: str) -> int:
    if isinstance(value, bool) or value not in INT4_GROUP_SIZES:
        raise ValueError(f"{where}={value!r} is not supported (allowed: {list(INT4_GROUP_SIZES)}; -1: per output channel)")
    return int(value)


def _bits(value, where: str) -> None:
    if value != 4 or isinstance(value, bool):
        raise ValueError(f"{where}={value!r} is not supported (allowed: [4]): pagedgen runs int4 W4A16 weights")


def _names(qc: dict, key: str, field: str) -> tuple:
    names = qc.get(key) or []
    if not isinstance(names, list) or not all(isinstance(e, str) for e in names):
        raise ValueError(f"{field}.{key} must be a list of module names, got {names!r}")
    return tuple(names)


def gptq_scheme(qc: dict, field: str, make):
    """GPTQ: qweight packed along the input features; ``make``: QuantScheme's constructor."""
    _bits(qc.get("bits"), f"{field}.bits")
    group = _group_size(qc.get("group_size", 128), f"{field}.group_size")
    if qc.get("desc_act"):
        raise ValueError(f"{field}.desc_act=True (act-order GPTQ) is not supported: pagedgen runs GPTQ checkpoints "
                         "quantized with desc_act=False (their g_idx is k // group_size)")
    if qc.get("lm_head"):
        raise ValueError(f"{field}.lm_head=True is not supported: pagedgen keeps the lm_head in float")
    if qc.get("dynamic"):
        raise ValueError(f"{field}.dynamic (per-module overrides) is not supported")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in GPTQ_FORMATS:
        raise ValueError(f"{field}.checkpoint_format={fmt!r} is not supported (allowed: {list(GPTQ_FORMATS)})")
    sym = qc.get("sym", True)
    return make("gptq", weights="int4", fmt="gptq", group_size=group, symmetric=bool(sym), zero_offset=GPTQ_FORMATS[fmt],
                ignore=_names(qc, "modules_to_not_convert", field))


def awq_scheme(qc: dict, field: str, make):
    """AWQ (AutoAWQ's GEMM version): qweight packed along the output features in AWQ's nibble order."""
    _bits(qc.get("bits", qc.get("w_bit")), f"{field}.bits")
    group = _group_size(qc.get("group_size", qc.get("q_group_size", 128)), f"{field}.group_size")
    if not qc.get("zero_point", True):
        raise ValueError(f"{field}.zero_point=False is not supported: pagedgen runs AWQ with zero points (AutoAWQ's default)")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"{field}.version={qc.get('version')!r} is not supported (allowed: ['gemm'])")
    return make("awq", weights="int4", fmt="awq", group_size=group, symmetric=False,
                ignore=_names(qc, "modules_to_not_convert", field))


def pack_quantized_scheme(qc: dict, field: str, make):
    """compressed-tensors ``pack-quantized`` W4A16: weight_packed [out, in / 8], weight_scale
    [out, groups], weight_zero_point (asymmetric) packed along the output features."""
    if qc.get("kv_cache_scheme") is not None:
        raise ValueError(f"{field}.kv_cache_scheme is set: a quantized KV cache from the checkpoint is not supported yet")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ValueError(f"{field}.config_groups is missing or empty")
    seen = set()
    for gname, g in groups.items():
        where = f"{field}.config_groups.{gname}"
        if "Linear" not in (g.get("targets") or []):
            raise ValueError(f"{where}.targets={g.get('targets')!r}: pagedgen runs groups that target 'Linear'")
        if g.get("input_activations") is not None:
            raise ValueError(f"{where}.input_activations is set: pack-quantized runs as W4A16 (weights only) in pagedgen")
        w = g.get("weights") or {}
        _bits(w.get("num_bits"), f"{where}.weights.num_bits")
        if w.get("type", "int") != "int":
            raise ValueError(f"{where}.weights.type={w.get('type')!r} is not supported (allowed: ['int'])")
        if w.get("dynamic"):
            raise ValueError(f"{where}.weights.dynamic={w.get('dynamic')!r} is not supported (allowed: [False])")
        if w.get("actorder") not in (None, False):
            raise ValueError(f"{where}.weights.actorder={w.get('actorder')!r} (act-order) is not supported (allowed: [None])")
        strategy = w.get("strategy")
        if strategy == "channel":
            group = -1
        elif strategy == "group":
            group = _group_size(w.get("group_size"), f"{where}.weights.group_size")
        else:
            raise ValueError(f"{where}.weights.strategy={strategy!r} is not supported (allowed: ['group', 'channel'])")
        seen.add((group, bool(w.get("symmetric", True))))
    if len(seen) > 1:
        raise ValueError(f"{field}.config_groups mix group sizes or symmetry {sorted(seen)}: not supported")
    group, sym = seen.pop()
    return make("compressed-tensors", weights="int4", fmt="pack-quantized", group_size=group, symmetric=sym,
                ignore=_names(qc, "ignore", field))
