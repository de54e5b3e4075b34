"""The one door to pagedgen's ops: torch.ops.pagedgen.* from the compiled extension when it is built
and has a kernel for the tensors' device, otherwise the PyTorch reference in ``reference.py``
(with one warning). See csrc/ops.cpp for the schemas and layouts. The CPU kernels come from one of
several builds, one per instruction-set level, chosen at import (``isa.py``: ``cpu_isa()`` names it,
``PAGEDGEN_CPU_ISA`` caps it).

The model's fused small layers (``rms_norm``, ``fused_add_rms_norm``, ``rotary_embedding``,
``silu_and_mul``, ``fused_add_layer_norm``), the sampler's greedy ``argmax`` and its logprobs ``logprob_topk`` (up to
``LOGPROB_TOPK_MAX`` top logprobs) have CPU kernels only; elsewhere their reference,
which is transformers' (or torch's) own sequence of PyTorch ops, is the implementation (no warning).
``packed_linear`` (the GEMM on panel-packed weights) has a CPU kernel in builds with AVX2 and FMA;
``pagedgen.layers.linear`` chooses it only where ``has_kernel("packed_linear")``. ``packed_linear_bf16``
(the same GEMM for bf16 on weights packed in bf16 pairs, vdpbf16ps) has a CPU kernel in builds with
AVX512-BF16, chosen only where ``has_kernel("packed_linear_bf16")``. ``add_lora_linear`` (every row's
LoRA delta of one projection, by adapter slot) has a CPU kernel in builds with AVX2 and FMA; its
reference runs elsewhere (a GPU, no AVX2).

``varlen_attention`` (the encoders' bidirectional attention over packed sequences) has a CPU kernel;
its reference (one SDPA per sequence) runs elsewhere (pagedgen/model/bert.py batches by length
bucket where the kernel is absent).

The 1-byte KV cache (``kv_cache_dtype`` int8 / fp8) goes through ``reshape_and_cache_quantized``
(a CPU kernel, else ``kv_quant.py``'s PyTorch ops) and ``paged_attention_quantized``: a CPU kernel that reads the codes
and scales as it attends (csrc/cpu/kv_codes.h), else ``kv_quant.py``'s copy path (the step's blocks
dequantized by ``kv_dequantize_blocks``, then the float attention op).
"""
import functools
import importlib
import warnings

import torch

from pagedgen.ops import fake, isa, kv_quant, reference
from pagedgen.ops.metadata import AttentionMetadata

try:
    importlib.import_module("pagedgen._C")  # loading the library registers torch.ops.pagedgen.*

    _IMPORT_ERROR = None
except ImportError as exc:  # the extension was not built
    _IMPORT_ERROR = exc
if _IMPORT_ERROR is None:
    isa.load()  # the CPU kernels of the best level this CPU runs (PAGEDGEN_CPU_ISA caps it)
    fake.register_fakes()  # FakeTensor / torch.compile / opcheck support of the ops just loaded

__all__ = [
    "AttentionMetadata", "extension_available", "extension_error", "reshape_and_cache", "paged_attention", "varlen_attention", "copy_blocks",
    "swap_blocks", "reshape_and_cache_quantized", "paged_attention_quantized", "rms_norm", "fused_add_rms_norm", "rotary_embedding",
    "silu_and_mul", "fused_add_layer_norm", "argmax", "logprob_topk", "LOGPROB_TOPK_MAX", "kv_dequantize_blocks", "quantized_attention_reads_codes", "packed_linear",
    "packed_linear_bf16", "int8_linear", "int4_linear", "fp8_linear", "add_lora_linear", "has_kernel", "cpu_isa", "cpu_isa_features",
]

#: the most top logprobs per row ``logprob_topk``'s kernel keeps (csrc/op_checks.h, vLLM's default
#: max_logprobs); a larger k_max runs the reference
LOGPROB_TOPK_MAX = 20

_OPS = ("reshape_and_cache", "paged_attention", "copy_blocks", "swap_blocks")  # the paged KV-cache ops

