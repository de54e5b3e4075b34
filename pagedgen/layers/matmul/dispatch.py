"""``linear``: the single point through which every matmul of every model runs. A weight packed in
panels or bf16 pairs goes to pagedgen's kernel for it; a dense or oneDNN-prepacked weight runs in the
row blocks of the model's ``MatmulConfig`` (``config``), converted to its weight dtype and back.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from pagedgen import ops
from pagedgen.layers.matmul.config import MatmulConfig
from pagedgen.layers.matmul.packing import pack_int8, pack_pairs, pack_panels


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """[m, K] rows times a ``prepack``-ed [N, K] weight of their dtype -> [m, N] (oneDNN)."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")


def _gemm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], min_rows: int) -> torch.Tensor:
    """One GEMM block of [m, K] rows, run with at least ``min_rows`` rows (zero rows added): oneDNN
    for a prepacked weight, else ``F.linear`` (MKL, or oneDNN's bf16)."""
    run = _onednn_linear if weight.is_mkldnn else F.linear
    m = x.shape[0]
    if m >= min_rows:
        return run(x, weight, bias)
    return run(F.pad(x, (0, 0, 0, min_rows - m)), weight, bias)[:m]  # via [min_rows, K]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, config: Optional[MatmulConfig] = None,
           out_features: Optional[int] = None) -> torch.Tensor:
    """``y = x @ weight.T + bias``: the one function every matmul of a model goes through.

    Args:
        x: [T, in_features] activations (model dtype).
        weight: [out_features, in_features], the model dtype or ``config.weight_dtype`` (then x is
            converted to it and the result back to x's dtype, rounded once); dense, or
            ``prepack``-ed for oneDNN (float32, or bf16 on a CPU with oneDNN bf16); or
            [ceil(out_features / PANEL), in_features, PANEL] panels (``pack_panels``), run by
            ``ops.packed_linear`` in float32 whatever the dtypes; or bf16 pairs [ceil(out_features /
            PANEL), ceil(in_features / 2), PANEL, 2] (``pack_pairs``, bf16 x only), run by
            ``ops.packed_linear_bf16``.
        bias: [out_features] or None, the weight's dtype.
        config: the model's MatmulConfig (None: a plain ``F.linear``, no row padding).
        out_features: N; needed for a panel-packed weight, whose shape rounds it up to PANEL.

    Returns:
        [T, out_features] in x's dtype.

    Raises:
        ValueError: a panel-packed weight without ``out_features``.
    """
    if weight.dim() in (3, 4):  # packed panels / pairs: batch-invariant by construction, no row blocks
        if out_features is None:
            raise ValueError("linear: a weight packed in panels needs out_features")
        out = torch.empty(x.shape[0], out_features, dtype=x.dtype, device=x.device)  # [T, N]
        if weight.dim() == 3:
            run = ops.packed_linear
        else:
            run = torch.ops.pagedgen.packed_linear_bf16_amx if config is not None and config.amx else ops.packed_linear_bf16
        run(out, x if x.stride(-1) == 1 else x.contiguous(), weight, bias)
        return out
    out_dtype = x.dtype
    if weight.dtype != out_dtype:
        x = x.to(weight.dtype)
    if config is None or not config.batch_invariant or x.shape[0] == 0:
        y = _gemm(x, weight, bias, 0)
    else:
        min_rows, max_rows = config.row_blocks(weight)
        if max_rows and x.shape[0] > max_rows:
            y = torch.cat([_gemm(part, weight, bias, min_rows) for part in x.split(max_rows)])
        else:
            y = _gemm(x, weight, bias, min_rows)
    return y if y.dtype == out_dtype else y.to(out_dtype)


