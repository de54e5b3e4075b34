"""``choose_matmul``: which path runs the matmuls of a model, chosen once per model from what the CPU
and the build offer and ``PAGEDGEN_CPU_MATMUL``; applied after loading by ``prepare_matmuls``
(``packing``), run by ``linear`` (``dispatch``); docs/determinism.md, benchmarks/results/history.md "Matmul choices":

- **pagedgen's own GEMM on packed panels (AVX2 CPUs).** On a CPU whose best vector unit is AVX2
  (torch's CPU capability "AVX2": no AVX-512, so no oneDNN bf16 either), every weight is packed once,
  after loading, into panels of ``PANEL`` output features (``pack_panels``: [ceil(N / 16), K, 16], in
  the model dtype) and ``linear`` runs ``pagedgen.ops.packed_linear`` (csrc/cpu/linear.cpp): bf16/fp16
  weights are converted to float32 in registers as they are read and every output is a float32 sum
  over k in order, so the weights keep the model dtype's bytes (no float32 copy) and a row's bits
  never depend on the other rows (batch-invariant by construction: no row blocks). Measured on the
  AVX2 AMD EPYC with the weights cold, 2 threads (benchmarks/results/history.md, the AVX2 section of
  2026-12-03): on bf16 weights 1.4-2.4x what oneDNN's prepacked float32 inner product gives on
  float32 copies at 1-4 rows, 0.95-1.4x at 16-48 rows, 0.7-1.0x at 256-1,024 (prefill); in float32
  1.1-2.8x oneDNN at 1-16 rows, about even from 256. In the engine, a 48-request random-135m bf16
  job spent 19.3 s in its GEMMs instead of 27.8 s. Needs the extension built with AVX2 and FMA
  (``ops.has_kernel("packed_linear")``); ``PAGEDGEN_CPU_MATMUL`` picks another path.
- **pagedgen's AVX-512 BF16 GEMM on bf16 pairs (bf16 models on AVX-512 BF16 CPUs without AMX).**
  Where torch's CPU capability is "AVX512", /proc/cpuinfo lists ``avx512_bf16``, there are no AMX
  tiles and the extension is built with AVX512-BF16 (``bf16_pairs_available``: the AMD EPYC Zen 4
  kind), every weight of a bf16 model is packed once into bf16 pairs (``pack_pairs``: [ceil(N / 16),
  ceil(K / 2), 16, 2], the layout of ``vdpbf16ps`` and of AMX's B tiles) and ``linear`` runs
  ``pagedgen.ops.packed_linear_bf16`` (csrc/cpu/linear_avx512.cpp): each output is a chain of
  ``vdpbf16ps`` over the pairs in order, + bias, rounded once: batch-invariant by construction.
  Measured there 2026-12-04 (benchmarks/results/history.md; one thread, thread CPU time, weights cold):
  1.0-4.4x oneDNN's row-blocked bf16 GEMM at 1-4 rows, 0.94-1.45x at 16, 0.93-1.10x at 64-1,024. On a
  Xeon with AMX, pagedgen's AMX GEMM on the same pairs (below); float32/fp16 models on these kinds keep
  oneDNN (below).
- **Compute dtype** (where the panels are not used). bf16/fp16 weights on a CPU whose oneDNN has no
  bf16/fp16 kernels (no AVX-512 BF16/FP16, no AMX: ``torch.ops.mkldnn._is_mkldnn_bf16_supported()``
  False) are kept as a float32 copy, and ``linear`` computes ``F.linear(x.float(), W32).to(x.dtype)``:
  torch's own bf16 kernel there runs at ~10 GFLOP/s per core whatever the batch, float32 MKL at 4-8x
  that from 64 rows up (break-even at one row). The bf16 copy is dropped (4 bytes per parameter instead of 2; a tied
  embedding keeps its own bf16 matrix). Activations and the KV cache stay in the model dtype.
  Elsewhere (float32 models, oneDNN bf16 CPUs, GPUs) the weights stay in the model dtype. The
  choice is by capability only, never by a timing probe: a timing could choose differently from
  one run to the next, and the two paths give different bits.
- **Batch invariance** (``MatmulConfig.row_blocks``): GEMM libraries pick their kernel by the number
  of rows, so in batch-invariant mode the library paths run in row blocks measured to keep each row's
  bits (``config``'s docstring has the measurements); pagedgen's own GEMMs need none.
- **Prepacked float32 weights (oneDNN).** On an x86 CPU with oneDNN, every float32 weight of at
  least ``prepack_min_numel`` elements is reordered once, after loading, into oneDNN's blocked
  layout for the inner product (``torch.ops.mkldnn._reorder_linear_weight``, the packing torch's
  inductor uses), and ``linear`` runs it with ``torch.ops.mkldnn._linear_pointwise``; the dense
  copy is dropped. Measured on the AMD EPYC AVX2 kind with 2 threads (benchmarks/results/history.md "Matmul
  choices"): 1.2-4.2x MKL's ``F.linear`` at 4-64 rows on the random-135m/1b shapes, about even
  at 256-1,024 rows. Smaller weights stay with MKL: oneDNN's call costs ~30-40 us whatever the
  size, more than a whole GEMM of stories260K. This is vLLM's CPU path too
  (``vllm/model_executor/layers/utils.py``, ``dispatch_cpu_unquantized_gemm``). A prepacked GEMM
  gives each row the same bits at every M from 2 to 1,100 and at any position (AVX2 EPYC and the
  Xeon, 1 and 2 threads; the AVX2 EPYC also at M = 1). The path of CPUs other than AVX2 ones.

- **Prepacked bf16 weights (oneDNN, AMX / AVX-512 BF16).** On a CPU with oneDNN bf16 every bf16
  weight is prepacked the same way (``PREPACK_MIN_NUMEL_BF16``): measured on the Xeon with AMX,
  1.1-3.1x the dense bf16 ``F.linear`` at 1-256 rows on the random-135m shapes, never slower.
  vLLM's CPU backend prepacks its bf16 weights for oneDNN too. fp16 weights stay dense (oneDNN's
  prepacked fp16 GEMM was slower than the dense one there).

``PAGEDGEN_CPU_MATMUL`` (read when an LLM is built): "auto" (the default: the packed panels on AVX2
CPUs where the kernel is built, the AMX GEMM for bf16 models on CPUs with AMX, the bf16 pairs for bf16
models on AVX512-BF16 CPUs, else oneDNN prepacking), "pagedgen" (the packed panels on any CPU
whose build has the kernel), "onednn" (oneDNN prepacking, float32 copies of bf16/fp16 weights where
oneDNN has no kernels for them), "mkl" (no packing: MKL for every float32 weight, the dense GEMM for
bf16 ones), "amx" (the AMX GEMM asked for: an error where it cannot run).

**pagedgen's AMX GEMM (the default for bf16 models on a CPU with AMX; issue 47).** The bf16 pairs of ``pack_pairs`` are
also the B tiles of AMX's ``tdpbf16ps``; ``ops``' ``packed_linear_bf16_amx`` (csrc/cpu/linear_amx.cpp,
tile loop in linear_amx_loop.h) runs them in 16 x 16 tiles: a fixed k order (chunks of 32 in order,
zero-padded) and the same tile for every row whatever M, float32 accumulation in the tiles, one rounding.
Its packing and tile loop are tested through an emulation of the tiles (``packed_linear_bf16_amx_emulated``)
on CPUs without AMX, and it has run on a Xeon with AMX (its tests pass there; 1.43-1.55x oneDNN's
row-blocked AMX GEMM end to end, issue 47, whose row blocks cost ~1.5x in the batch-invariant mode). It
runs bf16 models only, on a CPU with AMX whose loaded CPU kernels are the amx level (``cpu_has_amx``:
cpuid, XCR0, ``ops.cpu_isa_features()``, asked once per process), and only after a self-check at first
use (``amx_self_check``: a small GEMM against float32 and batch invariance). By default a kernel that
raises or fails the check leaves oneDNN's GEMM (row-blocked in the batch-invariant mode) in its place,
with a RuntimeWarning that says why; asked for by ``PAGEDGEN_CPU_MATMUL=amx``, a wrong result is a
RuntimeError and a CPU without AMX a ValueError.

**int8 W8A8 layers** run ``ops.int8_linear`` (AVX2 tiles) on every CPU, and on one with AMX-INT8 and the
amx level loaded, GEMMs of ``INT8_AMX_MIN_ROWS`` rows or more run ``int8_linear_amx`` (the same bits;
``int8_amx``: ``MatmulConfig.int8_amx_min_rows``, its self-check, ``PAGEDGEN_CPU_INT8``).
"""
from __future__ import annotations

