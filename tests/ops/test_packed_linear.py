"""pagedgen::packed_linear, the GEMM on panel-packed weights (csrc/cpu/linear.cpp), against its reference.

Each output of the kernel is a float32 sum over k in order, the reference lets torch choose the order:
both are within the float32 rounding bound of the exact product, |error| <= 2 (K + 1) eps32 (|x| @ |W|^T + |bias|),
which is what is checked (with the bias add, and the final rounding to the output dtype). Then the
properties the engine relies on, bitwise: a row's bits do not depend on the batch, its position or
the thread count.
"""
from __future__ import annotations

import pytest
import torch

from pagedgen import ops
from pagedgen.layers import matmul as lin
from pagedgen.layers.linear import ReplicatedLinear

pytestmark = pytest.mark.skipif(not ops.has_kernel("packed_linear"), reason="pagedgen._C has no packed_linear kernel (needs AVX2 and FMA)")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (N, K): odd sizes around the panel width, stories260K's and SmolLM-135M's shapes
SHAPES = [(1, 1), (15, 7), (16, 64), (17, 33), (344, 64), (64, 172), (130, 576), (576, 1536), (20, 0)]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def run(x: torch.Tensor, packed: torch.Tensor, n: int, bias=None) -> torch.Tensor:
    out = torch.empty(x.shape[0], n, dtype=x.dtype)
    ops.packed_linear(out, x, packed, bias)
    return out


def check_close(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias) -> None:
    """out within the float32 summation bound (and the output rounding) of the exact x @ w^T + bias."""
    x64, w64 = x.double(), w.double()
    b64 = 0 if bias is None else bias.double()
    exact = x64 @ w64.T + b64
    k = x.shape[1]  # k products and sums, then the bias: k + 1 roundings of float32
    bound = 2 * (k + 1) * torch.finfo(torch.float32).eps * (x64.abs() @ w64.abs().T + abs(b64)) + 1e-30
    if out.dtype != torch.float32:  # the final rounding to bf16/fp16: half an ulp, taken as eps * |value|
        bound = bound + torch.finfo(out.dtype).eps * exact.abs() + torch.finfo(out.dtype).tiny
    err = (out.double() - exact).abs()
    assert bool((err <= bound).all()), f"max error {float((err - bound).max()):.3g} over the bound"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("w_dtype", DTYPES, ids=str)