def extension_available(device: str = "cpu") -> bool:
    """True when pagedgen._C is loaded and has kernels for ``device`` ("cpu" or "cuda")."""
    if _IMPORT_ERROR is not None:
        return False
    key = "CUDA" if str(device).startswith("cuda") else "CPU"
    return all(torch._C._dispatch_has_kernel_for_dispatch_key(f"pagedgen::{op}", key) for op in _OPS)


def extension_error(device: str = "cpu") -> str:
    """Why the extension cannot serve ``device`` (empty string when it can)."""
    if _IMPORT_ERROR is not None:
        return f"pagedgen._C could not be imported ({_IMPORT_ERROR}); build it with scripts/setup.sh"
    if not str(device).startswith("cuda") and isa.loaded() is None:
        return f"pagedgen's CPU kernels are not loaded: {isa.why_not()}"
    if not extension_available(device):
        return f"pagedgen._C was built without kernels for {device!r}"
    return ""


def cpu_isa() -> str | None:
    """The instruction-set level of the CPU kernels loaded ("avx2", "avx512_bf16", "amx", "native" or
    "generic"; see ``isa.py``), or None when none are (not built, no level this CPU runs, or
    ``PAGEDGEN_CPU_ISA=none``: ``extension_error("cpu")`` says which)."""
    return isa.loaded()


def cpu_isa_features() -> frozenset:
    """The instruction sets the loaded CPU kernels were compiled with, e.g. {"avx2", "fma", "f16c"}."""
    return isa.loaded_features()


@functools.lru_cache(maxsize=None)
def _warn_fallback(device_type: str) -> None:
    warnings.warn(
        f"{extension_error(device_type)}; using the slow PyTorch reference ops instead", RuntimeWarning, stacklevel=3
    )


@functools.lru_cache(maxsize=None)
def _impl(name: str, device_type: str):
    if extension_available(device_type):
        return getattr(torch.ops.pagedgen, name)
    _warn_fallback(device_type)
    return getattr(reference, name)


@functools.lru_cache(maxsize=None)
def has_kernel(name: str, device_type: str = "cpu") -> bool:
    """True when pagedgen._C is loaded and has a kernel of op ``name`` for ``device_type``."""
    key = "CUDA" if device_type == "cuda" else "CPU"
    return (
        _IMPORT_ERROR is None
        and hasattr(torch.ops.pagedgen, name)  # an extension built before the op was added lacks it
        and torch._C._dispatch_has_kernel_for_dispatch_key(f"pagedgen::{name}", key)
    )


