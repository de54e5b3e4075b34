"""int4 W4A16 weights of the linear layers (issue 46): the per-layer half of GPTQ, AWQ and
compressed-tensors ``pack-quantized`` checkpoints (``pagedgen.model.quantization_int4`` reads their
config). The real weight is ``W[n, k] = (q[n, k] - z[n, k // g]) * s[n, k // g]`` with 4-bit codes
q in [0, 15], a zero point z and a scale s per output n and group of g input features.

The checkpoint layouts (each part of a fused q/k/v or gate/up layer stores its own tensors, side
by side along the output features N once unpacked; K input features, G = K / g groups):

    format          tensor                dtype  shape           packing (8 codes per int32, code i at bits 4i..4i+3)
    gptq            qweight               I32    [K / 8, N]      along K: word r holds k = 8 r + i
                    qzeros                I32    [G, N / 8]      along N: word c holds n = 8 c + i; "gptq" (v1)
                                                                 stores z - 1 (zero_offset 1), "gptq_v2" z
                    scales                F16    [G, N]
                    g_idx                 I32    [K]             must be k // g (act-order is refused)
    awq             qweight               I32    [K, N / 8]      along N in AWQ's order: word c, code i holds
                                                                 n = 8 c + [0, 2, 4, 6, 1, 3, 5, 7][i]
                    qzeros                I32    [G, N / 8]      the same order
                    scales                F16    [G, N]
    pack-quantized  weight_packed         I32    [N, K / 8]      along K; codes are the signed value + 8
                    weight_scale          float  [N, G]          (G = 1 per channel)
                    weight_zero_point     I32    [N / 8, G]      along N, signed zero + 8 (asymmetric only; z = 8
                                                                 when symmetric)
                    weight_shape          I32    [2]             must be [N, K]

While loading, a quantized ``LinearBase`` holds each tensor unpacked, output-major and sharded
like a float weight's rows (column-parallel) or columns (row-parallel, whole groups per rank):
codes uint8 [N, K], scales float32 [N, G], zeros uint8 [N, G], under the checkpoint's names (so
the loader's plan maps them). ``finish_int4`` then repacks them once for the kernel and frees them:

- ``weight``: [ceil(N / 16), K, 8] uint8, ``weight[p, k, b] = q[16 p + b, k] | q[16 p + b + 8, k] << 4``
  (``pack_int4``; zeros past N): half a byte per weight;
- ``weight_scale``: [ceil(N / 16), G, 16] float32 (G = ceil(K / g): the last group may be partial) and ``weight_zero``: [ceil(N / 16), G, 16] uint8;
- ``int4_group``: g (K for one group per channel);

and its forward runs ``pagedgen.layers.matmul.int4_linear`` (``ops.int4_linear``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedgen.layers.linear import LinearBase
from pagedgen.layers.loading import check_shape, read

PANEL = 16  # outputs per panel of the kernel's layout
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ packs column AWQ_ORDER[i] of each 8 into code i
_FLOATS = ("F16", "BF16", "F32")


def unpack_int32(packed: torch.Tensor, dim: int, order=None) -> torch.Tensor:
    """int32 words holding 8 4-bit codes each (code i at bits 4i..4i+3) -> uint8 codes, the packed
    dimension ``dim`` (0 or 1 of a 2-D tensor) 8 times longer; with ``order``, code i of word c is
    element 8 c + order[i] (AWQ)."""
    x = packed.to(torch.int32)
    x = x if dim == 1 else x.t()
    codes = (x.unsqueeze(-1) >> _SHIFTS.to(x.device)) & 0xF  # [R, C, 8]: code i of each word
    if order is not None:
        codes = codes[..., [list(order).index(j) for j in range(8)]]  # element j = code order.index(j)
    codes = codes.reshape(x.shape[0], -1).to(torch.uint8)
    return codes if dim == 1 else codes.t()


def pack_int32(codes: torch.Tensor, dim: int, order=None) -> torch.Tensor:
    """The inverse of ``unpack_int32`` (tests write checkpoints with it): uint8 / int codes in
    [0, 15], ``dim``'s size a multiple of 8 -> int32 words."""
    x = codes.to(torch.int64)
    x = x if dim == 1 else x.t()
    x = x.reshape(x.shape[0], -1, 8)
    if order is not None:
        x = x[..., list(order)]  # code i = element order[i]
    words = (x << _SHIFTS.to(torch.int64)).sum(-1)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    return words if dim == 1 else words.t().contiguous()