import dataclasses
import os
import platform
import warnings
from typing import Optional

import torch

from pagedgen import ops
from pagedgen.layers.matmul.amx_check import AmxUnavailableError, amx_self_check
from pagedgen.layers.matmul.config import (BF16_MAX_ROWS, BF16_MIN_ROWS, FP16_MIN_ROWS, LONG_K_MAX_ROWS, MAX_ROWS,
                                           MIN_ROWS, PACKED_MIN_ROWS, MatmulConfig)
from pagedgen.layers.matmul.int8_amx import int8_amx_min_rows

#: float32 weights of at least this many elements are prepacked for oneDNN (module docstring): from
#: here oneDNN's faster kernels pay for its fixed call cost (random-135m: q/k/v 553k, down 885k,
#: gate/up 1.8M elements and the lm_head are packed, o_proj 332k is not; stories260K: none).
PREPACK_MIN_NUMEL = 1 << 19
#: bf16 weights on a CPU with oneDNN bf16 are all prepacked: on the Xeon with AMX the packed GEMM
#: was as fast or faster than the dense one at every measured shape (64 x 128 up to 576 x 49,152)
#: and M (1-256): 1.1-3.1x at the random-135m shapes (benchmarks/results/history.md "Matmul choices").
PREPACK_MIN_NUMEL_BF16 = 1
MATMUL_BACKENDS = ("auto", "pagedgen", "onednn", "mkl", "amx")


