"""``linear``: the single point through which every matmul of every model runs, and how it runs.

How the matmuls run (``MatmulConfig``, chosen once per model by ``choose_matmul`` and applied after
loading by ``prepare_matmuls``; docs/determinism.md, docs/benchmarks.md "Matmul choices"):

- **pagedgen's own GEMM on packed panels (AVX2 CPUs).** On a CPU whose best vector unit is AVX2
  (torch's CPU capability "AVX2": no AVX-512, so no oneDNN bf16 either), every weight is packed once,
  after loading, into panels of ``PANEL`` output features (``pack_panels``: [ceil(N / 16), K, 16], in
  the model dtype) and ``linear`` runs ``pagedgen.ops.packed_linear`` (csrc/cpu/linear.cpp): bf16/fp16
  weights are converted to float32 in registers as they are read and every output is a float32 sum
  over k in order, so the weights keep the model dtype's bytes (no float32 copy) and a row's bits
  never depend on the other rows (batch-invariant by construction: no row blocks). Measured on the
  AVX2 AMD EPYC with the weights cold, 2 threads (docs/benchmarks.md, the AVX2 section of
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
  Measured there 2026-12-04 (docs/benchmarks.md; one thread, thread CPU time, weights cold):
  1.0-4.4x oneDNN's row-blocked bf16 GEMM at 1-4 rows, 0.94-1.45x at 16, 0.93-1.10x at 64-1,024. On a
  Xeon with AMX oneDNN's AMX GEMM stays the default (pagedgen's AMX GEMM is opt-in until measured
  there, below); float32/fp16 models on this kind keep oneDNN (below).
- **Compute dtype** (where the panels are not used). bf16/fp16 weights on a CPU whose oneDNN has no
  bf16/fp16 kernels (no AVX-512 BF16/FP16, no AMX: ``torch.ops.mkldnn._is_mkldnn_bf16_supported()``
  False) are kept as a float32 copy, and ``linear`` computes ``F.linear(x.float(), W32).to(x.dtype)``:
  torch's own bf16 kernel there runs at ~10 GFLOP/s per core whatever the batch, float32 MKL at 4-8x
  that from 64 rows up (break-even at one row). The bf16 copy is dropped (4 bytes per parameter instead of 2; a tied
  embedding keeps its own bf16 matrix). Activations and the KV cache stay in the model dtype.
  Elsewhere (float32 models, oneDNN bf16 CPUs, GPUs) the weights stay in the model dtype. The
  choice is by capability only, never by a timing probe: a timing could choose differently from
  one run to the next, and the two paths give different bits.
- **Batch invariance** (``MatmulConfig.row_blocks``). GEMM libraries pick their kernel by the
  number of rows M, so the same row can get other bits in a batch of another size. MKL's sgemm
  uses a gemv at M = 1, other kernels at M = 2-3 (and with 2 threads at 5-7 and 9-11) on the AVX2
  AMD EPYC, and on a Xeon with AMX changes kernel from M = 58-1,024 when K > 1,024; oneDNN's
  bf16 GEMM on AMX changes kernel at M = 33, and on AVX-512 BF16 without AMX runs one row alone
  differently when K > 576; oneDNN's prepacked float32 GEMM runs one row alone differently for
  some K. So in batch-invariant mode every GEMM runs in blocks whose sizes were measured to give
  each row the same bits whatever the other rows and the row's position: MKL at least
  ``MIN_ROWS`` rows (zero rows added) and at most ``MAX_ROWS`` (``LONG_K_MAX_ROWS`` when K >
  ``LONG_K``), prepacked float32 at least ``PACKED_MIN_ROWS``, oneDNN bf16 at least
  ``BF16_MIN_ROWS`` and at most ``BF16_MAX_ROWS`` with AMX (``MAX_ROWS`` without), fp16 at least
  ``FP16_MIN_ROWS``. The tests check every row of batches of up
  to 1,100 rows against the row alone at the model shapes, on the machine they run on
  (``tests/test_batch_invariance_ops.py``).
- **Prepacked float32 weights (oneDNN).** On an x86 CPU with oneDNN, every float32 weight of at
  least ``prepack_min_numel`` elements is reordered once, after loading, into oneDNN's blocked
  layout for the inner product (``torch.ops.mkldnn._reorder_linear_weight``, the packing torch's
  inductor uses), and ``linear`` runs it with ``torch.ops.mkldnn._linear_pointwise``; the dense
  copy is dropped. Measured on the AMD EPYC AVX2 kind with 2 threads (docs/benchmarks.md "Matmul
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
CPUs where the kernel is built, else oneDNN prepacking), "pagedgen" (the packed panels on any CPU
whose build has the kernel), "onednn" (oneDNN prepacking, float32 copies of bf16/fp16 weights where
oneDNN has no kernels for them), "mkl" (no packing: MKL for every float32 weight, the dense GEMM for
bf16 ones), "amx" (opt-in, below).

**pagedgen's AMX GEMM (opt-in: ``PAGEDGEN_CPU_MATMUL=amx``).** The bf16 pairs of ``pack_pairs`` are
also the B tiles of AMX's ``tdpbf16ps``; ``ops``' ``packed_linear_bf16_amx`` (csrc/cpu/linear_amx.cpp,
tile loop in linear_amx_loop.h) runs them in 16 x 16 tiles: a fixed k order (chunks of 32 in order,
zero-padded) and the same tile for every row whatever M, float32 accumulation in the tiles, one rounding.
It is written and its packing and tile loop are tested through an emulation of the tiles
(``packed_linear_bf16_amx_emulated``) on CPUs without AMX, but it has not yet run on AMX hardware, so it
is chosen only when asked for, only for bf16 models on a CPU with AMX (``cpu_has_amx``: cpuid and
XCR0), and only after a self-check at first use (``amx_self_check``: a small GEMM against float32 and
batch invariance; a mismatch raises RuntimeError). Asked for on a CPU without AMX it raises ValueError.
"""
from __future__ import annotations

