"""The CPU kernel of varlen_attention (bidirectional attention over packed sequences, the encoders')
against its PyTorch reference (one SDPA per sequence in float32): lengths 1..70 mixed with empty
sequences, head sizes 32/64/128 and run-time ones (8, 40, 80), GQA, the three dtypes, q/k/v as strided
views of a fused qkv output and with a strided head dimension; a row's bits independent of the other
sequences, their order and the thread count; opcheck; every bad call refused before any work.

Tolerances as tests/ops/test_ops_attention.py's: both compute in float32 from the same inputs (the
kernel with its polynomial exp and its own summation order), so float32 agrees to 1e-5; in bf16 /
fp16 the float32 result is rounded once, where the two may land one unit in the last place apart.
"""

import pytest
import torch

from attention_batches import single_thread
from pagedgen import ops
from pagedgen.ops import reference

pytestmark = pytest.mark.skipif(
    not ops.has_kernel("varlen_attention"), reason=f"no varlen_attention CPU kernel: {ops.extension_error('cpu') or 'not built'}"
)

TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2),
    torch.float16: dict(atol=1e-3, rtol=2e-3),
}
MIXED = [1, 17, 0, 70, 32, 33, 5, 64, 31, 2, 48]  # around the 32-token tiles and the 64-row items, an empty one


