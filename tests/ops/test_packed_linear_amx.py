"""pagedgen's AMX GEMM (csrc/cpu/linear_amx.cpp, tile loop csrc/cpu/linear_amx_loop.h) and its dispatch.

The AMX kernel and the emulation of the tiles (packed_linear_bf16_amx_emulated) share the packing and
the tile loop, so the emulation's tests here check the AMX kernel's indexing on every CPU: against the
float32 product within bf16 rounding, and batch invariance bit for bit (a row alone, at any place in a
batch of any M, has the same bits). The same tests run the real kernel where the CPU has AMX and skip
elsewhere (not executed on the machine this was written on: an AMD EPYC Zen 4 without AMX).
"""
from __future__ import annotations

import pytest
import torch

from pagedgen import ops
from pagedgen.layers import matmul as lin

HAS_KERNELS = ops.has_kernel("packed_linear_bf16_amx_emulated")
pytestmark = pytest.mark.skipif(not HAS_KERNELS,
                                reason="pagedgen._C was built without the AMX GEMM ops")

HAS_AMX = lin.cpu_has_amx() if HAS_KERNELS else False
needs_amx = pytest.mark.skipif(not HAS_AMX, reason="this CPU has no AMX-TILE/AMX-BF16 (cpu_has_amx() is False): "
                               "the AMX kernel cannot run here; its tile loop is tested through the emulation")


_EMULATED = getattr(torch.ops.pagedgen, "packed_linear_bf16_amx_emulated", None) if HAS_KERNELS else None


def emulated(out, x, w, b=None):
    _EMULATED(out, x, w, b)


def real(out, x, w, b=None):
    torch.ops.pagedgen.packed_linear_bf16_amx(out, x, w, b)


# (K, N): the random-135m and random-1b GEMMs (q/o, k/v, gate/up, down, lm_head)
MODEL_SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576), (2048, 2048), (2048, 8192), (8192, 2048), (576, 49152)]
# (K, N) for the slow emulation: tails of every kind (K odd, K % 32 != 0, N % 16 != 0, one panel, odd panels)
EMU_SHAPES = [(1, 1), (7, 15), (32, 16), (33, 17), (100, 40), (64, 48), (576, 72), (200, 130)]


def check_close(out, x, w, bias):
    x64, w64 = x.double(), w.double()
    b64 = 0 if bias is None else bias.double()
    exact = x64 @ w64.T + b64
    k = x.shape[1]
    bound = 2 * (k + 1) * torch.finfo(torch.float32).eps * (x64.abs() @ w64.abs().T + abs(b64)) + 1e-30
    bound = bound + torch.finfo(torch.bfloat16).eps * exact.abs() + torch.finfo(torch.bfloat16).tiny
    err = (out.double() - exact).abs()
    assert bool((err <= bound).all()), f"max error {float((err - bound).max()):.3g} over the bound"


def check_gemm(run, k, n, rows, seed, bias=True):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g) if bias else None
    packed = lin.pack_pairs(w)
    m = max(rows)
    x = torch.randn(m, k, generator=g).bfloat16()
    full = torch.empty(m, n, dtype=torch.bfloat16)
    run(full, x, packed, b)
    check_close(full, x, w, b)
    for r in rows:  # every batch size r: its rows equal the same rows of the full batch, bit for bit
        part = torch.empty(r, n, dtype=torch.bfloat16)
        off = (m - r) // 2  # rows taken from the middle: other places in their tiles
        run(part, x[off:off + r], packed, b)
        assert torch.equal(part.view(torch.int16), full[off:off + r].view(torch.int16)), f"M = {r} differs from M = {m}"


def test_detection_is_false_without_amx_flags():
    """cpu_has_amx agrees with /proc/cpuinfo (amx_tile and amx_bf16 both listed); the model's choice also
    needs the CPU kernels of a level with AMX (not a lower one forced by PAGEDGEN_CPU_ISA)."""
    flags = lin.cpu_has_flag("amx_tile") and lin.cpu_has_flag("amx_bf16")
    assert bool(torch.ops.pagedgen.cpu_has_amx()) == flags
    assert lin.cpu_has_amx() == (flags and "amx_bf16" in ops.cpu_isa_features())


