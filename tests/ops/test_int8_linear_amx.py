"""The AMX-INT8 W8A8 GEMM (``int8_linear_amx``, csrc/cpu/linear_int8_amx.h through the tile loop of
csrc/cpu/linear_amx_loop.h) and its dispatch (``pagedgen.layers.matmul.int8_amx``).

The AMX kernel and its emulated twin (``int8_linear_amx_emulated``: the same loop, quad packing, prologue
and write-back on tdpbssd emulated in C++) must give ``int8_linear``'s bits (the AVX2 tiles) for every M,
so the layers may switch paths by M without breaking batch invariance: checked bitwise here over M = 1..40
and past a row block, K odd / not a multiple of 64, N not a multiple of 16, bias or none, static and dynamic
scales, float32 / bf16 / fp16 inputs. The real kernel's tests skip on CPUs without AMX-INT8.
"""
from __future__ import annotations

import pytest
import torch

from pagedgen import ops
from pagedgen.layers import matmul as lin
from pagedgen.ops import reference

pytestmark = pytest.mark.skipif(not ops.has_kernel("int8_linear_amx_emulated"),
                                reason="pagedgen._C was built without the AMX int8 GEMM ops (they need AVX2)")

HAS_AMX_INT8 = lin.cpu_has_amx_int8() if ops.has_kernel("int8_linear_amx") else False
needs_amx_int8 = pytest.mark.skipif(not HAS_AMX_INT8, reason="no AMX-INT8 here (cpu_has_amx_int8() is False): the AMX "
                                    "kernel cannot run; its tile loop is tested through the emulation")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def emulated(*args):
    torch.ops.pagedgen.int8_linear_amx_emulated(*args)


def real(*args):
    torch.ops.pagedgen.int8_linear_amx(*args)


def case(m, n, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    ws = torch.rand(n, generator=g) * 0.01 + 1e-4
    return x, lin.pack_int8(w), ws, torch.randn(n, generator=g).to(dtype)


def out_of(fn, x, packed, ws, n, s, b):
    out = torch.empty(x.shape[0], n, dtype=x.dtype)
    fn(out, x, packed, ws, s, b)
    return out


def same_bits(a, b):
    return torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))


def check_every_m(run, n, k, dtype, seed, rows=range(1, 41)):
    """run == int8_linear == the reference, bit for bit, at every M of ``rows`` (the rows taken from the
    middle of one batch), with and without bias, static and dynamic scales."""
    x, packed, ws, b = case(max(rows) + 7, n, k, dtype, seed)
    for s, bias in ((None, b), (torch.tensor([0.02]), None), (None, None), (torch.tensor([0.05]), b.float())):
        for m in rows:
            xm = x[(x.shape[0] - m) // 2:][:m]
            got = out_of(run, xm, packed, ws, n, s, bias)
            want = out_of(torch.ops.pagedgen.int8_linear, xm, packed, ws, n, s, bias)
            assert same_bits(got, want), f"M = {m}, static {s is not None}, bias {bias is not None}: not int8_linear's bits"
        assert same_bits(got, out_of(reference.int8_linear, xm, packed, ws, n, s, bias))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(131, 40), (1, 1), (64, 16), (65, 17), (200, 130)], ids=lambda s: f"K{s[0]}xN{s[1]}")
def test_emulation_has_int8_linears_bits_at_every_m(dtype, shape):
    k, n = shape
    rows = range(1, 41) if n * k < 10000 else (1, 2, 15, 16, 17, 31, 32, 33, 40)  # the largest: tile edges only
    check_every_m(emulated, n, k, dtype, seed=k * 7 + n, rows=rows)


def test_emulation_across_row_blocks_and_threads():
    """M = 530 crosses the kind's row block (512 rows: B tiles made again); 1 and 2 threads agree."""
    x, packed, ws, b = case(530, 50, 99, torch.bfloat16, seed=3)
    want = out_of(torch.ops.pagedgen.int8_linear, x, packed, ws, 50, None, b)
    before = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            assert same_bits(out_of(emulated, x, packed, ws, 50, None, b), want), f"{t} threads"
    finally:
        torch.set_num_threads(before)