def cpu_matmul_backend(dtype: Optional[torch.dtype] = None) -> str:
    """The CPU matmul path ``PAGEDGEN_CPU_MATMUL`` asks for, "auto" resolved: "pagedgen" (packed
    panels) on a CPU whose torch capability is AVX2 when the kernel is built; "amx" for a bfloat16
    model (``dtype``) on a CPU with AMX and the amx level loaded (``cpu_has_amx``); "pagedgen" for a
    bfloat16 model on a CPU with AVX512-BF16 and no AMX where the bf16-pair kernel is built
    (``bf16_pairs_available``); else "onednn".

    Raises:
        ValueError: ``PAGEDGEN_CPU_MATMUL`` is not one of ``MATMUL_BACKENDS``, or is "pagedgen" where
            pagedgen._C has no ``packed_linear`` kernel (not built, or built without AVX2 and FMA).
    """
    backend = os.environ.get("PAGEDGEN_CPU_MATMUL", "auto").strip().lower()  # "oneDNN", "MKL" read too
    if backend not in MATMUL_BACKENDS:
        raise ValueError(f"PAGEDGEN_CPU_MATMUL must be one of {MATMUL_BACKENDS}, got {backend!r}")
    if backend == "auto":
        if dtype == torch.bfloat16 and cpu_has_amx():  # 1.43-1.55x oneDNN's AMX GEMM end to end (issue 47)
            return "amx"
        if ops.has_kernel("packed_linear") and torch.backends.cpu.get_cpu_capability() == "AVX2":
            return "pagedgen"
        # AVX512-BF16 without AMX (AMD EPYC Zen 4): the bf16-pair GEMM beat oneDNN's row-blocked GEMM at
        # every random-135m/1b shape (benchmarks/results/history.md, 2026-12-04). With AMX tiles that this
        # build cannot use (no amx level loaded), oneDNN's AMX GEMM.
        return "pagedgen" if dtype == torch.bfloat16 and bf16_pairs_available() and not amx_available() else "onednn"
    if backend == "amx" and not cpu_has_amx():
        raise ValueError("PAGEDGEN_CPU_MATMUL=amx needs a CPU with AMX-TILE and AMX-BF16 enabled by the OS and pagedgen._C "
                         "with the packed_linear_bf16_amx kernel (cpu_has_amx() is False here)")
    if backend == "pagedgen" and not ops.has_kernel("packed_linear"):
        raise ValueError("PAGEDGEN_CPU_MATMUL=pagedgen needs pagedgen._C built with AVX2 and FMA (no packed_linear kernel here)")
    return backend


