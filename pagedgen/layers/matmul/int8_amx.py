"""``int8_amx_min_rows``: whether the W8A8 GEMM of int8 layers (``int8_linear``) runs on AMX-INT8 tiles
here, and from how many rows; chosen once per model by ``choose_matmul`` (``MatmulConfig.int8_amx_min_rows``).

Every level's int8 layers run ``ops.int8_linear`` (csrc/cpu/linear_int8.cpp, AVX2 ``vpmaddwd`` tiles).
On a CPU with AMX-INT8 whose loaded CPU kernels are the amx level, GEMMs of at least
``INT8_AMX_MIN_ROWS`` rows run ``int8_linear_amx`` instead (``tdpbssd``; csrc/cpu/linear_int8_amx.h):
the same bits for every M (integer sums are exact in any order, and the quantization and the
write-back are the same code), so choosing by M keeps batch invariance. The AMX path has not yet run
on AMX hardware, so before a model uses it, it is checked once per process against ``int8_linear``,
bit for bit (``int8_amx_self_check``); a kernel that raises or differs is not used (a warning, the AVX2
tiles stay). ``PAGEDGEN_CPU_INT8`` (read when an LLM is built): "auto" (the default: AMX where usable),
"avx2" (never AMX: the comparison run of benchmarks/quantized.py), "amx" (AMX or a ValueError).
"""
from __future__ import annotations

import os
import warnings

import torch

from pagedgen import ops
from pagedgen.layers.matmul.packing import pack_int8

#: the fewest rows an int8 GEMM runs on AMX tiles (fewer: the AVX2 tiles, which read each weight byte
#: once with no repacking). A guess until measured on the Xeon (benchmarks/int8_gemm.py, per shape and M):
#: one A tile of 16 rows pays for turning a panel's pairs into quads (K * 16 bytes per panel).
INT8_AMX_MIN_ROWS = 16
INT8_PATHS = ("auto", "avx2", "amx")

#: [min_rows] once decided in this process (a test that decides again replaces this list here, in int8_amx)
_DECIDED: list = []


def cpu_has_amx_int8() -> bool:
    """True when the CPU has AMX-TILE and AMX-INT8 with the tile state enabled (cpuid, XCR0:
    ``pagedgen::cpu_has_amx_int8``) and the CPU kernels loaded were compiled with AMX-INT8 (the amx level:
    ``ops.cpu_isa_features()``), where ``int8_linear_amx`` can run."""
    return (ops.has_kernel("int8_linear_amx") and bool(torch.ops.pagedgen.cpu_has_amx_int8())
            and "amx_int8" in ops.cpu_isa_features())


def int8_amx_self_check(run=None) -> None:
    """Check the AMX int8 GEMM against ``ops.int8_linear``, bit for bit: K = 131 (an odd K, a partial
    chunk of 64), N = 40 (a partial panel), every M from 1 to 40 (partial row tiles, one and two),
    dynamic and static scales, with and without bias, bf16 and float32 inputs.

    Args:
        run: the op to check (default ``torch.ops.pagedgen.int8_linear_amx``; the tests pass the emulation).

    Raises:
        RuntimeError: the kernel raised (the message says so), or an output differs from int8_linear's.
    """
    run = run or torch.ops.pagedgen.int8_linear_amx
    g = torch.Generator().manual_seed(46)
    m, n, k = 40, 40, 131
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    packed, ws = pack_int8(w), torch.rand(n, generator=g) * 0.01 + 1e-3
    for dtype, static, bias in ((torch.bfloat16, None, torch.randn(n, generator=g)), (torch.float32, torch.tensor([0.02]), None)):
        x = (torch.randn(m, k, generator=g) * 3).to(dtype)
        for rows in range(1, m + 1):
            want, got = torch.empty(rows, n, dtype=dtype), torch.empty(rows, n, dtype=dtype)
            ops.int8_linear(want, x[:rows], packed, ws, static, bias)
            try:
                run(got, x[:rows], packed, ws, static, bias)
            except RuntimeError as e:
                raise RuntimeError(f"pagedgen AMX int8 GEMM self-check: the kernel raised: {e}") from e
            if not torch.equal(got.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8)):
                raise RuntimeError(f"pagedgen AMX int8 GEMM self-check: M = {rows} ({dtype}, static scale {static is not None}) "
                                   "differs from int8_linear's bits")


def int8_amx_min_rows() -> int:
    """``INT8_AMX_MIN_ROWS`` where int8 GEMMs are to run on AMX tiles here (``PAGEDGEN_CPU_INT8`` not
    "avx2", ``cpu_has_amx_int8()``, the self-check passed once in this process), else 0 (the AVX2 tiles
    at every M). A failed self-check warns (RuntimeWarning) and gives 0.

    Raises:
        ValueError: ``PAGEDGEN_CPU_INT8`` is not one of ``INT8_PATHS``, or is "amx" where the AMX int8
            GEMM cannot run or failed its self-check.
    """
    path = os.environ.get("PAGEDGEN_CPU_INT8", "auto").strip().lower()
    if path not in INT8_PATHS:
        raise ValueError(f"PAGEDGEN_CPU_INT8 must be one of {INT8_PATHS}, got {path!r}")
    if path == "avx2":
        return 0
    if not _DECIDED:
        rows = 0
        if cpu_has_amx_int8():
            try:
                int8_amx_self_check()
                rows = INT8_AMX_MIN_ROWS
            except RuntimeError as e:
                warnings.warn(f"{e}; int8 GEMMs stay on the AVX2 tiles", RuntimeWarning, stacklevel=2)
        _DECIDED.append(rows)
    if path == "amx" and not _DECIDED[0]:
        raise ValueError("PAGEDGEN_CPU_INT8=amx: the AMX int8 GEMM cannot run here (no AMX-INT8 with the tile state, CPU "
                         f"kernels of level {ops.cpu_isa()!r}, or a failed self-check)")
    return _DECIDED[0]