def test_empty_calls_and_opcheck():
    x, packed, ws, b = case(0, 20, 9, torch.float32, seed=4)
    assert out_of(emulated, x, packed, ws, 20, None, b).shape == (0, 20)
    x, packed, ws, b = case(3, 20, 9, torch.bfloat16, seed=4)
    torch.library.opcheck(torch.ops.pagedgen.int8_linear_amx_emulated, (torch.empty(3, 20, dtype=torch.bfloat16), x, packed, ws, None, b))


@pytest.mark.parametrize("op", ["int8_linear_amx", "int8_linear_amx_emulated"])
def test_bad_calls_are_clear_errors_before_any_work(op):
    run = getattr(torch.ops.pagedgen, op)
    x, packed, ws, b = case(3, 20, 8, torch.bfloat16, seed=9)  # packed [2, 4, 16, 2]
    out = torch.empty(3, 20, dtype=torch.bfloat16)
    bad = [
        ((out, x, packed[:1], ws, None, None), r"weight must be contiguous int8 pairs \[2, 4, 16, 2\]"),
        ((out, x, packed.float(), ws, None, None), "weight must be contiguous int8 pairs"),
        ((out, x, packed.transpose(0, 1).contiguous().transpose(0, 1), ws, None, None), "weight must be contiguous int8 pairs"),
        ((out, x, packed, ws[:5], None, None), r"weight_scale must be float32 \[20\]"),
        ((out, x, packed, ws.double(), None, None), r"weight_scale must be float32 \[20\]"),
        ((out, x, packed, ws, torch.ones(2), None), r"input_scale must be float32 \[1\]"),
        ((torch.empty(3, 20), x, packed, ws, None, None), r"out must be BFloat16 \[3, N\]"),
        ((out, x, packed, ws, None, torch.ones(3)), r"bias must be float32, bfloat16 or float16 \[20\]"),
        ((out, x.t().contiguous().t(), packed, ws, None, None), r"input must be float32, bfloat16 or float16 \[M, K\]"),
        ((out, x.to(torch.int32), packed, ws, None, None), r"input must be float32, bfloat16 or float16"),
    ]
    for args, message in bad:
        with pytest.raises(RuntimeError, match=f"{op}: {message}"):
            run(*args)


@pytest.mark.skipif(HAS_AMX_INT8, reason="this CPU has AMX-INT8")
def test_without_amx_int8_the_real_op_refuses_after_its_checks():
    x, packed, ws, b = case(2, 20, 10, torch.float32, seed=1)
    why = ("this CPU .* has no AMX-TILE and AMX-INT8" if not torch.ops.pagedgen.cpu_has_amx_int8()
           else "the CPU kernels loaded were built without AMX-INT8")
    with pytest.raises(RuntimeError, match=f"int8_linear_amx: {why}"):
        out_of(real, x, packed, ws, 20, None, b)
    assert lin.int8_amx_min_rows() == 0  # the layers keep the AVX2 tiles


def test_detection_agrees_with_cpuinfo():
    flags = lin.cpu_has_flag("amx_tile") and lin.cpu_has_flag("amx_int8")
    assert bool(torch.ops.pagedgen.cpu_has_amx_int8()) == flags
    assert lin.cpu_has_amx_int8() == (flags and "amx_int8" in ops.cpu_isa_features())


def test_self_check_passes_on_the_emulation_and_names_a_wrong_kernel():
    lin.int8_amx_self_check(emulated)

    def off_at_17(out, *args):
        emulated(out, *args)
        if out.shape[0] == 17:
            out.view(torch.int16)[16, 0] ^= 1

    with pytest.raises(RuntimeError, match="M = 17 .* differs from int8_linear's bits"):
        lin.int8_amx_self_check(off_at_17)


