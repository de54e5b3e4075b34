"""``int4_linear`` (W4A16, issue 46): the PyTorch reference against a plain dequantize-and-matmul, the
CPU kernel (AVX2, codes dequantized in registers) against the reference over random shapes (odd N,
K not a multiple of the group, groups 32 / 64 / 128 / per channel, batches 1..300, three dtypes),
rows bitwise independent of the batch and of the threads (both of the kernel's paths), the layout
of ``pack_int4`` / ``pack_groups`` and the checkpoint packing helpers, opcheck and the argument errors."""
import pytest
import torch

from pagedgen import ops
from pagedgen.layers.matmul import int4_linear
from pagedgen.layers.quant_int4 import AWQ_ORDER, pack_groups, pack_int4, pack_int32, unpack_int4, unpack_int32
from pagedgen.ops import reference
from w_only_cases import ACTIVATION_BAD_CALLS, assert_rows_independent

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
needs_kernel = pytest.mark.skipif(not ops.has_kernel("int4_linear"), reason="pagedgen._C has no int4_linear CPU kernel (AVX2)")


def case(m, n, k, group, dtype, seed=0):
    """x [m, k], packed weight tensors of n outputs, the real weight [n, k] float32 and a bias."""
    g = torch.Generator().manual_seed(seed)
    groups = -(-k // group)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, groups, generator=g) * 0.05 + 1e-3
    zeros = torch.randint(0, 17, (n, groups), generator=g, dtype=torch.uint8)
    real = (codes.int() - zeros.int().repeat_interleave(group, 1)[:, :k]).float() * scales.repeat_interleave(group, 1)[:, :k]
    x = (torch.randn(m, k, generator=g) * 2).to(dtype)
    return x, (pack_int4(codes), pack_groups(scales), pack_groups(zeros)), real, torch.randn(n, generator=g).to(dtype)


def run(fn, x, packed, group, n, bias=None):
    out = torch.empty(x.shape[0], n, dtype=x.dtype)
    fn(out, x, *packed, group, bias)
    return out


def test_layouts_round_trip():
    codes = torch.randint(0, 16, (37, 24), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    p = pack_int4(codes)
    assert p.shape == (3, 24, 8) and p.dtype == torch.uint8
    for n, k in ((0, 0), (9, 5), (20, 23), (36, 1)):
        assert int(p[n // 16, k, n % 8]) >> (4 * ((n % 16) // 8)) & 0xF == codes[n, k]
    assert (p[2, :, 5:] == 0).all()  # outputs 37..47 are padding (5 low and all high nibbles of panel 2)
    ones = torch.ones(37, 2)
    assert torch.equal(unpack_int4(p, pack_groups(ones), pack_groups(torch.zeros(37, 2, dtype=torch.uint8)), 12, 37), codes.float())
    for dim in (0, 1):
        for order in (None, AWQ_ORDER):
            assert torch.equal(unpack_int32(pack_int32(codes[:, :16] if dim == 1 else codes[:32], dim, order), dim, order),
                               codes[:, :16] if dim == 1 else codes[:32])
    # AWQ's order by hand: code i of a word holds column [0, 2, 4, 6, 1, 3, 5, 7][i]
    word = pack_int32(torch.arange(8, dtype=torch.uint8)[None], 1, AWQ_ORDER)
    assert [(int(word) >> (4 * i)) & 0xF for i in range(8)] == list(AWQ_ORDER)
    assert pack_int32(torch.tensor([[15] * 8]), 1).item() == -1  # the sign bit: int32 as the formats store it


@pytest.mark.parametrize("group", [32, 64, 128, 100])
def test_reference_is_the_dequantized_matmul(group):
    x, packed, real, b = case(7, 37, 200, group, torch.float32)
    out = run(reference.int4_linear, x, packed, group, 37, b)
    torch.testing.assert_close(out, x @ real.t() + b, rtol=1e-5, atol=1e-5)
    assert torch.equal(unpack_int4(*packed, group, 37), real)  # one float32 rounding, the same in both


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m, n, k, group", [(1, 16, 64, 32), (3, 37, 200, 64), (5, 33, 172, 32), (9, 300, 256, 128),
                                            (300, 45, 96, 96), (64, 19, 130, 130), (4, 8, 7, 128)])
def test_kernel_matches_the_reference(m, n, k, group, dtype):
    x, packed, real, b = case(m, n, k, group, dtype, seed=m + n)
    for bias in (b, None):
        got, want = run(torch.ops.pagedgen.int4_linear, x, packed, group, n, bias), run(reference.int4_linear, x, packed, group, n, bias)
        tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=3e-2)
        torch.testing.assert_close(got.float(), want.float(), **tol)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_are_bitwise_independent_of_the_batch_and_threads(dtype):
    """A row alone (the in-register path), in tiles of any size and in a batch of 300 (the panel
    buffer path), on one thread or all: the same bits."""
    x, packed, _, b = case(300, 70, 160, 32, dtype, seed=5)
    assert_rows_independent(lambda rows: run(torch.ops.pagedgen.int4_linear, rows, packed, 32, 70, b), x)


def test_dispatch_wrapper_and_empty_batches():
    x, packed, real, b = case(3, 20, 64, 32, torch.float32)
    torch.testing.assert_close(int4_linear(x, *packed, 32, b, 20), x @ real.t() + b, rtol=1e-5, atol=1e-4)
    assert int4_linear(x[:0], *packed, 32, b, 20).shape == (0, 20)
    strided = x.t().contiguous().t()  # columns not contiguous: the wrapper copies the rows
    torch.testing.assert_close(int4_linear(strided, *packed, 32, None, 20), x @ real.t(), rtol=1e-5, atol=1e-4)


@needs_kernel
def test_opcheck():
    x, packed, _, b = case(3, 20, 64, 32, torch.float32)
    out = torch.empty(3, 20)
    torch.library.opcheck(torch.ops.pagedgen.int4_linear, (out, x, *packed, 32, b))


@needs_kernel
@pytest.mark.parametrize("change, match", [
    (lambda a: a.update(group=0), "group_size must be >= 1"),
    (lambda a: a.update(group=16), r"weight_scale must be \[2, 4, 16\] for group_size 16"),
    (lambda a: a.update(w=a["w"][:, :10]), r"weight must be \[2, 64, 8\]"),
    (lambda a: a.update(w=a["w"].to(torch.int8)), "weight must be uint8"),
    (lambda a: a.update(s=a["s"].double()), "weight_scale must be float32"),
    (lambda a: a.update(z=a["z"][:, :1]), r"weight_zero must be \[2, 2, 16\]"),
] + ACTIVATION_BAD_CALLS)
def test_bad_calls_raise_naming_the_argument(change, match):
    x, (w, s, z), _, b = case(3, 20, 64, 32, torch.float32)
    args = dict(out=torch.empty(3, 20), x=x, w=w, s=s, z=z, group=32, bias=b)
    change(args)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.pagedgen.int4_linear(args["out"], args["x"], args["w"], args["s"], args["z"], args["group"], args["bias"])