def cpu_has_flag(flag: str) -> bool:
    """True when /proc/cpuinfo lists ``flag`` (e.g. "avx512_bf16"); False where there is no such file."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and flag in line.split() for line in f)
    except OSError:
        return False


def bf16_pairs_available() -> bool:
    """True when pagedgen's AVX512-BF16 GEMM (``ops.packed_linear_bf16``) runs here: the kernel is
    built (a build with AVX512-BF16), torch's CPU capability is AVX512 and the CPU has AVX512-BF16."""
    return (ops.has_kernel("packed_linear_bf16") and torch.backends.cpu.get_cpu_capability() == "AVX512"
            and cpu_has_flag("avx512_bf16"))


def cpu_has_amx() -> bool:
    """True when the CPU kernels loaded hold the AMX GEMM (``packed_linear_bf16_amx``: the amx level, or
    a -march=native build on a CPU with AMX; ``ops.cpu_isa_features()``) and the CPU has AMX-TILE and
    AMX-BF16 with the tile state enabled by the OS (``torch.ops.pagedgen.cpu_has_amx``: cpuid leaf 7
    EDX bits 22/24, XCR0 bits 17/18)."""
    return (ops.has_kernel("packed_linear_bf16_amx") and "amx_bf16" in ops.cpu_isa_features()
            and bool(torch.ops.pagedgen.cpu_has_amx()))


def onednn_prepack_supported() -> bool:
    """True when this torch can prepack float32 weights for oneDNN's inner product on this CPU (x86
    with oneDNN and at least AVX2), whatever ``PAGEDGEN_CPU_MATMUL`` says."""
    return (torch.backends.mkldnn.is_available() and torch.backends.cpu.get_cpu_capability() != "DEFAULT"
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and platform.machine().lower() in ("x86_64", "amd64"))


def onednn_prepack_available() -> bool:
    """True when float32 weights are to be prepacked for oneDNN here: supported, and
    ``cpu_matmul_backend()`` is "onednn".

    Raises:
        ValueError: see ``cpu_matmul_backend``.
    """
    return cpu_matmul_backend() == "onednn" and onednn_prepack_supported()


def native_reduced_precision(dtype: torch.dtype) -> bool:
    """True when this CPU's torch has fast kernels for ``dtype`` matmuls (oneDNN bf16/fp16: AVX-512
    BF16/FP16 or AMX); False for float32 (nothing to convert) is not asked."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return True


def amx_available() -> bool:
    """True when this CPU has AMX tiles that torch's oneDNN uses (``torch.cpu._is_amx_tile_supported``).
    Where this torch cannot tell, True: the AMX row blocks (at most 32 rows) are batch-invariant on
    every CPU measured, the larger ones only without AMX."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe()) if probe is not None else True


def bf16_row_blocks() -> tuple[int, int]:
    """(min_rows, max_rows) of oneDNN's bf16 GEMM in batch-invariant mode on this CPU: blocks of at
    most BF16_MAX_ROWS with AMX (its kernel changes at 33 rows), else MAX_ROWS; at least BF16_MIN_ROWS."""
    return BF16_MIN_ROWS, BF16_MAX_ROWS if amx_available() else MAX_ROWS


def choose_matmul(dtype: torch.dtype, device: torch.device, batch_invariant: bool) -> MatmulConfig:
    """The matmul path of a model of ``dtype`` on ``device`` (the one place the choice is made).

    Args:
        dtype: the model dtype (float32, bfloat16 or float16).
        device: where the model runs.
        batch_invariant: pad/split the GEMM rows so that a row's bits do not depend on the other
            rows (CPU only; the packed-panel GEMM has that property without either).

    On the CPU the config also says from how many rows int8 W8A8 GEMMs run on AMX-INT8 tiles
    (``int8_amx_min_rows``: 0 without AMX-INT8; the same bits as the AVX2 tiles either way).

    Raises:
        ValueError: ``batch_invariant`` on a device other than the CPU (no such mode there yet);
            an unknown ``PAGEDGEN_CPU_MATMUL`` or ``PAGEDGEN_CPU_INT8``; ``PAGEDGEN_CPU_MATMUL=amx`` for a model other than
            bfloat16 or on a CPU without AMX.
        RuntimeError: ``PAGEDGEN_CPU_MATMUL=amx`` and the AMX GEMM gave a wrong result at its
            self-check (by default that falls back to oneDNN with a RuntimeWarning instead).
    """
    config = _choose_float(dtype, torch.device(device), batch_invariant)
    if torch.device(device).type != "cpu":
        return config
    return dataclasses.replace(config, int8_amx_min_rows=int8_amx_min_rows())


