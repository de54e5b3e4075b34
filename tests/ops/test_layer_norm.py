"""The encoders' fused residual add + LayerNorm (fused_add_layer_norm, one pass), the CPU kernel of
pagedgen._C against its reference (torch's add + F.layer_norm), in float32, bfloat16 and float16, over
odd sizes; bitwise batch invariance; bad calls; torch.library.opcheck.

Exactness: the sum is torch's add, bitwise. The norm takes two passes (mean, then the variance around
it) where torch uses Welford's cascade, and rounds once as torch does: in float32 it is within
LN_FP32_ULPS float32 ulps of F.layer_norm's output or LN_FP32_ABS absolute (values near 0, where the
output's ulp is tiny: the error is a few ulps of the output's scale), in bf16/fp16 within one ulp of
the dtype of torch's float32 layer norm of the rounded sum, or LN_FP32_ABS absolute.
"""
import pytest
import torch
import torch.nn.functional as F

import pagedgen.ops
from pagedgen.ops import reference

pytestmark = pytest.mark.skipif(
    not pagedgen.ops.has_kernel("fused_add_layer_norm"),
    reason="pagedgen._C is not built with fused_add_layer_norm",
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
LN_FP32_ULPS, LN_FP32_ABS = 8, 2e-6
# (num_tokens, hidden): bge-small's 384, BERT-base's 768, odd ones, one past the vector width
SIZES = [(1, 1), (3, 7), (5, 8), (4, 9), (37, 33), (64, 384), (9, 768), (2, 1001), (3, 4097)]


def ordered(t: torch.Tensor) -> torch.Tensor:
    bits = t.view({2: torch.int16, 4: torch.int32}[t.element_size()]).to(torch.int64)
    magnitude = bits & (0x7FFF if t.element_size() == 2 else 0x7FFFFFFF)
    return torch.where(bits >= 0, bits, -magnitude)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (ordered(a) - ordered(b)).abs()


def _rand(shape, dtype, seed, scale=1.0, shift=0.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale + shift).to(dtype)


def _ln_inputs(t, h, dtype, affine, seed=0):
    x, res = _rand((t, h), dtype, seed, 2.0, 0.5), _rand((t, h), dtype, seed + 1, 3.0)
    w = _rand((h,), dtype, seed + 2) if affine else None
    b = _rand((h,), dtype, seed + 3) if affine else None
    return x, res, w, b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("t,h", SIZES)
def test_fused_add_layer_norm_matches_torch(t, h, affine, dtype):
    x, res, w, b = _ln_inputs(t, h, dtype, affine, seed=t * 7 + h)
    rx, rres = x.clone(), res.clone()
    reference.fused_add_layer_norm(rx, rres, w, b, 1e-12)
    torch.ops.pagedgen.fused_add_layer_norm(x, res, w, b, 1e-12)
    assert torch.equal(res, rres)  # the add is torch's, bitwise
    d = ulp_distance(x, rx)
    if dtype == torch.float32:
        assert bool(((d <= LN_FP32_ULPS) | ((x - rx).abs() <= LN_FP32_ABS)).all()), int(d.max())
    else:
        # against torch's float32 kernel on the rounded sum, rounded once: torch's own bf16/fp16 kernel
        # can be further off (hidden 1, eps 1e-12: fp16 0.7002 for 0.7378)
        wf, bf = (w.float(), b.float()) if affine else (None, None)
        exact = F.layer_norm(rres.float(), (h,), wf, bf, 1e-12).to(dtype)
        near = (x.float() - exact.float()).abs() <= LN_FP32_ABS  # near 0, float32's own rounding
        assert bool(((ulp_distance(x, exact) <= 1) | near).all())


def test_fused_add_layer_norm_row_strides_and_large_offsets():
    # rows with a stride (a slice of a wider buffer); a row mean far from 0 (the two-pass variance)
    buf = _rand((6, 100), torch.float32, 3, 1.0, 1000.0)
    res = _rand((6, 40), torch.float32, 4)
    w, b = _rand((40,), torch.float32, 5), _rand((40,), torch.float32, 6)
    x = buf[:, 10:50]
    expect_sum = x + res
    expect = F.layer_norm(expect_sum, (40,), w, b, 1e-5)
    before = buf.clone()
    torch.ops.pagedgen.fused_add_layer_norm(x, res, w, b, 1e-5)
    assert torch.equal(res, expect_sum)
    torch.testing.assert_close(x, expect, atol=5e-4, rtol=0)  # float32 sums of values near 1000
    assert torch.equal(buf[:, :10], before[:, :10]) and torch.equal(buf[:, 50:], before[:, 50:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_layer_norm_batch_invariant(dtype):
    h = 384
    x_row, r_row, w, b = _ln_inputs(1, h, dtype, True, seed=11)
    first = None
    for n, at in [(1, 0), (2, 1), (7, 3), (64, 0), (333, 200), (700, 699)]:
        x, res, _, _ = _ln_inputs(n, h, dtype, False, seed=n)
        x[at], res[at] = x_row[0], r_row[0]
        torch.ops.pagedgen.fused_add_layer_norm(x, res, w, b, 1e-12)
        out = torch.cat([x[at], res[at]])
        if first is None:
            first = out
        assert torch.equal(out.view(torch.int16 if dtype != torch.float32 else torch.int32),
                           first.view(torch.int16 if dtype != torch.float32 else torch.int32)), (n, at)


def test_fused_add_layer_norm_bad_calls():
    op = torch.ops.pagedgen.fused_add_layer_norm
    x, res, w, b = _ln_inputs(4, 16, torch.float32, True)
    with pytest.raises(RuntimeError, match="weight and bias must be given together"):
        op(x, res, w, None, 1e-5)
    with pytest.raises(RuntimeError, match=r"residual must be \[4, 16\]"):
        op(x, res[:3], w, b, 1e-5)
    with pytest.raises(RuntimeError, match="residual dtype"):
        op(x, res.half(), w, b, 1e-5)
    with pytest.raises(RuntimeError, match="weight dtype"):
        op(x, res, w.double(), b, 1e-5)
    with pytest.raises(RuntimeError, match=r"bias must be \[16\]"):
        op(x, res, w, b[:8], 1e-5)
    with pytest.raises(RuntimeError, match="dtype must be float32, bfloat16 or float16"):
        op(x.double(), res.double(), None, None, 1e-5)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        op(x.t(), res.t(), None, None, 1e-5)
    with pytest.raises(RuntimeError, match="must not overlap"):
        op(x, x, w, b, 1e-5)
    with pytest.raises(RuntimeError, match="epsilon must be finite"):
        op(x, res, w, b, float("nan"))
    before = (x.clone(), res.clone())
    with pytest.raises(RuntimeError):
        op(x, res, w, b[:8], 1e-5)
    assert torch.equal(x, before[0]) and torch.equal(res, before[1])  # nothing written before the checks


@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck(dtype):
    x, res, w, b = _ln_inputs(5, 24, dtype, True)
    torch.library.opcheck(torch.ops.pagedgen.fused_add_layer_norm.default, (x, res, w, b, 1e-5))
    torch.library.opcheck(torch.ops.pagedgen.fused_add_layer_norm.default, (x.clone(), res.clone(), None, None, 1e-5))