def test_matches_reference(shape, w_dtype):
    n, k = shape
    g = gen(n * 31 + k)
    w = torch.randn(n, k, generator=g).to(w_dtype)
    packed = lin.pack_panels(w)
    assert packed.shape == (-(-n // 16), k, 16) and packed.dtype == w_dtype and packed.is_contiguous()
    for x_dtype in DTYPES:
        for m in (0, 1, 5, 6, 7, 13, 100):
            x = torch.randn(m, k, generator=g).to(x_dtype)
            for bias in (None, torch.randn(n, generator=g).to(w_dtype), torch.randn(n, generator=g)):
                out = run(x, packed, n, bias)
                assert out.dtype == x_dtype and out.shape == (m, n)
                check_close(out, x, w, bias)
                ref = torch.empty_like(out)
                ops.reference.packed_linear(ref, x, packed, bias)
                check_close(ref, x, w, bias)


def test_linear_takes_rows_with_a_stride_and_transposed_inputs():
    g = gen(1)
    w = torch.randn(40, 24, generator=g)
    packed = lin.pack_panels(w)
    wide = torch.randn(9, 30, generator=g)
    x = wide[:, :24]  # [9, 24], row stride 30
    assert torch.equal(run(x, packed, 40), run(x.contiguous(), packed, 40))
    xt = torch.randn(24, 9, generator=g).t()  # [9, 24], not contiguous along the features
    assert torch.equal(lin.linear(xt, packed, None, None, 40), run(xt.contiguous(), packed, 40))
    with pytest.raises(ValueError, match="a weight packed in panels needs out_features"):
        lin.linear(x, packed)


@pytest.mark.parametrize("w_dtype", DTYPES, ids=str)
def test_rows_independent_of_batch_position_and_threads(w_dtype):
    """Every row of batches of 1-40, 100 and 257 rows has, bitwise, the output it has alone, on 1 and 2 threads."""
    g = gen(2)
    n, k = 344, 200
    w = torch.randn(n, k, generator=g).to(w_dtype)
    packed, bias = lin.pack_panels(w), torch.randn(n, generator=g).to(w_dtype)
    x = torch.randn(257, k, generator=g).to(torch.bfloat16 if w_dtype == torch.bfloat16 else torch.float32)
    alone = torch.cat([run(x[i:i + 1], packed, n, bias) for i in range(x.shape[0])])
    threads = torch.get_num_threads()
    try:
        for t in sorted({1, 2, threads}):
            torch.set_num_threads(t)
            for m in list(range(1, 41)) + [100, 257]:
                for start in (0, x.shape[0] - m):
                    y = run(x[start:start + m], packed, n, bias)
                    assert torch.equal(bits(y), bits(alone[start:start + m])), (t, m, start)
    finally:
        torch.set_num_threads(threads)


def test_opcheck_and_errors():
    g = gen(3)
    w = torch.randn(20, 8, generator=g).to(torch.bfloat16)
    packed, x = lin.pack_panels(w), torch.randn(3, 8, generator=g).to(torch.bfloat16)
    out = torch.empty(3, 20, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.pagedgen.packed_linear, (out, x, packed, None))
    torch.library.opcheck(torch.ops.pagedgen.packed_linear, (out, x, packed, torch.randn(20, generator=g)))
    with pytest.raises(RuntimeError, match=r"weight must be contiguous panels \[2, 8, 16\]"):
        ops.packed_linear(out, x, packed[:1], None)
    with pytest.raises(RuntimeError, match=r"out must be BFloat16 \[3, N\]"):
        ops.packed_linear(torch.empty(3, 20), x, packed, None)
    with pytest.raises(RuntimeError, match=r"out must be .* non-overlapping rows, got .* strides \[0, 1\]"):
        ops.packed_linear(torch.empty(1, 20, dtype=torch.bfloat16).expand(3, 20), x, packed, None)
    with pytest.raises(RuntimeError, match=r"bias must be float32, bfloat16 or float16 \[20\]"):
        ops.packed_linear(out, x, packed, torch.zeros(19))
    with pytest.raises(RuntimeError, match=r"bias must be float32, bfloat16 or float16 \[20\] on the CPU, got Long"):
        ops.packed_linear(out, x, packed, torch.arange(20))
    with pytest.raises(RuntimeError, match="input and weight must be float32, bfloat16 or float16, got Double"):
        ops.packed_linear(torch.empty(3, 20, dtype=torch.float64), x.double(), packed, None)
    square = lin.pack_panels(torch.randn(16, 16, generator=g))
    y = torch.randn(4, 16, generator=g)
    with pytest.raises(RuntimeError, match="unsupported operation: some elements of the input tensor and the written-to tensor refer to a single memory location"):
        ops.packed_linear(y, y, square, None)  # out aliasing its input
    with pytest.raises(RuntimeError, match="input must be \\[M, K\\] with contiguous rows"):
        ops.packed_linear(out, torch.randn(8, 3).t().to(torch.bfloat16), packed, None)
    with pytest.raises(TypeError, match="pack_panels needs a torch.Tensor weight, got list"):
        lin.pack_panels([[1.0]])
    with pytest.raises(ValueError, match=r"2-D float32, bfloat16 or float16 weight, got torch.int64 \(2, 2\)"):
        lin.pack_panels(torch.zeros(2, 2, dtype=torch.int64))


def test_prepare_matmuls_packs_every_weight_and_counts_the_padding():
    from pagedgen.layers.embedding import ParallelLMHead, VocabParallelEmbedding

    g = gen(4)
    embed = VocabParallelEmbedding(500, 64)
    embed.weight = torch.nn.Parameter(torch.randn(500, 64, generator=g).to(torch.bfloat16), requires_grad=False)
    model = torch.nn.ModuleDict(dict(embed=embed, head=ParallelLMHead(500, 64, tie_to=embed), proj=ReplicatedLinear(64, 40, bias=True)))
    model["proj"].weight = torch.nn.Parameter(torch.randn(40, 64, generator=g).to(torch.bfloat16), requires_grad=False)
    model["proj"].bias = torch.nn.Parameter(torch.randn(40, generator=g).to(torch.bfloat16), requires_grad=False)
    before, proj_w = embed.weight.clone(), model["proj"].weight.clone()
    extra = lin.prepare_matmuls(model, lin.MatmulConfig(torch.bfloat16, panels=True))
    # the head's own packed matrix (512 rows); the projection's 8 padding rows; bf16 throughout
    assert extra == 512 * 64 * 2 + 8 * 64 * 2
    assert model["head"].weight.shape == (32, 64, 16) and not model["head"].tied
    assert torch.equal(model["embed"].weight, before) and model["proj"].bias.dtype == torch.bfloat16
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    check_close(model["head"](x), x, before, None)
    check_close(model["proj"](x), x, proj_w, model["proj"].bias)


# ---- pagedgen::packed_linear_bf16: the AVX512-BF16 GEMM on bf16 pairs (csrc/cpu/linear_avx512.cpp) ----

needs_pairs = pytest.mark.skipif(not ops.has_kernel("packed_linear_bf16"), reason="pagedgen._C has no packed_linear_bf16 kernel (needs AVX512-BF16)")
# (N, K): odd K (the last pair half zero), N around the panel and tile widths (16, 32, 64 outputs), model shapes
PAIR_SHAPES = [(1, 1), (15, 7), (16, 64), (17, 33), (33, 2), (65, 31), (344, 64), (130, 577), (960, 576), (576, 1536), (20, 0)]


def run_pairs(x: torch.Tensor, packed: torch.Tensor, n: int, bias=None) -> torch.Tensor:
    out = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
    ops.packed_linear_bf16(out, x, packed, bias)
    return out


def test_pack_pairs_layout():
    w = torch.arange(37 * 5, dtype=torch.float32).view(37, 5).to(torch.bfloat16)  # exact in bf16
    packed = lin.pack_pairs(w)
    assert packed.shape == (3, 3, 16, 2) and packed.dtype == torch.bfloat16 and packed.is_contiguous()
    for p, q, j, t in [(0, 0, 0, 0), (0, 0, 0, 1), (1, 2, 3, 0), (2, 1, 4, 1)]:
        assert packed[p, q, j, t] == w[16 * p + j, 2 * q + t]
    assert not packed[2, :, 5:].any() and not packed[:, 2, :, 1].any()  # zeros past N = 37 and past K = 5
    with pytest.raises(TypeError, match="pack_pairs needs a torch.Tensor weight, got list"):
        lin.pack_pairs([[1.0]])
    with pytest.raises(ValueError, match=r"pack_pairs needs a 2-D bfloat16 weight, got torch.float32 \(2, 2\)"):
        lin.pack_pairs(torch.zeros(2, 2))


@needs_pairs
@pytest.mark.parametrize("shape", PAIR_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_pairs_match_reference(shape):
    n, k = shape
    g = gen(n * 37 + k)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    packed = lin.pack_pairs(w)
    for m in (0, 1, 2, 5, 6, 7, 12, 13, 25, 100):
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        for bias in (None, torch.randn(n, generator=g).to(torch.bfloat16), torch.randn(n, generator=g)):
            out = run_pairs(x, packed, n, bias)
            assert out.dtype == torch.bfloat16 and out.shape == (m, n)
            check_close(out, x, w, bias)
            ref = torch.empty_like(out)
            ops.reference.packed_linear_bf16(ref, x, packed, bias)
            check_close(ref, x, w, bias)
            assert torch.equal(lin.linear(x, packed, bias, None, n), out)


@needs_pairs
@pytest.mark.parametrize("shape", [(344, 201), (960, 576), (100, 2048)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_pairs_rows_independent_of_batch_position_and_threads(shape):
    """Every row of batches of 1-40, 100 and 257 rows has, bitwise, the output it has alone, on 1 and 2 threads.
    Rows of K = 201 and 576 are read where they are; rows 4 KiB apart (K = 2,048) crowd the L1 sets
    and are packed into tile order first (rows_crowd_l1 in csrc/cpu/linear_avx512.cpp)."""
    n, k = shape
    g = gen(5)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    packed, bias = lin.pack_pairs(w), torch.randn(n, generator=g).to(torch.bfloat16)
    x = torch.randn(257, k, generator=g).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([run_pairs(x[i:i + 1], packed, n, bias) for i in range(x.shape[0])])
        for t in sorted({1, 2, threads}):
            torch.set_num_threads(t)
            for m in list(range(1, 41)) + [100, 257]:
                for start in (0, x.shape[0] - m):
                    y = run_pairs(x[start:start + m], packed, n, bias)
                    assert torch.equal(bits(y), bits(alone[start:start + m])), (t, m, start)
    finally:
        torch.set_num_threads(threads)


@needs_pairs
def test_pairs_opcheck_and_errors():
    g = gen(6)
    w = torch.randn(20, 9, generator=g).to(torch.bfloat16)
    packed, x = lin.pack_pairs(w), torch.randn(3, 9, generator=g).to(torch.bfloat16)
    out = torch.empty(3, 20, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.pagedgen.packed_linear_bf16, (out, x, packed, None))
    torch.library.opcheck(torch.ops.pagedgen.packed_linear_bf16, (out, x, packed, torch.randn(20, generator=g)))
    with pytest.raises(RuntimeError, match=r"weight must be contiguous pairs \[2, 5, 16, 2\] for N = 20 outputs of K = 9"):
        ops.packed_linear_bf16(out, x, packed[:1], None)
    with pytest.raises(RuntimeError, match=r"weight must be contiguous pairs"):
        ops.packed_linear_bf16(out, x, lin.pack_panels(w), None)  # panels, not pairs
    with pytest.raises(RuntimeError, match="input and weight must be bfloat16, got Float and BFloat16"):
        ops.packed_linear_bf16(torch.empty(3, 20), x.float(), packed, None)
    with pytest.raises(RuntimeError, match=r"out must be BFloat16 \[3, N\]"):
        ops.packed_linear_bf16(torch.empty(3, 20), x, packed, None)
    with pytest.raises(RuntimeError, match=r"out must be .* non-overlapping rows, got .* strides \[0, 1\]"):
        ops.packed_linear_bf16(torch.empty(1, 20, dtype=torch.bfloat16).expand(3, 20), x, packed, None)
    with pytest.raises(RuntimeError, match=r"bias must be float32, bfloat16 or float16 \[20\]"):
        ops.packed_linear_bf16(out, x, packed, torch.zeros(19))
    with pytest.raises(RuntimeError, match=r"bias must be float32, bfloat16 or float16 \[20\] on the CPU, got Long"):
        ops.packed_linear_bf16(out, x, packed, torch.arange(20))
    with pytest.raises(RuntimeError, match=r"input must be \[M, K\] with contiguous rows"):
        ops.packed_linear_bf16(out, torch.randn(9, 3).t().to(torch.bfloat16), packed, None)
    square = lin.pack_pairs(torch.randn(16, 16, generator=g).to(torch.bfloat16))
    y = torch.randn(4, 16, generator=g).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="unsupported operation: some elements of the input tensor and the written-to tensor refer to a single memory location"):
        ops.packed_linear_bf16(y, y, square, None)  # out aliasing its input


@needs_pairs
def test_prepare_matmuls_packs_pairs():
    g = gen(7)
    proj = ReplicatedLinear(65, 40, bias=True)
    proj.weight = torch.nn.Parameter(torch.randn(40, 65, generator=g).to(torch.bfloat16), requires_grad=False)
    proj.bias = torch.nn.Parameter(torch.randn(40, generator=g).to(torch.bfloat16), requires_grad=False)
    w = proj.weight.clone()
    config = lin.MatmulConfig(torch.bfloat16, pairs=True)
    assert config.batch_invariant
    extra = lin.prepare_matmuls(proj, config)
    assert proj.weight.shape == (3, 33, 16, 2) and extra == (48 * 66 - 40 * 65) * 2  # padding rows and the odd K's pair
    x = torch.randn(5, 65, generator=g).to(torch.bfloat16)
    check_close(proj(x), x, w, proj.bias)