def int8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: Optional[torch.Tensor] = None,
                bias: Optional[torch.Tensor] = None, out_features: Optional[int] = None,
                config: Optional[MatmulConfig] = None) -> torch.Tensor:
    """W8A8: ``y = x @ (weight * weight_scale[:, None]).T + bias`` with x's rows quantized to int8
    (per row, or by the static ``input_scale``), exact int32 sums and one float32 scale per output
    (``ops.int8_linear``, the AVX2 tiles; from ``config.int8_amx_min_rows`` rows the AMX-INT8 tiles,
    ``int8_linear_amx``, with the same bits: batch-invariant by construction, no row blocks).

    Args:
        x: [T, K] activations (float32, bfloat16 or float16).
        weight: [N, K] int8 (packed here on each call: slow), or packed by ``pack_int8`` (what
            ``prepare_matmuls`` does once after loading).
        weight_scale: [N] float32; input_scale: [1] float32 or None (dynamic per-row scales).
        bias: [N] or None (x's dtype or float32).
        out_features: N (default: the weight's rows).
        config: the model's MatmulConfig (None: the AVX2 tiles at every M).

    Returns:
        [T, N] in x's dtype.
    """
    n = out_features if out_features is not None else weight.shape[0]
    if weight.dim() == 2:
        weight = pack_int8(weight)
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)  # [T, N]
    amx = config is not None and 0 < config.int8_amx_min_rows <= x.shape[0]
    run = torch.ops.pagedgen.int8_linear_amx if amx else ops.int8_linear
    run(out, x if x.stride(-1) == 1 else x.contiguous(), weight, weight_scale, input_scale, bias)
    return out


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: Optional[torch.Tensor] = None,
               config: Optional[MatmulConfig] = None, block_k: int = 0) -> torch.Tensor:
    """FP8 W8A16: ``y = x @ (float32(weight) * weight_scale[:, None]).T + bias`` (block-wise scales:
    ``weight_scale[n, k // block_k]`` for ``weight[n, k]``).

    A weight packed in panels (``pagedgen.layers.quant_fp8.pack_fp8``, what loading does where the
    kernel exists) runs ``ops.fp8_linear``: each weight ``float32(code) * scale`` (one float32
    rounding) converted in the kernel's registers, each output a float32 sum over k in order, + bias,
    rounded once to x's dtype (batch-invariant by construction; in float32 the bits of pagedgen's
    panel GEMM on the fake-quantized weights). An [N, K] weight (no kernel: a GPU, no AVX2) is
    dequantized on each call in float32, rounded once more to the model's weight dtype
    (``config.weight_dtype``, else x's) and laid out as the float model's weights are (``config``:
    panels / bf16 pairs for pagedgen's own GEMMs, else dense in the row blocks), then ``linear`` runs
    it: the float model's GEMM, so as batch-invariant as the float model is; only the 1-byte weight
    stays resident, the dequantized copy lives for the call.

    Args:
        x: [T, K] activations (float32, bfloat16 or float16).
        weight: [N, K] float8_e4m3fn, or its panels [ceil(N / 16), K, 16] (``pack_fp8``).
        weight_scale: [N] float32, or [N, ceil(K / block_k)] with ``block_k`` > 0. bias: [N] or None.
        config: the model's MatmulConfig (None: a plain ``F.linear`` in x's dtype; unused by the kernel).

    Returns:
        [T, N] in x's dtype.

    Raises:
        ValueError: ``weight`` is not a 2-D or packed 3-D float8_e4m3fn tensor or ``weight_scale`` not
            of the shape above.
    """
    packed = weight.dim() == 3
    n = weight_scale.shape[0] if weight_scale.dim() in (1, 2) else -1
    k = weight.shape[1] if weight.dim() in (2, 3) else -1
    want_w = (-(-n // 16), k, 16) if packed else (n, k)
    want_s = (n, -(-k // block_k)) if block_k > 0 else (n,)
    if weight.dtype != torch.float8_e4m3fn or tuple(weight.shape) != want_w or tuple(weight_scale.shape) != want_s:
        raise ValueError(f"fp8_linear needs a [N, K] (or packed [ceil(N / 16), K, 16]) float8_e4m3fn weight and {list(want_s)} "
                         f"scales (block_k={block_k}), got {weight.dtype} {tuple(weight.shape)} and {tuple(weight_scale.shape)}")
    if packed:
        out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)  # [T, N]
        ops.fp8_linear(out, x if x.stride(-1) == 1 else x.contiguous(), weight, weight_scale, block_k, bias)
        return out
    if block_k > 0:
        weight_scale = weight_scale.float().repeat_interleave(block_k, dim=1)[:, :k]  # [N, K]
    else:
        weight_scale = weight_scale.float()[:, None]
    dtype = config.weight_dtype if config is not None else x.dtype
    w = weight.float() * weight_scale  # [N, K] float32 (the fake-quantized weight, as transformers would hold it)
    w = w if w.dtype == dtype else w.to(dtype)
    if bias is not None and bias.dtype != dtype:
        bias = bias.to(dtype)
    if config is not None and config.pairs:
        w = pack_pairs(w)
    elif config is not None and config.panels:
        w = pack_panels(w)
    return linear(x, w, bias, config, weight.shape[0])


def int4_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, weight_zero: torch.Tensor, group_size: int,
                bias: Optional[torch.Tensor] = None, out_features: Optional[int] = None) -> torch.Tensor:
    """int4 W4A16: ``y = x @ W^T + bias`` with ``W[n, k] = float32(q - z) * s`` dequantized in the
    kernel's registers (``ops.int4_linear``; each output summed over k in order, so batch-invariant
    by construction, no row blocks).

    Args:
        x: [T, K] activations (float32, bfloat16 or float16).
        weight: [ceil(N / 16), K, 8] uint8 (``pagedgen.layers.quant_int4.pack_int4``).
        weight_scale: [ceil(N / 16), ceil(K / group_size), 16] float32; weight_zero: the same shape, uint8.
        group_size: input features per group. bias: [N] or None.
        out_features: N (default: the panels' rows, a multiple of 16).

    Returns:
        [T, N] in x's dtype.
    """
    n = out_features if out_features is not None else weight.shape[0] * 16
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)  # [T, N]
    ops.int4_linear(out, x if x.stride(-1) == 1 else x.contiguous(), weight, weight_scale, weight_zero, group_size, bias)
    return out