def _choose_float(dtype: torch.dtype, device: torch.device, batch_invariant: bool) -> MatmulConfig:
    """``choose_matmul``'s choice for the float weights (its docstring)."""
    if device.type != "cpu":
        if batch_invariant:
            raise ValueError(f"LLM batch_invariant=True is available on the CPU only, not on {device.type!r} (not yet)")
        return MatmulConfig(dtype, reason=f"{device.type}: the model dtype's own GEMM")
    backend = cpu_matmul_backend(dtype)
    if backend == "amx":
        asked = os.environ.get("PAGEDGEN_CPU_MATMUL", "auto").strip().lower() == "amx"
        if dtype != torch.bfloat16:
            raise ValueError(f"PAGEDGEN_CPU_MATMUL=amx runs bfloat16 models only, got {dtype}")
        try:
            amx_self_check()
            return MatmulConfig(dtype, pairs=True, amx=True, reason="pagedgen's AMX GEMM on bf16 pairs (tdpbf16ps, float32 sums)")
        except RuntimeError as e:  # asked for: a wrong result raises; an unusable kernel, or any failure by default, falls back
            if asked and not isinstance(e, AmxUnavailableError):
                raise
            who = "PAGEDGEN_CPU_MATMUL=amx" if asked else "the default AMX GEMM"
            warnings.warn(f"{e}; {who} falls back to oneDNN", RuntimeWarning, stacklevel=2)
            backend = "onednn"
    if backend == "pagedgen":  # batch-invariant whatever batch_invariant says: no cost to it
        if dtype == torch.bfloat16 and bf16_pairs_available():
            return MatmulConfig(dtype, pairs=True, reason="pagedgen's AVX512-BF16 GEMM on bf16 pairs (vdpbf16ps, float32 sums)")
        return MatmulConfig(dtype, panels=True, reason=f"pagedgen's packed-panel GEMM ({str(dtype).removeprefix('torch.')} weights, float32 sums)")
    onednn = backend == "onednn" and onednn_prepack_supported()  # = onednn_prepack_available(), after an amx fallback too
    if dtype in (torch.bfloat16, torch.float16) and native_reduced_precision(dtype):
        lo, hi = bf16_row_blocks() if dtype == torch.bfloat16 else (FP16_MIN_ROWS, MAX_ROWS)
        rows = dict(min_rows=lo, max_rows=hi, packed_min_rows=lo, packed_max_rows=hi) if batch_invariant else {}
        if dtype == torch.bfloat16 and onednn:
            return MatmulConfig(dtype, reason="oneDNN bf16 GEMM, prepacked weights", prepack_min_numel=PREPACK_MIN_NUMEL_BF16, **rows)
        return MatmulConfig(dtype, reason="the model dtype's own GEMM", **rows)
    rows = dict(min_rows=MIN_ROWS, max_rows=MAX_ROWS, long_k_max_rows=LONG_K_MAX_ROWS) if batch_invariant else {}
    packed = dict(prepack_min_numel=PREPACK_MIN_NUMEL) if onednn else {}
    if packed and batch_invariant:
        packed.update(packed_min_rows=PACKED_MIN_ROWS, packed_max_rows=MAX_ROWS)
    float32_gemm = "oneDNN prepacked weights, small ones MKL" if packed else "MKL"
    if dtype in (torch.bfloat16, torch.float16):
        name = str(dtype).removeprefix("torch.")
        return MatmulConfig(torch.float32, reason=f"no oneDNN {name} on this CPU: {name} matmuls computed in float32 ({float32_gemm})", **rows, **packed)
    return MatmulConfig(dtype, reason=f"float32 GEMM ({float32_gemm})", **rows, **packed)