@pytest.mark.parametrize("shape", EMU_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_emulation_matches_reference_and_is_batch_invariant(shape):
    k, n = shape
    check_gemm(emulated, k, n, rows=[1, 2, 5, 16, 17, 33, 37], seed=k * 131 + n, bias=k % 2 == 0)


@pytest.mark.parametrize("shape", [(576, 576), (1536, 576)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_emulation_model_shapes(shape):
    k, n = shape
    check_gemm(emulated, k, n, rows=[1, 3, 8, 37], seed=k + n)


def test_emulation_rows_independent_of_threads():
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(96, 64, generator=g).bfloat16(), torch.randn(40, 64, generator=g).bfloat16()
    packed = lin.pack_pairs(w)
    outs = []
    before = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            out = torch.empty(40, 96, dtype=torch.bfloat16)
            emulated(out, x, packed)
            outs.append(out)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))


def test_self_check_passes_on_the_emulation_and_names_a_wrong_kernel():
    lin.amx_self_check(emulated)

    def off_by_row(out, x, w, b=None):  # a row alone gets other bits (1 ulp): not batch-invariant
        emulated(out, x, w, b)
        if out.shape[0] == 1:
            out.view(torch.int16).bitwise_xor_(1)

    with pytest.raises(RuntimeError, match="row 0 alone differs from row 0 of 37 rows"):
        lin.amx_self_check(off_by_row)

    def wrong(out, x, w, b=None):
        emulated(out, x, w, b)
        out[0, 3] += 1.0

    with pytest.raises(RuntimeError, match=r"out\[0, 3\]"):
        lin.amx_self_check(wrong)


@pytest.mark.parametrize("op", ["packed_linear_bf16_amx", "packed_linear_bf16_amx_emulated"])
def test_argument_checks_before_any_work(op):
    run = getattr(torch.ops.pagedgen, op)
    w = lin.pack_pairs(torch.randn(20, 10).bfloat16())  # [2, 5, 16, 2]
    x = torch.randn(3, 10).bfloat16()
    out = torch.empty(3, 20, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=f"{op}: input and weight must be bfloat16"):
        run(out, x.float(), w, None)
    with pytest.raises(RuntimeError, match=f"{op}: input must be \\[M, K\\] with contiguous rows"):
        run(out, torch.randn(10, 3).bfloat16().T, w, None)
    with pytest.raises(RuntimeError, match=f"{op}: out must be BFloat16"):
        run(torch.empty(3, 20), x, w, None)
    with pytest.raises(RuntimeError, match=f"{op}: weight must be contiguous pairs \\[2, 5, 16, 2\\]"):
        run(out, x, w[:, :4].contiguous(), None)
    with pytest.raises(RuntimeError, match=f"{op}: weight must be contiguous pairs"):
        run(out, x, w.transpose(0, 1).contiguous().transpose(0, 1), None)
    with pytest.raises(RuntimeError, match=f"{op}: bias must be"):
        run(out, x, w, torch.randn(19))


@pytest.mark.skipif(HAS_AMX, reason="this CPU has AMX")
def test_without_amx_the_kernel_and_the_backend_refuse():
    """On a CPU without AMX, or with CPU kernels of a level without it (PAGEDGEN_CPU_ISA)."""
    out = torch.empty(2, 20, dtype=torch.bfloat16)
    why = "this CPU .* has no AMX" if not torch.ops.pagedgen.cpu_has_amx() else "the CPU kernels loaded were built without AMX"
    with pytest.raises(RuntimeError, match=f"packed_linear_bf16_amx: {why}"):
        real(out, torch.randn(2, 10).bfloat16(), lin.pack_pairs(torch.randn(20, 10).bfloat16()), None)


@pytest.mark.skipif(HAS_AMX, reason="this CPU has AMX")
def test_backend_amx_is_an_error_without_amx(monkeypatch):
    monkeypatch.setenv("PAGEDGEN_CPU_MATMUL", "amx")
    with pytest.raises(ValueError, match="PAGEDGEN_CPU_MATMUL=amx needs a CPU with AMX"):
        lin.choose_matmul(torch.bfloat16, torch.device("cpu"), batch_invariant=True)


def fake_amx(monkeypatch) -> list:
    """AMX reported here, the self-check not yet run, and torch.ops.pagedgen swapped for an object whose
    packed_linear_bf16_amx runs the emulation; returns the list of the output shapes it was called with."""
    monkeypatch.setattr(lin.choice, "cpu_has_amx", lambda: True)
    monkeypatch.setattr(lin.amx_check, "_AMX_CHECKED", [])
    calls = []

    class FakeOps:
        def packed_linear_bf16_amx(self, *a):
            calls.append(a[0].shape)
            emulated(*a)

    monkeypatch.setattr(torch.ops, "pagedgen", FakeOps(), raising=False)
    return calls


def test_backend_amx_dispatch_with_the_emulation(monkeypatch):
    """With AMX reported, PAGEDGEN_CPU_MATMUL=amx packs pairs and linear runs the AMX op (here swapped
    for the emulation, so the dispatch is exercised on this CPU); a kernel that raises falls back."""
    monkeypatch.setenv("PAGEDGEN_CPU_MATMUL", "amx")
    calls = fake_amx(monkeypatch)
    cfg = lin.choose_matmul(torch.bfloat16, torch.device("cpu"), batch_invariant=True)
    assert cfg.amx and cfg.pairs and cfg.batch_invariant
    w = torch.randn(40, 64).bfloat16()
    x = torch.randn(5, 64).bfloat16()
    y = lin.linear(x, lin.pack_pairs(w), None, cfg, out_features=40)
    assert calls[-1] == (5, 40)
    check_close(y, x, w, None)
    with pytest.raises(ValueError, match="bfloat16 models only"):
        lin.choose_matmul(torch.float32, torch.device("cpu"), batch_invariant=True)

    class RaisingOps:
        def packed_linear_bf16_amx(self, *a):
            raise RuntimeError("Linux refused the AMX tile state")

    monkeypatch.setattr(torch.ops, "pagedgen", RaisingOps(), raising=False)
    monkeypatch.setattr(lin.amx_check, "_AMX_CHECKED", [])
    with pytest.warns(RuntimeWarning, match="refused the AMX tile state.*falls back to oneDNN"):
        cfg = lin.choose_matmul(torch.bfloat16, torch.device("cpu"), batch_invariant=True)
    assert not cfg.amx and not cfg.pairs


def test_auto_takes_the_amx_gemm_where_the_cpu_has_amx(monkeypatch):
    """"auto" (the default) runs bf16 models on the AMX GEMM where cpu_has_amx() (here reported, the op
    swapped for the emulation); float32/fp16 models keep their paths; a self-check that fails, by a
    raising kernel or a wrong result, falls back to oneDNN with a RuntimeWarning by default, while
    PAGEDGEN_CPU_MATMUL=amx raises on a wrong result; PAGEDGEN_CPU_MATMUL=onednn opts out."""
    monkeypatch.delenv("PAGEDGEN_CPU_MATMUL", raising=False)
    real_ops = torch.ops.pagedgen
    calls = fake_amx(monkeypatch)
    assert lin.cpu_matmul_backend(torch.bfloat16) == "amx"
    for invariant in (True, False):  # batch-invariant by construction either way
        cfg = lin.choose_matmul(torch.bfloat16, torch.device("cpu"), batch_invariant=invariant)
        assert cfg.amx and cfg.pairs and cfg.batch_invariant and "AMX" in cfg.reason
    w = torch.randn(40, 64).bfloat16()
    x = torch.randn(3, 64).bfloat16()
    check_close(lin.linear(x, lin.pack_pairs(w), None, cfg, out_features=40), x, w, None)
    assert calls[-1] == (3, 40)
    monkeypatch.setattr(torch.ops, "pagedgen", real_ops)
    for dtype in (torch.float32, torch.float16):
        assert not lin.choose_matmul(dtype, torch.device("cpu"), batch_invariant=True).amx

    class WrongOps:
        def packed_linear_bf16_amx(self, out, *a):
            emulated(out, *a)
            out[0, 0] += 1.0

    monkeypatch.setattr(torch.ops, "pagedgen", WrongOps(), raising=False)
    monkeypatch.setattr(lin.amx_check, "_AMX_CHECKED", [])
    with pytest.warns(RuntimeWarning, match=r"out\[0, 0\].*the default AMX GEMM falls back to oneDNN"):
        cfg = lin.choose_matmul(torch.bfloat16, torch.device("cpu"), batch_invariant=True)
    assert not cfg.amx and not cfg.pairs and lin.amx_check._AMX_CHECKED == []
    monkeypatch.setenv("PAGEDGEN_CPU_MATMUL", "amx")
    with pytest.raises(RuntimeError, match=r"self-check: out\[0, 0\]"):
        lin.choose_matmul(torch.bfloat16, torch.device("cpu"), batch_invariant=True)
    monkeypatch.setenv("PAGEDGEN_CPU_MATMUL", "onednn")
    assert not lin.choose_matmul(torch.bfloat16, torch.device("cpu"), batch_invariant=True).amx


@needs_amx
@pytest.mark.parametrize("shape", MODEL_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_amx_decode_shapes(shape):
    k, n = shape
    check_gemm(real, k, n, rows=[1, 2, 3, 4, 5, 6, 7, 8], seed=k * 7 + n)


@needs_amx
@pytest.mark.parametrize("shape", MODEL_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_amx_prefill_shapes(shape):
    k, n = shape
    rows = [1, 17, 37, 100, 256, 512] if k * n <= 2048 * 8192 // 4 else [1, 37, 256]
    check_gemm(real, k, n, rows=rows if k * n < 576 * 49152 else [1, 37, 128], seed=k * 11 + n)


@needs_amx
@pytest.mark.parametrize("shape", EMU_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_amx_tails_match_reference_and_are_batch_invariant(shape):
    k, n = shape
    check_gemm(real, k, n, rows=[1, 2, 5, 16, 17, 33, 37], seed=k * 131 + n, bias=k % 2 == 0)


@needs_amx
def test_amx_self_check_passes():
    lin.amx_self_check()
