"""FP8 weights of the linear layers, W8A16 (issue 46): the per-layer half of ``LLM(quantization="fp8")``
and of FP8 checkpoints (``pagedgen.model.quantization`` decides which layers and reads the config).

A quantized ``LinearBase`` holds

- ``weight``: ``torch.float8_e4m3fn`` (1 byte per weight), symmetric: [out, in] while loading; then,
  where pagedgen._C has the ``fp8_linear`` kernel for the weight's device, packed once in panels of
  16 outputs, [ceil(out / 16), in, 16] (``pack_fp8``: the packed copy replaces the [out, in] one);
- ``weight_scale``: [out] float32, ``W[n, :] = float32(weight[n, :]) * weight_scale[n]`` (a
  checkpoint's per-tensor scale is repeated over the rows of its part: exact, and a fused q/k/v or
  gate/up layer keeps each part's own scale); or, for block-wise checkpoints (``weight_block_size``
  [bn, bk], one ``weight_scale_inv`` per bn x bk block), [out, ceil(in / bk)] float32: each block
  row repeated over its bn rows at load (``W[n, k] = weight[n, k] * weight_scale[n, k // bk]``),
  and ``weight_block_k = bk``;
- ``input_scale``: None (activations stay in the model dtype: W8A16);

and its forward runs ``pagedgen.layers.matmul.fp8_linear``: a packed weight goes to ``ops.fp8_linear``
(csrc/cpu/linear_fp8.cpp: the codes converted to float32 in registers, each output a float32 sum
over k in order: batch-invariant by construction); an unpacked one (no kernel: a GPU, or no AVX2) is
dequantized to the activations' dtype and run by the model's float GEMM (``linear``, in the row
blocks of its ``MatmulConfig``: batch-invariant as the float model is). The bias stays in the model dtype.

Two ways in: ``make_fp8_params`` before loading a checkpoint that stores FP8 weights
(compressed-tensors ``float-quantized``: ``weight`` F8_E4M3 [out, in] and ``weight_scale`` [out, 1]
per channel or [1] / [] per tensor; vLLM's ``fp8`` format: ``weight`` F8_E4M3 and a per-tensor
``weight_scale``), then ``finish_fp8``; and ``quantize_linear_fp8`` after loading a float checkpoint
(online ``quantization="fp8"``, per output channel). Both end with ``pack_linear_fp8``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedgen import ops
from pagedgen.layers.linear import LinearBase
from pagedgen.layers.loading import read
from pagedgen.layers.loading import check_shape
from pagedgen.layers.quant import _flat_scale, _param, quantize_linear_int8

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
PANEL = 16  # outputs per panel of the kernel's layout
#: the kernel reads a code as float16 = value * 2^-8 and multiplies by scale * 2^8 (csrc/cpu/linear_fp8.cpp)
SCALE_LIMIT = torch.finfo(torch.float32).max / 256


def quantize_weight_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel FP8 (e4m3) quantization of a [N, K] float weight (llm-compressor's
    FP8 "channel" strategy, minmax observer): in float32, ``scale[n] = max_k |W[n, k]| / 448`` (1 for
    an all-zero row), ``q = float8_e4m3fn(clamp(W / scale, -448, 448))`` (round to nearest even).
    Returns (q [N, K] float8_e4m3fn, scale [N] float32).

    Raises:
        ValueError: ``weight`` is not a 2-D floating-point tensor, or has a value that is not finite.
    """
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"quantize_weight_fp8 needs a 2-D floating-point weight, got {getattr(weight, 'dtype', type(weight))} "
                         f"{tuple(getattr(weight, 'shape', ()))}")
    w = weight.detach().float()
    if not bool(torch.isfinite(w).all()):
        raise ValueError("quantize_weight_fp8: the weight has a value that is not finite")
    scale = w.abs().amax(dim=1) / FP8_MAX if w.shape[1] else w.new_ones(w.shape[0])
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def _scale_loader(module: LinearBase, loader):
    """The loader of ``weight_scale``: a per-channel scale ([N, 1] or [N]) goes through the layer's own
    loader (fused parts, tensor-parallel shards); a per-tensor one ([1] or []) is repeated over the
    rows of its part first. Other shapes raise WeightShapeError naming them."""
    def load(param: nn.Parameter, loaded, shard_id=None) -> None:
        if tuple(loaded.shape) in ((), (1,)):
            rows = module.global_output_size if shard_id is None else module.global_output_shards.get(shard_id, 0)
            if shard_id is not None and shard_id not in module.global_output_shards:
                raise KeyError(f"unknown shard {shard_id!r} (this layer has {list(module.global_output_shards)})")
            if loaded.is_meta:  # the dry run: shapes only
                loaded = torch.empty(rows, dtype=torch.float32, device="meta")
            else:  # tiny: read whole and repeated (the tensor-parallel loader narrows it like a per-channel one)
                loaded = read(loaded).float().reshape(1).expand(rows).contiguous()
        loader(param, _flat_scale(loaded, module), shard_id)
    return load