import os
import platform
import warnings
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedgen import ops


@dataclass(frozen=True)
class MatmulConfig:
    """How ``linear`` runs the matmuls of one model (see the module docstring).

    Attributes:
        weight_dtype: the dtype the weights are kept in; when it differs from the activations'
            dtype, ``linear`` converts the activations to it and the result back.
        min_rows: GEMMs of dense weights with fewer rows are padded with zero rows up to this many
            (0: never; > 0 is what makes the config batch-invariant).
        max_rows: GEMMs of more rows run in blocks of at most this many (0: never split).
        reason: why this path was chosen, for logs and docs.
        prepack_min_numel: weights of at least this many elements are prepacked for oneDNN by
            ``prepare_matmuls`` (0: none are).
        packed_min_rows, packed_max_rows: ``min_rows``/``max_rows`` for prepacked weights.
        long_k_max_rows: ``max_rows`` for dense weights of more than ``LONG_K`` input features
            (0: ``max_rows``).
        panels: every weight is packed into panels (``pack_panels``) for pagedgen's own GEMM
            (``ops.packed_linear``), which gives each row the same bits in any batch by itself.
        pairs: every weight (bf16) is packed into bf16 pairs (``pack_pairs``) for pagedgen's
            AVX512-BF16 GEMM (``ops.packed_linear_bf16``), batch-invariant by itself as well.
        amx: with ``pairs``, ``linear`` runs the pairs with pagedgen's AMX GEMM
            (``packed_linear_bf16_amx``; opt-in, ``PAGEDGEN_CPU_MATMUL=amx``).
    """

    weight_dtype: torch.dtype
    min_rows: int = 0
    max_rows: int = 0
    reason: str = ""
    prepack_min_numel: int = 0
    packed_min_rows: int = 0
    packed_max_rows: int = 0
    long_k_max_rows: int = 0
    panels: bool = False
    pairs: bool = False
    amx: bool = False

    @property
    def batch_invariant(self) -> bool:
        """True when a row's bits do not depend on the other rows of its GEMMs."""
        return self.min_rows > 0 or self.panels or self.pairs

    def row_blocks(self, weight: torch.Tensor) -> tuple[int, int]:
        """(min_rows, max_rows) for a GEMM with ``weight`` [out_features, in_features]."""
        if weight.is_mkldnn:
            return self.packed_min_rows, self.packed_max_rows
        if self.long_k_max_rows and weight.shape[1] > LONG_K:
            return self.min_rows, self.long_k_max_rows
        return self.min_rows, self.max_rows