@functools.lru_cache(maxsize=None)
def _fused_impl(name: str, device_type: str):
    return getattr(torch.ops.pagedgen, name) if has_kernel(name, device_type) else getattr(reference, name)


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    """See :func:`pagedgen.ops.reference.reshape_and_cache`."""
    _impl("reshape_and_cache", key_cache.device.type)(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(
    out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale: float, sliding_window: int = 0
) -> None:
    """See :func:`pagedgen.ops.reference.paged_attention` (shapes in :class:`AttentionMetadata`)."""
    _impl("paged_attention", query.device.type)(
        out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window
    )


def varlen_attention(out, query, key, value, cu_seqlens, scale: float) -> None:
    """out [T, H, D] = bidirectional attention of each packed sequence (the encoders'): rows
    ``cu_seqlens[s] .. cu_seqlens[s + 1] - 1`` of query [T, H, D] and key, value [T, Hkv, D]
    (H % Hkv == 0; any strides, e.g. views of a fused qkv output) are sequence s; cu_seqlens
    [S + 1] int32. float32 / bfloat16 / float16, float32 arithmetic, out rounded once (out has
    query's dtype). The CPU kernel (csrc/cpu/varlen_attention.cpp: no padding, no copies; a row's
    bits depend on its own sequence only), else :func:`pagedgen.ops.reference.varlen_attention`
    (one SDPA per sequence; within float32 rounding of the kernel).

    Raises:
        RuntimeError: (the CPU kernel) shapes, dtypes or devices that do not fit together, out
            overlapping an input, cu_seqlens not running from 0 to T or decreasing (before any work).
    """
    _fused_impl("varlen_attention", query.device.type)(out, query, key, value, cu_seqlens, scale)

def reshape_and_cache_quantized(key, value, key_cache, value_cache, key_scales, value_scales, slot_mapping) -> None:
    """The 1-byte cache's write: the CPU kernel (csrc/cpu/kv_quantize.cpp, one pass), else
    :func:`pagedgen.ops.kv_quant.reshape_and_cache_quantized` (its oracle: the same bytes).

    Raises:
        ValueError: as ``kv_quant.reshape_and_cache_quantized`` (caches, scales, a slot past the
            cache), before anything is written.
    """
    if has_kernel("reshape_and_cache_quantized", key_cache.device.type):
        kv_quant.check_write(key_cache, value_cache, key_scales, value_scales, slot_mapping)
        torch.ops.pagedgen.reshape_and_cache_quantized(key, value, key_cache, value_cache, key_scales, value_scales, slot_mapping)
        return
    kv_quant.reshape_and_cache_quantized(key, value, key_cache, value_cache, key_scales, value_scales, slot_mapping)


def paged_attention_quantized(
    out, query, key_cache, value_cache, key_scales, value_scales, block_tables, seq_lens, query_start_loc, scale: float,
    sliding_window: int = 0, gathered=None,
) -> None:
    """``paged_attention`` over the 1-byte cache (``kv_quant.py``): the CPU kernel reads the codes and
    scales itself (``torch.ops.pagedgen.paged_attention_quantized``; ``gathered`` unused); elsewhere
    :func:`pagedgen.ops.kv_quant.paged_attention_quantized` (the step's blocks dequantized into a
    float32 copy, then ``paged_attention`` in float32; ``gathered``: its ``gather_plan`` for the
    step). Both compute in float32 over the values ``float(code) * float(scale)`` (the kernel applies
    each token's scale to its scores and weights: the same up to float rounding).

    Raises:
        ValueError: caches that are not int8 / float8 codes of one dtype, or scales not
            [num_blocks, block_size, num_kv_heads] bfloat16 (``kv_quant``, before any work).
        RuntimeError: the kernel's checks of the other arguments (as ``paged_attention``'s), and a
            block table entry a row reads outside the cache (before any work).
    """
    if has_kernel("paged_attention_quantized", query.device.type):
        kv_quant.check_layout(key_cache, value_cache, key_scales, value_scales)
        torch.ops.pagedgen.paged_attention_quantized(
            out, query, key_cache, value_cache, key_scales, value_scales, block_tables, seq_lens, query_start_loc, scale,
            sliding_window,
        )
        return
    kv_quant.paged_attention_quantized(
        paged_attention, kv_dequantize_blocks, out, query, key_cache, value_cache, key_scales, value_scales, block_tables, seq_lens,
        query_start_loc, scale, sliding_window, gathered,
    )


def quantized_attention_reads_codes(device_type: str) -> bool:
    """True where ``paged_attention_quantized`` runs the kernel that reads the codes itself (the CPU
    kernels are loaded): no ``kv_quant.gather_plan`` is needed for the step."""
    return has_kernel("paged_attention_quantized", device_type)


def kv_dequantize_blocks(out, codes, scales, blocks) -> None:
    """out [num_out, block_size, Hkv, D] = the 1-byte cache's blocks ``blocks`` [num_out] int64
    dequantized (codes int8 / float8, scales bf16); the CPU kernel, else
    :func:`pagedgen.ops.reference.kv_dequantize_blocks` (bitwise the same).

    Raises:
        RuntimeError: (the CPU kernel) shapes or dtypes that do not fit, a block outside the cache.
    """
    _fused_impl("kv_dequantize_blocks", out.device.type)(out, codes, scales, blocks)


def copy_blocks(key_cache, value_cache, block_mapping) -> None:
    """See :func:`pagedgen.ops.reference.copy_blocks`."""
    _impl("copy_blocks", key_cache.device.type)(key_cache, value_cache, block_mapping)


def swap_blocks(src, dst, block_mapping) -> None:
    """See :func:`pagedgen.ops.reference.swap_blocks`. Dispatches on the GPU side when there is one."""
    device_type = "cuda" if "cuda" in (src.device.type, dst.device.type) else "cpu"
    _impl("swap_blocks", device_type)(src, dst, block_mapping)


def rms_norm(out, input, weight, epsilon: float) -> None:
    """See :func:`pagedgen.ops.reference.rms_norm`."""
    _fused_impl("rms_norm", input.device.type)(out, input, weight, epsilon)


def fused_add_rms_norm(input, residual, weight, epsilon: float) -> None:
    """See :func:`pagedgen.ops.reference.fused_add_rms_norm`."""
    _fused_impl("fused_add_rms_norm", input.device.type)(input, residual, weight, epsilon)


def rotary_embedding(positions, query, key, cos, sin) -> None:
    """See :func:`pagedgen.ops.reference.rotary_embedding`."""
    _fused_impl("rotary_embedding", query.device.type)(positions, query, key, cos, sin)


def silu_and_mul(out, input) -> None:
    """See :func:`pagedgen.ops.reference.silu_and_mul`."""
    _fused_impl("silu_and_mul", input.device.type)(out, input)


def fused_add_layer_norm(input, residual, weight, bias, epsilon: float) -> None:
    """See :func:`pagedgen.ops.reference.fused_add_layer_norm`."""
    _fused_impl("fused_add_layer_norm", input.device.type)(input, residual, weight, bias, epsilon)


def argmax(out, logits) -> None:
    """out [num_rows] int64 = ``logits.max(dim=-1).indices`` of logits [num_rows, vocab] (float32,
    bfloat16 or float16; the kernel needs the last dim contiguous, any row stride): the first index of
    each row's maximum, NaN counting as the maximum. See :func:`pagedgen.ops.reference.argmax`.

    Raises:
        RuntimeError: (the CPU kernel) out is not int64 [num_rows], logits not [num_rows, vocab >= 1]
            with a contiguous last dim, or not float32 / bfloat16 / float16.
    """
    _fused_impl("argmax", logits.device.type)(out, logits)


def logprob_topk(out, logits, token_ids, k_max: int) -> None:
    """out [num_rows, 3 + 2 * k_max] float64 = each row's (chosen id, its logprob, its rank, the top
    k_max logprobs by value descending, ties by lowest id, their ids) for logits [num_rows, vocab]
    (float32, bfloat16 or float16, read as they are; contiguous last dim, any row stride) and
    token_ids [num_rows] int64. A logprob is ``logit - logsumexp(row)`` in float32. The CPU kernel
    (two passes over each row; k_max <= ``LOGPROB_TOPK_MAX``), else
    :func:`pagedgen.ops.reference.logprob_topk`: the same ids and ranks, logprobs within float32
    rounding of the log-sum-exp (about 1e-6 relative).

    Raises:
        RuntimeError: (the CPU kernel) shapes or dtypes that do not fit together, k_max outside
            [0, min(vocab, LOGPROB_TOPK_MAX)], a token id outside [0, vocab).
    """
    impl = _fused_impl("logprob_topk", logits.device.type) if k_max <= LOGPROB_TOPK_MAX else reference.logprob_topk
    impl(out, logits, token_ids, k_max)


def packed_linear(out, input, weight, bias=None) -> None:
    """out [M, N] = input [M, K] @ W^T (+ bias [N]) for a weight packed by
    ``pagedgen.layers.matmul.pack_panels`` ([ceil(N / 16), K, 16], float32 / bfloat16 / float16);
    out has input's dtype. See :func:`pagedgen.ops.reference.packed_linear`.

    Raises:
        RuntimeError: (the CPU kernel) shapes that do not fit together, rows that are not contiguous,
            or a dtype other than float32 / bfloat16 / float16.
    """
    _fused_impl("packed_linear", input.device.type)(out, input, weight, bias)


def packed_linear_bf16(out, input, weight, bias=None) -> None:
    """out [M, N] (bf16) = input [M, K] (bf16) @ W^T (+ bias [N]) for a weight packed by
    ``pagedgen.layers.matmul.pack_pairs`` ([ceil(N / 16), ceil(K / 2), 16, 2] bf16). See
    :func:`pagedgen.ops.reference.packed_linear_bf16`.

    Raises:
        RuntimeError: (the CPU kernel) shapes that do not fit together, rows that are not contiguous,
            or an input, weight or out that is not bfloat16.
    """
    _fused_impl("packed_linear_bf16", input.device.type)(out, input, weight, bias)


def int8_linear(out, input, weight, weight_scale, input_scale=None, bias=None) -> None:
    """out [M, N] (input's dtype) = the W8A8 int8 product of input [M, K] (float32 / bfloat16 /
    float16, quantized per row, or with the static ``input_scale`` [1] float32) and the int8 weight
    packed by ``pagedgen.layers.matmul.pack_int8`` ([ceil(N / 16), ceil(K / 2), 16, 2]) with
    per-output-channel ``weight_scale`` [N] float32, + bias [N]. A CPU kernel in builds with AVX2. Integer sums are exact,
    so every row's bits are independent of the batch. See :func:`pagedgen.ops.reference.int8_linear`.
    ``torch.ops.pagedgen.int8_linear_amx`` (AMX-INT8 tiles; the amx level on a CPU with AMX-INT8) and
    ``int8_linear_amx_emulated`` (its tile loop on emulated tiles, for the tests) give the same bits;
    ``pagedgen.layers.matmul.int8_linear`` picks the AMX one by the number of rows.

    Raises:
        RuntimeError: (the CPU kernel) shapes that do not fit together, rows that are not contiguous,
            or a weight that is not int8 / scales that are not float32.
    """
    _fused_impl("int8_linear", input.device.type)(out, input, weight, weight_scale, input_scale, bias)


def add_lora_linear(out, input, lora_a, lora_b, slots, output_slices) -> None:
    """out [M, N] += each row's LoRA delta: row m of input [M, K] through the adapter in slot
    ``slots[m]`` (int32 [M], -1: none), lora_a [S, K, P R] (A^T, parts side by side), lora_b [S, R, N]
    ((scale B)^T), ``output_slices`` the P parts' sizes (summing to N). The CPU kernel (AVX2 + FMA;
    batch-invariant by construction), else :func:`pagedgen.ops.reference.add_lora_linear`.

    Raises:
        RuntimeError: (the CPU kernel) shapes, dtypes or strides that do not fit, a slot outside [-1, S).
    """
    _fused_impl("add_lora_linear", input.device.type)(out, input, lora_a, lora_b, slots, list(output_slices))


def int4_linear(out, input, weight, weight_scale, weight_zero, group_size: int, bias=None) -> None:
    """out [M, N] (input's dtype) = input [M, K] (float32 / bfloat16 / float16) @ W^T + bias [N]
    for int4 W4A16 weights packed by ``pagedgen.layers.quant_int4.pack_int4`` ([ceil(N / 16), K, 8]
    uint8) with per-group ``weight_scale`` ([ceil(N / 16), ceil(K / group_size), 16] float32) and
    ``weight_zero`` (same shape, uint8): ``W[n, k] = float32(q - z) * s``. A CPU kernel in builds
    with AVX2 (each output summed over k in order: batch-invariant). See
    :func:`pagedgen.ops.reference.int4_linear`.

    Raises:
        RuntimeError: (the CPU kernel) shapes that do not fit together, a group size that does not
            divide K, rows that are not contiguous, or dtypes other than the above.
    """
    _fused_impl("int4_linear", input.device.type)(out, input, weight, weight_scale, weight_zero, group_size, bias)


def fp8_linear(out, input, weight, weight_scale, block_k: int, bias=None) -> None:
    """out [M, N] (input's dtype) = input [M, K] (float32 / bfloat16 / float16) @ W^T + bias [N] for
    FP8 W8A16 weights packed by ``pagedgen.layers.quant_fp8.pack_fp8`` ([ceil(N / 16), K, 16]
    float8_e4m3fn, no NaN codes) with ``weight_scale`` [N] float32 (``block_k`` 0: per output
    channel) or [N, ceil(K / block_k)] float32 (block-wise): ``W[n, k] = float32(code) * scale``. A
    CPU kernel in builds with AVX2 and F16C (each output summed over k in order: batch-invariant).
    See :func:`pagedgen.ops.reference.fp8_linear`.

    Raises:
        RuntimeError: (the CPU kernel) shapes that do not fit together, a negative block_k, rows
            that are not contiguous, or dtypes other than the above.
    """
    _fused_impl("fp8_linear", input.device.type)(out, input, weight, weight_scale, block_k, bias)
