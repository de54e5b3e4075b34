"""``int8_linear`` (W8A8, issue 46): the PyTorch reference against integer arithmetic, the CPU kernel
(AVX2 vpmaddwd) against the reference bit for bit, rows independent of the batch and the threads,
``pack_int8``'s layout, ``quantize_weight_int8``, opcheck and the kernel's argument errors."""
import pytest
import torch

from pagedgen import ops
from pagedgen.layers.matmul import int8_linear, pack_int8
from pagedgen.layers.quant import quantize_weight_int8
from pagedgen.ops import reference

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
needs_kernel = pytest.mark.skipif(not ops.has_kernel("int8_linear"), reason="pagedgen._C has no int8_linear CPU kernel (AVX2)")


def gen(seed):
    return torch.Generator().manual_seed(seed)


def case(m, n, k, dtype, seed=0):
    g = gen(seed)
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    ws = torch.rand(n, generator=g) * 0.01 + 1e-4
    return x, w, ws, torch.randn(n, generator=g).to(dtype)


def run(fn, x, packed, ws, n, s=None, b=None):
    out = torch.empty(x.shape[0], n, dtype=x.dtype)
    fn(out, x, packed, ws, s, b)
    return out


def test_pack_int8_layout_and_errors():
    w = torch.randint(-127, 128, (37, 9), generator=gen(1), dtype=torch.int8)
    p = pack_int8(w)
    assert p.shape == (3, 5, 16, 2) and p.dtype == torch.int8
    for n, k in ((0, 0), (20, 7), (36, 8)):
        assert p[n // 16, k // 2, n % 16, k % 2] == w[n, k]
    assert (p[2, :, 5:] == 0).all() and (p[:, 4, :, 1] == 0).all()  # padding past N = 37 and K = 9
    with pytest.raises(ValueError, match="pack_int8 needs a 2-D int8 weight"):
        pack_int8(w.float())


def test_reference_is_exact_integer_arithmetic():
    x, w, ws, b = case(9, 40, 70, torch.float32)
    x[3] = 0  # a zero row: scale 1, output = bias
    out = run(reference.int8_linear, x, pack_int8(w), ws, 40, None, b)
    q, sx = reference.quantize_rows_int8(x)
    assert sx[3] == 1 and (q[3] == 0).all()
    assert torch.equal(sx[:3], x[:3].abs().amax(1) / 127)
    acc = q.long() @ w.long().t()  # exact in int64
    assert torch.equal(out, acc.float() * sx[:, None] * ws[None, :] + b)
    assert q.abs().max() == 127  # dynamic: max |x| maps to 127
    qs, ss = reference.quantize_rows_int8(x, torch.tensor([0.01]))
    assert (ss == 0.01).all() and qs.min() == -128 and qs.max() == 127  # static: clamped to int8


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_equals_reference_bitwise(dtype):
    for m, n, k in ((1, 16, 64), (3, 1, 1), (5, 37, 33), (13, 100, 257), (40, 576, 1536)):
        x, w, ws, b = case(m, n, k, dtype, seed=m + n + k)
        packed = pack_int8(w)
        for s in (None, torch.tensor([0.02])):
            for bias in (None, b, b.float()):
                got = run(torch.ops.pagedgen.int8_linear, x, packed, ws, n, s, bias)
                want = run(reference.int8_linear, x, packed, ws, n, s, bias)
                assert torch.equal(got, want), (m, n, k, s, bias is None)


@needs_kernel
def test_rows_independent_of_batch_position_and_threads():
    x, w, ws, b = case(100, 344, 200, torch.bfloat16, seed=5)
    packed = pack_int8(w)
    alone = torch.cat([run(torch.ops.pagedgen.int8_linear, x[i:i + 1], packed, ws, 344, None, b) for i in range(100)])
    threads = torch.get_num_threads()
    try:
        for t in sorted({1, 2, threads}):
            torch.set_num_threads(t)
            for m in list(range(1, 18)) + [64, 100]:
                for start in (0, 100 - m):
                    y = run(torch.ops.pagedgen.int8_linear, x[start:start + m], packed, ws, 344, None, b)
                    assert torch.equal(y.view(torch.int16), alone[start:start + m].view(torch.int16)), (t, m, start)
    finally:
        torch.set_num_threads(threads)


def test_layer_entry_packs_a_dense_weight_and_takes_strided_rows():
    x, w, ws, b = case(6, 24, 40, torch.float32, seed=7)
    wide = torch.cat([x, x], 1)[:, :40]  # rows with a stride
    dense = int8_linear(wide, w, ws, None, b)
    assert torch.equal(dense, int8_linear(x, pack_int8(w), ws, None, b, 24))
    assert torch.equal(dense, run(reference.int8_linear, x, pack_int8(w), ws, 24, None, b))


def test_quantize_weight_int8():
    w = torch.randn(10, 30, generator=gen(8))
    w[4] = 0
    q, s = quantize_weight_int8(w)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s[4] == 1 and (q[4] == 0).all()
    assert (q.abs().amax(1)[torch.arange(10) != 4] == 127).all()
    assert torch.allclose(q.float() * s[:, None], w, atol=float(s.max()) / 2 + 1e-7)
    with pytest.raises(ValueError, match="needs a 2-D floating-point weight"):
        quantize_weight_int8(q)


@needs_kernel
def test_opcheck_and_errors():
    x, w, ws, b = case(3, 20, 8, torch.bfloat16, seed=9)
    packed, out = pack_int8(w), torch.empty(3, 20, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.pagedgen.int8_linear, (out, x, packed, ws, None, b))
    torch.library.opcheck(torch.ops.pagedgen.int8_linear, (out, x, packed, ws, torch.tensor([0.1]), None))
    op = torch.ops.pagedgen.int8_linear
    with pytest.raises(RuntimeError, match=r"weight must be contiguous int8 pairs \[2, 4, 16, 2\]"):
        op(out, x, packed[:1], ws, None, None)
    with pytest.raises(RuntimeError, match=r"weight must be contiguous int8 pairs"):
        op(out, x, packed.float(), ws, None, None)
    with pytest.raises(RuntimeError, match=r"weight_scale must be float32 \[20\]"):
        op(out, x, packed, ws[:5], None, None)
    with pytest.raises(RuntimeError, match=r"input_scale must be float32 \[1\]"):
        op(out, x, packed, ws, torch.ones(2), None)
    with pytest.raises(RuntimeError, match=r"out must be BFloat16 \[3, N\]"):
        op(torch.empty(3, 20), x, packed, ws, None, None)
    with pytest.raises(RuntimeError, match=r"bias must be float32, bfloat16 or float16 \[20\]"):
        op(out, x, packed, ws, None, torch.ones(3))
    with pytest.raises(RuntimeError, match=r"input must be float32, bfloat16 or float16 \[M, K\] with contiguous rows"):
        op(out, x.t().contiguous().t(), packed, ws, None, None)
