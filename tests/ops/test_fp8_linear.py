"""``fp8_linear`` (FP8 W8A16, issue 46): the e4m3 -> float16 bit placement the kernel uses, over all 256
codes against torch's float8 conversion (in PyTorch, and through the kernel with an identity input);
the PyTorch reference against a plain dequantize-and-matmul; the CPU kernel (AVX2 + F16C) against the
reference over random shapes (odd N, K not a multiple of 16 or of the block, per-channel and block-wise
scales, batches 1..300, three dtypes) and bitwise against pagedgen's float32 panel GEMM on the
fake-quantized weights; rows bitwise independent of the batch and of the threads (both of the kernel's
paths); ``pack_fp8``'s layout and its refusal of NaN codes; the layer's packing at load and the scale
limits ``finish_fp8`` checks; opcheck and the argument errors."""
import pytest
import torch

from pagedgen import ops
from pagedgen.layers.linear import LinearBase
from pagedgen.layers.matmul import fp8_linear, pack_panels
from pagedgen.layers.quant_fp8 import FP8_DTYPE, finish_fp8, pack_fp8, quantize_linear_fp8, unpack_fp8
from pagedgen.ops import reference
from w_only_cases import ACTIVATION_BAD_CALLS, assert_rows_independent

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
needs_kernel = pytest.mark.skipif(not ops.has_kernel("fp8_linear"), reason="pagedgen._C has no fp8_linear CPU kernel (AVX2 + F16C)")
NAN_CODES = (0x7F, 0xFF)


def all_codes() -> torch.Tensor:
    """The 256 bytes as float8_e4m3fn."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE)


def case(m, n, k, block_k, dtype, seed=0):
    """x [m, k], codes [n, k] float8_e4m3fn (every finite code likely), scales ([n] or [n, ceil(k / block_k)]),
    the real weight [n, k] float32 and a bias."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k), generator=g, dtype=torch.int32).to(torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C  # no NaN codes (the loaders refuse them)
    codes = codes.view(FP8_DTYPE)
    scale = torch.rand(n, -(-k // block_k), generator=g) * 0.01 + 1e-4 if block_k else torch.rand(n, generator=g) * 0.01 + 1e-4
    s = scale.repeat_interleave(block_k, 1)[:, :k] if block_k else scale[:, None]
    real = codes.float() * s
    x = torch.randn(m, k, generator=g).to(dtype)
    return x, codes, scale, real, torch.randn(n, generator=g).to(dtype)


def _call(fn, x, packed, scale, block_k, bias=None):
    out = torch.empty(x.shape[0], scale.shape[0], dtype=x.dtype)
    fn(out, x, packed, scale, block_k, bias)
    return out


def run(fn, x, codes, scale, block_k, bias=None):
    return _call(fn, x, pack_fp8(codes), scale, block_k, bias)


def test_the_bit_placement_gives_every_code_times_two_to_the_minus_8():
    """``sign << 15 | (code & 0x7f) << 7`` read as float16 is the e4m3fn value * 2^-8 for all 254 finite
    codes (normals, subnormals, +-0), exactly; the NaN codes would read as +-480 (why they are refused)."""
    c = torch.arange(256, dtype=torch.int32)
    h = (((c << 8) & 0x8000) | ((c << 7) & 0x3F80)).to(torch.int16).view(torch.float16).float() * 256
    want = all_codes().float()
    finite = torch.ones(256, dtype=torch.bool)
    finite[list(NAN_CODES)] = False
    assert torch.equal(h[finite], want[finite]) and torch.equal(torch.signbit(h[finite]), torch.signbit(want[finite]))
    assert torch.isnan(want[~finite]).all() and h[~finite].tolist() == [480.0, -480.0]
    assert want[1] == 2.0 ** -9 and want[8] == 2.0 ** -6 and want[0x7E] == 448  # smallest subnormal, smallest normal, largest


@needs_kernel
@pytest.mark.parametrize("scale", [1.0, 3.7e-3, 2.0 ** -130, 1e30], ids=["one", "small", "subnormal", "large"])
def test_the_kernel_dequantizes_every_code_exactly(scale):
    """x = the identity: out[m, n] is W[n, m] itself, float32(code) * scale rounded once, for every
    finite code at every output lane, in the register path (1-4 rows) and the panel buffer's (256)."""
    k = 256
    n = torch.arange(19)[:, None]
    codes = ((torch.arange(k)[None, :] + 7 * n) % 256).to(torch.uint8)  # each output lane sees every byte
    codes[(codes & 0x7F) == 0x7F] = 0
    codes = codes.view(FP8_DTYPE)
    s = torch.full((19,), scale)
    want = (codes.float() * s[:, None]).t()  # [K, N]
    eye = torch.eye(k)
    assert torch.equal(run(torch.ops.pagedgen.fp8_linear, eye, codes, s, 0), want)
    for rows in (slice(0, 1), slice(5, 8), slice(100, 104)):
        assert torch.equal(run(torch.ops.pagedgen.fp8_linear, eye[rows], codes, s, 0), want[rows])


@pytest.mark.parametrize("block_k", [0, 8, 100])
def test_reference_is_the_dequantized_matmul(block_k):
    x, codes, scale, real, b = case(7, 37, 200, block_k, torch.float32)
    out = run(reference.fp8_linear, x, codes, scale, block_k, b)
    torch.testing.assert_close(out, x @ real.t() + b, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m, n, k, block_k", [(1, 16, 64, 0), (3, 37, 200, 0), (5, 33, 172, 8), (9, 300, 256, 128),
                                              (300, 45, 96, 0), (64, 19, 130, 32), (4, 8, 7, 0), (2, 20, 100, 128)])
def test_kernel_matches_the_reference(m, n, k, block_k, dtype):
    x, codes, scale, _, b = case(m, n, k, block_k, dtype, seed=m + n)
    for bias in (b, None):
        got = run(torch.ops.pagedgen.fp8_linear, x, codes, scale, block_k, bias)
        want = run(reference.fp8_linear, x, codes, scale, block_k, bias)
        tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=3e-2)
        torch.testing.assert_close(got.float(), want.float(), **tol)