#: the rows of every MKL GEMM in batch-invariant mode: at least MIN_ROWS (zero rows added), blocks of
#: at most MAX_ROWS. Measured on MKL sgemm (AVX2 AMD EPYC, 1 and 2 threads): M in {4, 8} and every
#: M >= 12 give each row the same bits, checked up to M = 1024 (benchmarks/matmul_choices.py --part bits);
#: larger M run as blocks of MAX_ROWS, so no GEMM leaves the checked range.
MIN_ROWS, MAX_ROWS = 16, 1024
#: MKL GEMMs of more than LONG_K input features run in blocks of at most LONG_K_MAX_ROWS rows: on a
#: Xeon with AMX (AVX-512, AMX-BF16; 2 threads) sgemm changes its kernel at M = 58 for K = 1,536,
#: at M = 300 for K = 2,048 and at M = 1,024 for K = 5,632 (row bits change), and kept every row's
#: bits for M in [16, 57] at each; K <= 1,024 kept them up to M = 1,100.
LONG_K, LONG_K_MAX_ROWS = 1024, 32
#: prepacked float32 weights (oneDNN) in batch-invariant mode: at least 2 rows (one row alone runs a
#: gemv with other bits for some K on the Xeon, e.g. K = 1,536), blocks of at most MAX_ROWS.
PACKED_MIN_ROWS = 2
#: oneDNN's bf16 GEMM (dense or prepacked) in batch-invariant mode: at least BF16_MIN_ROWS rows, blocks
#: of at most BF16_MAX_ROWS on a CPU with AMX, else MAX_ROWS (``bf16_row_blocks``). On the AMD EPYC with
#: AVX-512 BF16 and no AMX (Zen 4), one row alone gets other bits for some outputs when K > 576
#: (K = 1,536, 2,048, 5,632) and every M from 2 to 1,100 agrees at every position (1 and 2 threads,
#: random-135m and random-1b shapes); on the Xeon with AMX every M from 1 to 32 agrees and some rows
#: change from M = 33 (another kernel).
BF16_MIN_ROWS, BF16_MAX_ROWS = 2, 32
#: torch's fp16 GEMM on a CPU with oneDNN fp16, in batch-invariant mode: at least this many rows
#: (on the Xeon one row alone takes another kernel; M from 2 to 300 kept every row's bits), blocks
#: of at most MAX_ROWS.
FP16_MIN_ROWS = 2

#: float32 weights of at least this many elements are prepacked for oneDNN (module docstring): from
#: here oneDNN's faster kernels pay for its fixed call cost (random-135m: q/k/v 553k, down 885k,
#: gate/up 1.8M elements and the lm_head are packed, o_proj 332k is not; stories260K: none).
PREPACK_MIN_NUMEL = 1 << 19
#: bf16 weights on a CPU with oneDNN bf16 are all prepacked: on the Xeon with AMX the packed GEMM
#: was as fast or faster than the dense one at every measured shape (64 x 128 up to 576 x 49,152)
#: and M (1-256): 1.1-3.1x at the random-135m shapes (docs/benchmarks.md "Matmul choices").
PREPACK_MIN_NUMEL_BF16 = 1
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
#: the batch size oneDNN packs the weights for (any M runs; measured no faster with 1 or 64)
PREPACK_ROWS = 16
MATMUL_BACKENDS = ("auto", "pagedgen", "onednn", "mkl", "amx")
#: output features per panel of a weight packed for pagedgen's own GEMM (csrc/cpu/linear.cpp)
PANEL = 16


def cpu_matmul_backend(dtype: Optional[torch.dtype] = None) -> str:
    """The CPU matmul path ``PAGEDGEN_CPU_MATMUL`` asks for, "auto" resolved: "pagedgen" (packed
    panels) on a CPU whose torch capability is AVX2 when the kernel is built; "pagedgen" for a
    bfloat16 model (``dtype``) on a CPU with AVX512-BF16 and no AMX where the bf16-pair kernel is
    built (``bf16_pairs_available``); else "onednn".

    Raises:
        ValueError: ``PAGEDGEN_CPU_MATMUL`` is not one of ``MATMUL_BACKENDS``, or is "pagedgen" where
            pagedgen._C has no ``packed_linear`` kernel (not built, or built without AVX2 and FMA).
    """
    backend = os.environ.get("PAGEDGEN_CPU_MATMUL", "auto").strip().lower()  # "oneDNN", "MKL" read too
    if backend not in MATMUL_BACKENDS:
        raise ValueError(f"PAGEDGEN_CPU_MATMUL must be one of {MATMUL_BACKENDS}, got {backend!r}")
    if backend == "auto":
        if ops.has_kernel("packed_linear") and torch.backends.cpu.get_cpu_capability() == "AVX2":
            return "pagedgen"
        # AVX512-BF16 without AMX (AMD EPYC Zen 4): the bf16-pair GEMM beat oneDNN's row-blocked GEMM at
        # every random-135m/1b shape (docs/benchmarks.md, 2026-12-04). With AMX, oneDNN's AMX GEMM stays
        # until an AMX micro-kernel is measured there.
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
    """True when pagedgen._C has the AMX GEMM (``packed_linear_bf16_amx``) and the CPU has AMX-TILE and
    AMX-BF16 with the tile state enabled by the OS (``torch.ops.pagedgen.cpu_has_amx``: cpuid leaf 7
    EDX bits 22/24, XCR0 bits 17/18)."""
    return (ops.has_kernel("packed_linear_bf16_amx") and hasattr(torch.ops.pagedgen, "cpu_has_amx")
            and bool(torch.ops.pagedgen.cpu_has_amx()))


