"""``amx_self_check``: pagedgen's AMX GEMM (the default for bf16 models on CPUs with AMX; see ``choice``)
runs code that only AMX hardware executes (every other CPU tests its emulated twin), so before a model
uses it, it is checked once per process against the float32 product and for batch invariance; a kernel
that raises makes it unusable here (``AmxUnavailableError``), a wrong result is a RuntimeError.
``choose_matmul`` falls back to oneDNN on either by default, and raises the latter when
``PAGEDGEN_CPU_MATMUL=amx`` asked for the AMX GEMM.
"""
from __future__ import annotations

import torch

from pagedgen.layers.matmul.packing import pack_pairs

#: [True] once the default op passed its check in this process (a test that checks again replaces this
#: list here, in amx_check: the package's name is only a copy of the reference)
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