def test_dispatch_by_rows_with_the_emulation(monkeypatch):
    """With AMX-INT8 reported (the op swapped for the emulation), choose_matmul sets INT8_AMX_MIN_ROWS after
    the self-check and int8_linear runs the AMX op from that many rows, with int8_linear's bits at every M;
    PAGEDGEN_CPU_INT8 picks the path; a kernel that fails its self-check is not used."""
    calls = []

    def counted(out, *args):
        calls.append(out.shape[0])
        emulated(out, *args)

    monkeypatch.setattr(lin.int8_amx, "cpu_has_amx_int8", lambda: True)
    monkeypatch.setattr(lin.int8_amx, "_DECIDED", [])
    monkeypatch.setattr(torch.ops.pagedgen, "int8_linear_amx", counted)
    cfg = lin.choose_matmul(torch.float32, torch.device("cpu"), batch_invariant=True)
    assert cfg.int8_amx_min_rows == lin.INT8_AMX_MIN_ROWS
    x, packed, ws, b = case(lin.INT8_AMX_MIN_ROWS + 3, 40, 70, torch.bfloat16, seed=8)
    calls.clear()
    full = lin.int8_linear(x, packed, ws, None, b, 40, cfg)
    assert calls == [x.shape[0]]
    for m in (1, lin.INT8_AMX_MIN_ROWS - 1):  # the AVX2 tiles, the same rows' bits
        assert same_bits(lin.int8_linear(x[:m], packed, ws, None, b, 40, cfg), full[:m])
    assert calls == [x.shape[0]]
    monkeypatch.setenv("PAGEDGEN_CPU_INT8", "avx2")
    assert lin.choose_matmul(torch.float32, torch.device("cpu"), batch_invariant=True).int8_amx_min_rows == 0
    monkeypatch.setenv("PAGEDGEN_CPU_INT8", "vnni")
    with pytest.raises(ValueError, match="PAGEDGEN_CPU_INT8 must be one of"):
        lin.choose_matmul(torch.float32, torch.device("cpu"), batch_invariant=True)

    def wrong(out, *args):
        emulated(out, *args)
        out.view(torch.int16)[0, 0] ^= 1

    monkeypatch.setattr(torch.ops.pagedgen, "int8_linear_amx", wrong)
    monkeypatch.setattr(lin.int8_amx, "_DECIDED", [])
    monkeypatch.setenv("PAGEDGEN_CPU_INT8", "auto")
    with pytest.warns(RuntimeWarning, match="differs from int8_linear's bits; int8 GEMMs stay on the AVX2 tiles"):
        assert lin.choose_matmul(torch.bfloat16, torch.device("cpu"), batch_invariant=True).int8_amx_min_rows == 0
    monkeypatch.setenv("PAGEDGEN_CPU_INT8", "amx")
    with pytest.raises(ValueError, match="PAGEDGEN_CPU_INT8=amx: the AMX int8 GEMM cannot run here"):
        lin.choose_matmul(torch.float32, torch.device("cpu"), batch_invariant=True)


@needs_amx_int8
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(131, 40), (1, 1), (65, 17), (200, 130), (576, 576), (1536, 576)], ids=lambda s: f"K{s[0]}xN{s[1]}")
def test_amx_has_int8_linears_bits_at_every_m(dtype, shape):
    k, n = shape
    check_every_m(real, n, k, dtype, seed=k * 7 + n)


@needs_amx_int8
@pytest.mark.parametrize("shape", [(576, 1536), (2048, 2048), (8192, 2048)], ids=lambda s: f"K{s[0]}xN{s[1]}")
def test_amx_model_shapes_and_prefill_rows(shape):
    k, n = shape
    check_every_m(real, n, k, torch.bfloat16, seed=k + n, rows=[1, 16, 17, 64, 256, 600])


@needs_amx_int8
def test_amx_self_check_passes():
    lin.int8_amx_self_check()
    assert lin.int8_amx_min_rows() == lin.INT8_AMX_MIN_ROWS