_AMX_CHECKED: list = []


class AmxUnavailableError(RuntimeError):
    """pagedgen's AMX GEMM raised at its self-check (e.g. Linux refused the tile state): not usable here."""


def amx_self_check(run=None) -> None:
    """Check pagedgen's AMX GEMM once per process before a model uses it: a small GEMM (K = 100, an odd
    chunk tail; N = 40, a partial panel; M = 37, a partial row tile) against the float32 product
    within bf16 rounding, and batch invariance (each row of M = 1 bit-equal to that row of M = 37).
    ``run``: the op to check (default ``torch.ops.pagedgen.packed_linear_bf16_amx``; the tests pass
    the emulation). The result is kept only for the default op.

    Raises:
        AmxUnavailableError: (a RuntimeError) the kernel raised (e.g. Linux refused the tile state).
        RuntimeError: a result is wrong, with what mismatched.
    """
    default = run is None
    if default and _AMX_CHECKED:
        return
    run = run or torch.ops.pagedgen.packed_linear_bf16_amx
    g = torch.Generator().manual_seed(36)
    m, n, k = 37, 40, 100
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g)
    packed = pack_pairs(w)
    out = torch.empty(m, n, dtype=torch.bfloat16)
    try:
        run(out, x, packed, bias)
    except RuntimeError as e:
        raise AmxUnavailableError(f"pagedgen AMX GEMM self-check: the kernel raised: {e}") from e
    ref = x.double() @ w.double().T + bias.double()
    bound = 2 * (k + 1) * torch.finfo(torch.float32).eps * (x.double().abs() @ w.double().abs().T + bias.double().abs())
    bound = bound + torch.finfo(torch.bfloat16).eps * ref.abs()
    err = (out.double() - ref).abs()
    if not bool((err <= bound).all()):
        i, j = divmod(int((err - bound).argmax()), n)
        raise RuntimeError(f"pagedgen AMX GEMM self-check: out[{i}, {j}] = {float(out[i, j])} but the float32 product is "
                           f"{float(ref[i, j])} (error {float(err[i, j]):.3g} > bound {float(bound[i, j]):.3g}); not using it")
    for i in range(m):
        one = torch.empty(1, n, dtype=torch.bfloat16)
        run(one, x[i:i + 1], packed, bias)
        if not torch.equal(one.view(torch.int16), out[i:i + 1].view(torch.int16)):
            raise RuntimeError(f"pagedgen AMX GEMM self-check: row {i} alone differs from row {i} of {m} rows "
                               "(not batch-invariant); not using it")
    if default:
        _AMX_CHECKED.append(True)


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


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] weight -> [ceil(N / PANEL), K, PANEL] panels, same dtype: ``out[p, k, j] = weight[PANEL
    p + j, k]``, zeros past N. The layout ``ops.packed_linear`` reads: one panel row holds the k-th
    input feature's weights of PANEL consecutive outputs.

    Raises:
        TypeError: ``weight`` is not a tensor.
        ValueError: ``weight`` is not a 2-D float32, bfloat16 or float16 tensor.
    """
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"pack_panels needs a torch.Tensor weight, got {type(weight).__name__}")
    if weight.dim() != 2 or weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"pack_panels needs a 2-D float32, bfloat16 or float16 weight, got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    padded = F.pad(weight.detach(), (0, 0, 0, -n % PANEL))  # [P * PANEL, K]
    return padded.view(-(-n // PANEL), PANEL, k).transpose(1, 2).contiguous()  # [P, K, PANEL]


def pack_pairs(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bf16 weight -> [ceil(N / PANEL), ceil(K / 2), PANEL, 2] bf16 pairs: ``out[p, q, j, t] =
    weight[PANEL p + j, 2 q + t]``, zeros past N and past K. The layout ``ops.packed_linear_bf16``
    reads: one panel row [p, q] (64 bytes, one AVX-512 register) holds the input pair (2 q, 2 q + 1)'s
    weights of PANEL consecutive outputs, as vdpbf16ps multiplies them.

    Raises:
        TypeError: ``weight`` is not a tensor.
        ValueError: ``weight`` is not a 2-D bfloat16 tensor.
    """
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"pack_pairs needs a torch.Tensor weight, got {type(weight).__name__}")
    if weight.dim() != 2 or weight.dtype != torch.bfloat16:
        raise ValueError(f"pack_pairs needs a 2-D bfloat16 weight, got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    padded = F.pad(weight.detach(), (0, k % 2, 0, -n % PANEL))  # [P * PANEL, 2 Q]
    return padded.view(-(-n // PANEL), PANEL, -(-k // 2), 2).transpose(1, 2).contiguous()  # [P, Q, PANEL, 2]


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] float32 or bfloat16 weight -> the same matrix in oneDNN's blocked inner-product
    layout (an opaque ``is_mkldnn`` tensor of shape [N, K] and the same dtype and element size),
    for ``linear``. bf16 needs a CPU with oneDNN bf16 (``native_reduced_precision``).

    Raises:
        TypeError: ``weight`` is not a tensor.
        ValueError: ``weight`` is not a 2-D float32 or bfloat16 tensor with at least one element.
    """
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"prepack needs a torch.Tensor weight, got {type(weight).__name__}")
    if weight.dtype not in PACKABLE_DTYPES or weight.dim() != 2 or weight.numel() == 0:
        raise ValueError(f"prepack needs a non-empty 2-D float32 or bfloat16 weight, got {weight.dtype} {tuple(weight.shape)}")
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PREPACK_ROWS)


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

    Raises:
        ValueError: ``batch_invariant`` on a device other than the CPU (no such mode there yet);
            an unknown ``PAGEDGEN_CPU_MATMUL``.
    """
    device = torch.device(device)
    if device.type != "cpu":
        if batch_invariant:
            raise ValueError(f"LLM batch_invariant=True is available on the CPU only, not on {device.type!r} (not yet)")
        return MatmulConfig(dtype, reason=f"{device.type}: the model dtype's own GEMM")
    backend = cpu_matmul_backend(dtype)
    if backend == "amx":
        if dtype != torch.bfloat16:
            raise ValueError(f"PAGEDGEN_CPU_MATMUL=amx runs bfloat16 models only, got {dtype}")
        try:
            amx_self_check()
            return MatmulConfig(dtype, pairs=True, amx=True, reason="pagedgen's AMX GEMM on bf16 pairs (tdpbf16ps, float32 sums; opt-in)")
        except AmxUnavailableError as e:  # a wrong result raises RuntimeError through; an unusable kernel falls back
            warnings.warn(f"{e}; PAGEDGEN_CPU_MATMUL=amx falls back to oneDNN", RuntimeWarning, stacklevel=2)
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


def _matmul_modules(model: nn.Module) -> Iterator[nn.Module]:
    """The modules whose matmul runs through ``linear``: those that declare a ``matmul`` attribute
    (``MatmulConfig`` or None: the linear layers of pagedgen.layers.linear and the lm_head)."""
    for module in model.modules():
        if hasattr(module, "matmul") and isinstance(getattr(module, "weight", None), torch.Tensor):
            yield module


def prepare_matmuls(model: nn.Module, config: MatmulConfig) -> int:
    """Apply ``config`` to every linear layer and lm_head of a loaded ``model``: weights and biases
    converted to ``config.weight_dtype`` one at a time (the old copy freed), weights packed in panels
    (``config.panels``) or, of at least ``config.prepack_min_numel`` elements, prepacked for oneDNN
    (the dense copy freed), and ``module.matmul = config``. An lm_head tied to its embedding that is
    converted or packed gets its own matrix; the embedding keeps its own. Returns the bytes the
    weights took in addition (0 when they are kept as they are; panels add the zero rows that pad
    the last one)."""
    extra = 0
    for module in _matmul_modules(model):
        module.matmul = config
        for name in ("weight", "bias"):
            p = getattr(module, name)
            if p is None:
                continue
            panels = (config.panels or config.pairs) and name == "weight"
            pack = name == "weight" and 0 < config.prepack_min_numel <= p.numel() and config.weight_dtype in PACKABLE_DTYPES
            if p.dtype == config.weight_dtype and not pack and not panels:
                continue
            shared = getattr(module, "tied", False) and name == "weight"
            new = p.detach().to(config.weight_dtype)
            new = (pack_pairs(new) if config.pairs else pack_panels(new)) if panels else prepack(new) if pack else new
            extra += new.numel() * new.element_size() - (0 if shared else p.numel() * p.element_size())
            new = nn.Parameter(new, requires_grad=False)
            if shared:
                module.tied = False  # its own matrix now; the embedding keeps the model-dtype one
            setattr(module, name, new)
    return extra