def _gptq(zero_offset: int) -> dict:
    return {
        "qweight": ("codes", ("I32",), lambda n, k, g: (-(-k // 8), n), lambda t, n, k, g: unpack_int32(t, 0)[:k].t()),
        "qzeros": ("zeros", ("I32",), lambda n, k, g: (g, -(-n // 8)),
                   lambda t, n, k, g: (unpack_int32(t, 1)[:, :n].t() + zero_offset).to(torch.uint8)),
        "scales": ("scales", _FLOATS, lambda n, k, g: (g, n), lambda t, n, k, g: t.float().t()),
        "g_idx": ("g_idx", ("I32", "I64"), lambda n, k, g: (k,), None),
    }


_AWQ = {
    "qweight": ("codes", ("I32",), lambda n, k, g: (k, -(-n // 8)), lambda t, n, k, g: unpack_int32(t, 1, AWQ_ORDER)[:, :n].t()),
    "qzeros": ("zeros", ("I32",), lambda n, k, g: (g, -(-n // 8)), lambda t, n, k, g: unpack_int32(t, 1, AWQ_ORDER)[:, :n].t()),
    "scales": ("scales", _FLOATS, lambda n, k, g: (g, n), lambda t, n, k, g: t.float().t()),
}

_PACK_QUANTIZED = {
    "weight_packed": ("codes", ("I32",), lambda n, k, g: (n, -(-k // 8)), lambda t, n, k, g: unpack_int32(t, 1)[:, :k]),
    "weight_scale": ("scales", _FLOATS, lambda n, k, g: (n, g), lambda t, n, k, g: t.float()),
    "weight_zero_point": ("zeros", ("I32",), lambda n, k, g: (-(-n // 8), g), lambda t, n, k, g: unpack_int32(t, 0)[:n]),
    "weight_shape": ("shape", ("I32", "I64"), lambda n, k, g: (2,), None),
    "weight_g_idx": ("g_idx", ("I32", "I64"), lambda n, k, g: (k,), None),
}

_OPTIONAL = ("g_idx", "shape")  # checked when the checkpoint has them, not stored


def _tensors(plan) -> dict:
    specs = {"gptq": _gptq(plan.zero_offset), "awq": _AWQ, "pack-quantized": dict(_PACK_QUANTIZED)}[plan.fmt]
    if plan.fmt == "pack-quantized" and plan.symmetric:
        del specs["weight_zero_point"]
    return specs


def _global_sizes(module: LinearBase, shard_id) -> tuple[int, int]:
    """(rows of the part ``shard_id`` or the whole layer, input features K), as the checkpoint has them."""
    if shard_id is not None and shard_id not in module.global_output_shards:
        raise KeyError(f"unknown shard {shard_id!r} (this layer has {list(module.global_output_shards)})")
    rows = module.global_output_size if shard_id is None else module.global_output_shards[shard_id]
    return rows, module.input_size * (module.tp.size if module.tp_split == "in" else 1)


def _loader(module: LinearBase, kind: str, shape, convert, group: int, where: str):
    """The weight loader of one checkpoint tensor: its shape checked against the layer's global
    sizes, then unpacked whole to output-major [rows, K or G] (``convert``), GPT-NeoX's interleaved
    heads reordered, and this rank's rows (column-parallel) or columns (row-parallel) copied into
    place. ``group`` -1: one group per output channel (a row-parallel rank keeps the whole scale)."""
    def load(param: nn.Parameter, loaded, shard_id=None) -> None:
        rows, k = _global_sizes(module, shard_id)
        groups = 1 if group == -1 else -(-k // group)
        per_channel = group == -1
        if not check_shape(loaded, shape(rows, k, groups)):  # WeightShapeError naming both shapes; False: the dry run
            return
        data = read(loaded)
        if kind == "g_idx":
            if not torch.equal(data.long(), torch.arange(k) // (k if per_channel else group)):
                raise ValueError(f"{where}: g_idx is not k // group_size (an act-order / desc_act checkpoint): not supported")
            return
        if kind == "shape":
            if data.tolist() != [rows, k]:
                raise ValueError(f"{where}: weight_shape is {data.tolist()}, but config.json implies {[rows, k]}")
            return
        full = convert(data, rows, k, groups)  # [rows, K or G]
        if module.layout == "interleaved_qkv":  # [heads, 3, head_size] rows -> q heads | k heads | v heads
            heads = rows // (3 * module.head_size)
            full = full.reshape(heads, 3, module.head_size, -1).transpose(0, 1).reshape(full.shape)
        if module.tp_split == "in" and not (per_channel and kind in ("scales", "zeros")):
            cols = param.shape[1]
            full = full.narrow(1, module.tp.rank * cols, cols)
        rank = module.tp.rank if module.tp_split == "out" else 0
        parts = [shard_id] if shard_id is not None else (list(module.output_shards) or [None])
        g_off = 0
        with torch.no_grad():
            for sid in parts:
                l_off, l_size = module._shard_slice(sid)
                param.narrow(0, l_off, l_size).copy_(full.narrow(0, g_off + rank * l_size, l_size))
                if shard_id is None and sid is not None:
                    g_off += module.global_output_shards[sid]
    return load


def make_int4_params(module: LinearBase, plan, name: str = "") -> None:
    """Give ``module`` (built on the meta device, not loaded; ``name``: its name, for the errors its
    tensors raise while loading) the load-time parameters of an int4 checkpoint in ``plan.fmt`` (the
    module docstring), named as the checkpoint names them.

    Raises:
        ValueError: the group size does not divide this rank's input features (a tensor-parallel
            split that would cut a group, or a layer narrower than a group).
    """
    k = module.input_size
    group = k if plan.group_size == -1 else plan.group_size  # per channel: this rank's input features, one scale
    if module.tp_split == "in" and k % group:
        raise ValueError(f"group_size={plan.group_size} does not divide this rank's {k} input features: tensor_parallel_size="
                         f"{module.tp.size} cuts a group (use one whose shards hold whole groups)")
    groups = -(-k // group)  # the last one may be partial (K not a multiple of the group size)
    old = module.weight
    module.weight = None  # until finish_int4 packs the codes (the bias's loader still compares against it)
    module.int4_load = {}
    shapes = {"codes": ((module.output_size, k), torch.uint8), "scales": ((module.output_size, groups), torch.float32),
              "zeros": ((module.output_size, groups), torch.uint8), "g_idx": ((0,), torch.int32), "shape": ((0,), torch.int32)}
    for tensor, (kind, dtypes, shape, convert) in _tensors(plan).items():
        size, dtype = shapes[kind]
        p = nn.Parameter(torch.empty(size, dtype=dtype, device=old.device), requires_grad=False)
        p.load_dtype = dtype  # kept by pagedgen.model.weights.materialize
        p.checkpoint_dtypes = dtypes  # the safetensors dtypes the plan accepts
        p.optional = kind in _OPTIONAL
        p.shard_ids = getattr(old, "shard_ids", ())
        p.weight_loader = _loader(module, kind, shape, convert, plan.group_size, name or "a layer")
        if tensor in module._parameters:
            del module._parameters[tensor]  # weight_scale: LinearBase's None placeholder
        module.register_parameter(tensor, p)
        module.int4_load[kind] = tensor
    module.int4_group = group


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] in [0, 15] -> the kernel's [ceil(N / 16), K, 8] uint8: ``out[p, k, b] =
    codes[16 p + b, k] | codes[16 p + b + 8, k] << 4`` (zeros past N)."""
    n, k = codes.shape
    c = F.pad(codes.to(torch.uint8), (0, 0, 0, -n % PANEL)).view(-1, PANEL, k).transpose(1, 2)  # [P, K, 16]
    return (c[..., :8] | (c[..., 8:] << 4)).contiguous()


def pack_groups(t: torch.Tensor) -> torch.Tensor:
    """A per-group tensor [N, G] -> [ceil(N / 16), G, 16] (zeros past N)."""
    n, g = t.shape
    return F.pad(t, (0, 0, 0, -n % PANEL)).view(-1, PANEL, g).transpose(1, 2).contiguous()


def unpack_int4(weight: torch.Tensor, weight_scale: torch.Tensor, weight_zero: torch.Tensor, group: int, n: int) -> torch.Tensor:
    """The real [N, K] float32 weight of the kernel's layout: ``float32(q - z) * s`` (one float32
    rounding), as ``ops.int4_linear``'s kernel computes each weight."""
    p, k, _ = weight.shape
    codes = torch.cat([weight & 0xF, weight >> 4], dim=2).transpose(1, 2).reshape(p * PANEL, k)[:n].to(torch.int32)
    s = weight_scale.transpose(1, 2).reshape(p * PANEL, -1)[:n].repeat_interleave(group, dim=1)[:, :k]
    z = weight_zero.transpose(1, 2).reshape(p * PANEL, -1)[:n].to(torch.int32).repeat_interleave(group, dim=1)[:, :k]
    return (codes - z).float() * s


def finish_int4(module: LinearBase) -> None:
    """After loading: the unpacked codes, scales and zeros repacked for the kernel (``pack_int4``,
    ``pack_groups``) and the load-time parameters freed.

    Raises:
        ValueError: a scale that is not finite, or a zero point past 16.
    """
    names = module.int4_load
    codes = getattr(module, names["codes"]).detach()
    scales = getattr(module, names["scales"]).detach()
    zeros = getattr(module, names["zeros"]).detach() if "zeros" in names else torch.full_like(scales, 8, dtype=torch.uint8)
    if not bool(torch.isfinite(scales).all()):
        raise ValueError("a scale of the checkpoint is not finite")
    if zeros.numel() and int(zeros.max()) > 16:
        raise ValueError(f"a zero point of the checkpoint is {int(zeros.max())} (a 4-bit zero point is at most 15, 16 in GPTQ's v1 format)")
    for name in names.values():
        delattr(module, name)
    module.weight = nn.Parameter(pack_int4(codes), requires_grad=False)
    module.weight_scale = nn.Parameter(pack_groups(scales), requires_grad=False)
    module.weight_zero = nn.Parameter(pack_groups(zeros), requires_grad=False)
    del module.int4_load