def packed(lengths, heads, kv_heads, head_size, dtype, seed=0):
    """q, k, v [T, H or Hkv, D] as views of one fused [T, (H + 2 Hkv) D] tensor (the encoder's
    layout), cu_seqlens [S + 1] int32."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    qkv = torch.randn(T, (heads + 2 * kv_heads) * head_size, generator=g).mul(2).to(dtype)
    q = qkv[:, : heads * head_size].view(T, heads, head_size)
    k = qkv[:, heads * head_size : (heads + kv_heads) * head_size].view(T, kv_heads, head_size)
    v = qkv[:, (heads + kv_heads) * head_size :].view(T, kv_heads, head_size)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu


def run(q, k, v, cu, scale, impl=None):
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)  # every element must be written
    if impl is None:
        torch.ops.pagedgen.varlen_attention(out, q, k, v, cu, scale)
    else:
        with single_thread():
            impl(out, q, k, v, cu, scale)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_size", [(4, 4, 32), (2, 2, 64), (2, 1, 128), (6, 2, 32), (3, 3, 8), (2, 2, 40), (4, 2, 80)])
def test_matches_reference(dtype, heads, kv_heads, head_size):
    q, k, v, cu = packed(MIXED, heads, kv_heads, head_size, dtype)
    scale = head_size**-0.5
    out = run(q, k, v, cu, scale)
    torch.testing.assert_close(out.float(), run(q, k, v, cu, scale, reference.varlen_attention).float(), **TOL[dtype])


def test_lengths_1_to_70():
    lengths = torch.randperm(70, generator=torch.Generator().manual_seed(1)).add(1).tolist()
    q, k, v, cu = packed(lengths, 2, 2, 32, torch.float32, seed=1)
    out = run(q, k, v, cu, 0.3)
    torch.testing.assert_close(out, run(q, k, v, cu, 0.3, reference.varlen_attention), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_head_dimension(dtype):
    """query, key, value and out with a head_size stride of 2 (read and written through it)."""
    q, k, v, cu = packed([9, 40, 3], 2, 2, 64, dtype, seed=2)
    q2, k2, v2 = (torch.stack([t, torch.zeros_like(t)], -1)[..., 0] for t in (q, k, v))  # stride(2) == 2
    assert q2.stride(2) == 2 and k2.stride(2) == 2
    out = torch.empty(q.shape[0], 2, 64, 2, dtype=dtype)[..., 1]
    torch.ops.pagedgen.varlen_attention(out, q2, k2, v2, cu, 0.125)
    torch.testing.assert_close(out.float(), run(q, k, v, cu, 0.125, reference.varlen_attention).float(), **TOL[dtype])
    assert torch.equal(out, run(q, k, v, cu, 0.125))  # the same arithmetic through any strides


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_size", [32, 40])
def test_batch_invariance_bitwise(dtype, head_size):
    """Each sequence alone, one thread, gives the bits it gets among the others, in any order, on
    every thread count."""
    lengths = [23, 70, 1, 64, 12, 33, 150]
    q, k, v, cu = packed(lengths, 4, 2, head_size, dtype, seed=3)
    bounds = cu.tolist()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [run(q[a:b], k[a:b], v[a:b], torch.tensor([0, b - a], dtype=torch.int32), 0.2) for a, b in zip(bounds, bounds[1:])]
        torch.set_num_threads(max(2, threads))
        together = run(q, k, v, cu, 0.2)
        order = [6, 2, 0, 5, 1, 4, 3]
        perm = torch.cat([torch.arange(bounds[i], bounds[i + 1]) for i in order])
        lens = torch.tensor([lengths[i] for i in order])
        cu2 = torch.tensor([0, *lens.cumsum(0).tolist()], dtype=torch.int32)
        shuffled = run(q[perm], k[perm], v[perm], cu2, 0.2)
    finally:
        torch.set_num_threads(threads)
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        assert torch.equal(together[a:b], alone[i]), f"sequence {i}"
    assert torch.equal(shuffled, together[perm])


def test_empty_call_and_opcheck():
    q, k, v, cu = packed([], 2, 2, 32, torch.float32)
    torch.ops.pagedgen.varlen_attention(torch.empty_like(q), q, k, v, cu, 1.0)  # nothing to do
    q, k, v, cu = packed([3, 5], 2, 1, 32, torch.float32)
    torch.library.opcheck(torch.ops.pagedgen.varlen_attention, (torch.empty(q.shape), q, k, v, cu, 0.5))


def test_ops_entry_uses_the_kernel():
    q, k, v, cu = packed([4, 9], 2, 2, 64, torch.float32)
    out = torch.empty(q.shape)
    ops.varlen_attention(out, q, k, v, cu, 0.125)
    assert torch.equal(out, run(q, k, v, cu, 0.125))


def _bad_calls():
    q, k, v, cu = packed([3, 5], 4, 2, 32, torch.float32)
    out = torch.zeros(q.shape)
    i32 = lambda *xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    yield "query must be", (out, q[0], k, v, cu)
    yield "out .* must match query", (out[:, :2], q, k, v, cu)
    yield "key must be", (out, q, k[:7], v, cu)
    yield "value .* must match key", (out, q, k, v[:, :1], cu)
    yield "multiple of num_kv_heads", (out[:, :3], q[:, :3], k, v, cu)
    yield "cu_seqlens must be \\[num_seqs", (out, q, k, v, i32(8)[:0])
    yield "share one dtype", (out, q, k.double(), v, cu)
    yield "query dtype", (out.double(), q.double(), k.double(), v.double(), cu)
    yield "cu_seqlens must be int32", (out, q, k, v, cu.long())
    yield "run from 0 to num_tokens=8", (out, q, k, v, i32(0, 3, 7))
    yield "run from 0 to num_tokens=8", (out, q, k, v, i32(1, 3, 8))
    yield "must not decrease", (out, q, k, v, i32(0, 5, 3, 8))
    yield "out must not overlap", (q, q, k, v, cu)


@pytest.mark.parametrize("match,args", list(_bad_calls()))
def test_bad_calls_are_refused_before_any_work(match, args):
    out = args[0]
    before = out.clone()
    with pytest.raises(RuntimeError, match=match):
        torch.ops.pagedgen.varlen_attention(*args, 0.5)
    assert torch.equal(out, before)


def test_non_finite_scale_is_refused():
    q, k, v, cu = packed([3], 2, 2, 32, torch.float32)
    with pytest.raises(RuntimeError, match="scale must be finite"):
        torch.ops.pagedgen.varlen_attention(torch.empty(q.shape), q, k, v, cu, float("inf"))