@needs_kernel
@pytest.mark.skipif(not ops.has_kernel("packed_linear"), reason="no packed_linear CPU kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m, block_k", [(1, 0), (3, 16), (40, 0), (40, 16)])
def test_bitwise_the_panel_gemm_on_the_fake_quantized_weight(m, block_k, dtype):
    """The same float32 weights, the same fused multiply-adds over k in order, + bias, one rounding:
    FP8 gives the bits of pagedgen's float GEMM on the fake-quantized float32 weights."""
    x, codes, scale, real, b = case(m, 37, 90, block_k, dtype, seed=3)
    panel = torch.empty(m, 37, dtype=dtype)
    ops.packed_linear(panel, x, pack_panels(real), b)
    assert torch.equal(run(torch.ops.pagedgen.fp8_linear, x, codes, scale, block_k, b), panel)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_k", [0, 32])
def test_rows_are_bitwise_independent_of_the_batch_and_threads(dtype, block_k):
    """A row alone (the in-register path), in tiles of any size and in a batch of 300 (the panel
    buffer path), on one thread or all: the same bits."""
    x, codes, scale, _, b = case(300, 70, 160, block_k, dtype, seed=5)
    packed = pack_fp8(codes)
    assert_rows_independent(lambda rows: _call(torch.ops.pagedgen.fp8_linear, rows, packed, scale, block_k, b), x)