def _block_scale_loader(module: LinearBase, bn: int, bk: int):
    """The loader of a block-wise ``weight_scale_inv`` [ceil(rows / bn), ceil(in / bk)] of one part
    (or the whole layer): its block rows repeated over their bn rows, then this rank's rows (a
    column-parallel layer) or block columns (a row-parallel one) copied into place."""
    def load(param: nn.Parameter, loaded, shard_id=None) -> None:
        if shard_id is not None and shard_id not in module.global_output_shards:
            raise KeyError(f"unknown shard {shard_id!r} (this layer has {list(module.global_output_shards)})")
        rows = module.global_output_size if shard_id is None else module.global_output_shards[shard_id]
        cols = module.input_size * (module.tp.size if module.tp_split == "in" else 1)
        if not check_shape(loaded, (-(-rows // bn), -(-cols // bk))):  # WeightShapeError naming the shapes
            return
        full = read(loaded).float().repeat_interleave(bn, dim=0)[:rows]  # [rows, ceil(cols / bk)]
        if module.tp_split == "in":
            kb = module.input_size // bk
            full = full.narrow(1, module.tp.rank * kb, kb)
        parts = [shard_id] if shard_id is not None else (list(module.output_shards) or [None])
        g_off = 0
        with torch.no_grad():
            for sid in parts:
                l_off, l_size = module._shard_slice(sid)
                start = g_off + (module.tp.rank * l_size if module.tp_split == "out" else 0)
                param.narrow(0, l_off, l_size).copy_(full.narrow(0, start, l_size))
                if shard_id is None and sid is not None:
                    g_off += module.global_output_shards[sid]
    return load


def _check_blocks(module: LinearBase, bn: int, bk: int) -> None:
    """ValueError unless ``module``'s fused parts and tensor-parallel shards fall on whole blocks."""
    if module.layout != "default":
        raise ValueError(f"block-wise FP8 scales on a {module.layout!r} layer are not supported")
    parts = list(module.global_output_shards.values()) if len(module.global_output_shards) > 1 else []
    if any(p % bn for p in parts):
        raise ValueError(f"weight_block_size rows {bn} do not divide the fused parts {parts}: their scale blocks would straddle two parts")
    if module.tp_split == "out" and any(s % bn for s in (list(module.output_shards.values()) or [module.output_size])):
        raise ValueError(f"weight_block_size rows {bn} do not divide this rank's output rows {module.output_size}: "
                         "use a tensor_parallel_size whose shards fall on whole blocks")
    if module.tp_split == "in" and module.input_size % bk:
        raise ValueError(f"weight_block_size columns {bk} do not divide this rank's input features {module.input_size}: "
                         "use a tensor_parallel_size whose shards fall on whole blocks")


def make_fp8_params(module: LinearBase, block: tuple = (), block_scale_name: str = "weight_scale_inv") -> None:
    """Give ``module`` (built on the meta device, not loaded) the parameters of an FP8 checkpoint:
    ``weight`` float8_e4m3fn (loaded by the layer's own loader: fused parts, tensor-parallel shards)
    and ``weight_scale`` [out] float32 (per channel, or a part's per-tensor scale repeated over its
    rows; sharded with the rows, whole on a row-parallel layer). With ``block`` (bn, bk): the
    checkpoint's block scales (named ``block_scale_name``: fp8's ``weight_scale_inv``,
    compressed-tensors' ``weight_scale``) instead, held as [out, ceil(in / bk)] (the module
    docstring); ValueError when fused parts or shards do not fall on whole blocks."""
    loader = module.weight_loader if module.tp is None else module.sharded_weight_loader
    old = module.weight
    if block:
        _check_blocks(module, *block)
    module.weight = _param(tuple(old.shape), FP8_DTYPE, old)
    module.weight.weight_loader = loader
    if block:
        bn, bk = block
        scale = _param((module.output_size, -(-module.input_size // bk)), torch.float32, old)
        scale.weight_loader = _block_scale_loader(module, bn, bk)
        setattr(module, block_scale_name, scale)  # the checkpoint's name; finish_fp8 makes it weight_scale
        module.weight_block_k = bk
        return
    scale = _param((module.output_size,), torch.float32, old)
    scale.weight_loader = _scale_loader(module, loader)
    module.weight_scale = scale


def finish_fp8(module: LinearBase) -> None:
    """After loading: ValueError for a ``weight_scale`` that is not finite and > 0 (or so large that
    scale * 2^8 overflows float32: above ~1.3e36, never a real checkpoint's), or an FP8 weight that
    holds a NaN (e4m3fn has no infinities). A block-wise ``weight_scale_inv`` becomes
    ``weight_scale``. Then the weight is packed for the kernel (``pack_linear_fp8``)."""
    if getattr(module, "weight_scale_inv", None) is not None:
        module.weight_scale = module.weight_scale_inv
        del module.weight_scale_inv
    s = module.weight_scale
    if not bool(torch.isfinite(s).all() and (s > 0).all() and (s <= SCALE_LIMIT).all()):
        raise ValueError(f"a weight_scale of the checkpoint is not finite and > 0, or above {SCALE_LIMIT:.3g} "
                         f"(min {float(s.min())}, max {float(s.max())})")
    if _has_nan(module.weight):
        raise ValueError("the FP8 weight of the checkpoint holds a NaN")
    pack_linear_fp8(module)


def _has_nan(codes: torch.Tensor) -> bool:
    """Whether float8_e4m3fn ``codes`` hold a NaN (the bytes 0x7f and 0xff)."""
    return bool(((codes.view(torch.uint8) & 0x7F) == 0x7F).any())


def pack_fp8(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] float8_e4m3fn codes -> the kernel's [ceil(N / 16), K, 16] float8_e4m3fn panels:
    ``out[p, k, j] = weight[16 p + j, k]``, zeros past N (the layout ``ops.fp8_linear`` reads: one
    16-byte panel row per input feature).

    Raises:
        ValueError: ``weight`` is not a 2-D float8_e4m3fn tensor, or holds a NaN (0x7f / 0xff: the
            kernel would read it as +-480).
    """
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.dtype != FP8_DTYPE:
        raise ValueError(f"pack_fp8 needs a 2-D float8_e4m3fn weight, got {getattr(weight, 'dtype', type(weight))} "
                         f"{tuple(getattr(weight, 'shape', ()))}")
    if _has_nan(weight):
        raise ValueError("pack_fp8: the FP8 weight holds a NaN (code 0x7f or 0xff)")
    n, k = weight.shape
    b = F.pad(weight.detach().view(torch.uint8), (0, 0, 0, -n % PANEL))  # [P * 16, K] bytes
    return b.view(-1, PANEL, k).transpose(1, 2).contiguous().view(FP8_DTYPE)  # [P, K, 16]


def unpack_fp8(weight: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of ``pack_fp8``: [P, K, 16] panels -> the [n, K] float8_e4m3fn codes."""
    p, k, _ = weight.shape
    return weight.view(torch.uint8).transpose(1, 2).reshape(p * PANEL, k)[:n].contiguous().view(FP8_DTYPE)


def pack_linear_fp8(module: LinearBase) -> int:
    """``module``'s [out, in] FP8 weight packed in panels (``pack_fp8``) where pagedgen._C has the
    ``fp8_linear`` kernel for its device; else left as it is (``fp8_linear`` then dequantizes it into
    the float GEMM). The packed copy replaces the old one. Returns the bytes added (the zero rows that
    pad the last panel)."""
    w = module.weight
    if w.dim() != 2 or not ops.has_kernel("fp8_linear", w.device.type):
        return 0
    module.weight = nn.Parameter(pack_fp8(w), requires_grad=False)
    return module.weight.numel() - w.numel()


def quantize_linear_fp8(module: LinearBase) -> int:
    """Online quantization of a loaded float ``module`` (``quantize_weight_fp8``), then packed for the
    kernel (``pack_linear_fp8``). Returns the bytes the weights took in addition (negative: saved)."""
    extra = quantize_linear_int8(module, quantize_weight_fp8)  # the same swap, 1-byte e4m3 weights
    return extra + pack_linear_fp8(module)