def test_pack_fp8_layout_and_refusals():
    codes = torch.randint(0, 0x7F, (37, 24), generator=torch.Generator().manual_seed(1), dtype=torch.uint8).view(FP8_DTYPE)
    p = pack_fp8(codes)
    assert p.shape == (3, 24, 16) and p.dtype == FP8_DTYPE and p.is_contiguous()
    for n, k in ((0, 0), (9, 5), (20, 23), (36, 1)):
        assert p[n // 16, k, n % 16].view(torch.uint8) == codes[n, k].view(torch.uint8)
    assert (p[2, :, 5:].view(torch.uint8) == 0).all()  # outputs 37..47 are padding
    assert torch.equal(unpack_fp8(p, 37).view(torch.uint8), codes.view(torch.uint8))
    for nan in NAN_CODES:
        bad = codes.view(torch.uint8).clone()
        bad[4, 7] = nan
        with pytest.raises(ValueError, match="holds a NaN"):
            pack_fp8(bad.view(FP8_DTYPE))
    with pytest.raises(ValueError, match="2-D float8_e4m3fn"):
        pack_fp8(codes.float())


def _layer(codes: torch.Tensor, scale: torch.Tensor) -> LinearBase:
    layer = LinearBase(codes.shape[1], codes.shape[0])
    layer.weight = torch.nn.Parameter(codes, requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
    return layer


def test_finish_fp8_packs_where_the_kernel_is_and_refuses_bad_values():
    x, codes, scale, real, _ = case(3, 20, 48, 0, torch.float32, seed=2)
    layer = _layer(codes, scale)
    finish_fp8(layer)
    assert layer.weight.shape == ((2, 48, 16) if ops.has_kernel("fp8_linear") else (20, 48)) and layer.weight.dtype == FP8_DTYPE
    torch.testing.assert_close(layer(x), x @ real.t(), rtol=1e-5, atol=1e-5)
    for bad, match in ((torch.full((20,), 1e37), "or above 1.33e"), (torch.zeros(20), "not finite and > 0")):
        with pytest.raises(ValueError, match=match):
            finish_fp8(_layer(codes, bad))
    nan = codes.view(torch.uint8).clone()
    nan[3, 3] = 0xFF
    with pytest.raises(ValueError, match="holds a NaN"):
        finish_fp8(_layer(nan.view(FP8_DTYPE), scale))


def test_online_quantization_packs_and_counts_the_padding():
    layer = LinearBase(32, 20)
    layer.weight = torch.nn.Parameter(torch.randn(20, 32), requires_grad=False)
    extra = quantize_linear_fp8(layer)
    packed = ops.has_kernel("fp8_linear")
    assert extra == 20 * 32 + 20 * 4 - 20 * 32 * 4 + (12 * 32 if packed else 0)  # 12 padding rows of 32 bytes
    assert layer.weight.dim() == (3 if packed else 2)


def test_dispatch_wrapper_packed_and_not():
    x, codes, scale, real, b = case(3, 20, 64, 16, torch.float32)
    want = x @ real.t() + b
    torch.testing.assert_close(fp8_linear(x, pack_fp8(codes), scale, b, None, 16), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fp8_linear(x, codes, scale, b, None, 16), want, rtol=1e-5, atol=1e-5)
    assert fp8_linear(x[:0], pack_fp8(codes), scale, b, None, 16).shape == (0, 20)
    strided = x.t().contiguous().t()  # columns not contiguous: the wrapper copies the rows
    torch.testing.assert_close(fp8_linear(strided, pack_fp8(codes), scale, None, None, 16), x @ real.t(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"\[20, 4\] scales"):
        fp8_linear(x, pack_fp8(codes), scale[:, :2], b, None, 16)
    with pytest.raises(ValueError, match="float8_e4m3fn weight"):
        fp8_linear(x, pack_fp8(codes)[:1], scale, b, None, 16)


@needs_kernel
def test_opcheck_and_only_out_is_written():
    """opcheck's fake-tensor and dispatch tests; its schema test compares tensors with arithmetic torch
    lacks for float8 ("mul_cpu_reduced_float" not implemented), so what it checks, that the op
    writes out and nothing else, is checked here on the bytes."""
    x, codes, scale, _, b = case(3, 20, 64, 0, torch.float32)
    args = (torch.empty(3, 20), x, pack_fp8(codes), scale, 0, b)
    torch.library.opcheck(torch.ops.pagedgen.fp8_linear, args,
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    before = [t.clone() for t in args[1:] if isinstance(t, torch.Tensor)]
    out = torch.full((3, 20), float("nan"))
    torch.ops.pagedgen.fp8_linear(out, *args[1:])
    assert not torch.isnan(out).any()
    for a, t in zip(before, [t for t in args[1:] if isinstance(t, torch.Tensor)]):
        assert torch.equal(a.view(torch.uint8), t.view(torch.uint8)) if a.dtype == FP8_DTYPE else torch.equal(a, t)


@needs_kernel
@pytest.mark.parametrize("change, match", [
    (lambda a: a.update(block_k=-1), "block_k must be >= 0"),
    (lambda a: a.update(block_k=16), r"weight_scale must be \[20, 4\] for block_k 16"),
    (lambda a: a.update(s=a["s"][:5]), r"weight_scale must be \[20\] \(per output channel"),
    (lambda a: a.update(w=a["w"][:, :10]), r"weight must be \[2, 64, 16\]"),
    (lambda a: a.update(w=a["w"].view(torch.uint8)), "weight must be float8_e4m3fn"),
    (lambda a: a.update(s=a["s"].double()), "weight_scale must be float32"),
] + ACTIVATION_BAD_CALLS)
def test_bad_calls_raise_naming_the_argument(change, match):
    x, codes, scale, _, b = case(3, 20, 64, 0, torch.float32)
    args = dict(out=torch.empty(3, 20), x=x, w=pack_fp8(codes), s=scale, block_k=0, bias=b)
    change(args)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.pagedgen.fp8_linear(args["out"], args["x"], args["w"], args["s"], args["block_k"], args["bias"])
