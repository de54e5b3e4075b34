"""The model's fused small layers (rms_norm, fused_add_rms_norm, rotary_embedding, silu_and_mul): CPU
kernels of pagedgen._C against their PyTorch references (transformers' own sequence of ops), plus
torch.library.opcheck.

Exactness: rotary_embedding rounds where torch rounds and is compiled without contraction, so it must
match bitwise; the residual add of fused_add_rms_norm too. RMSNorm sums its squares in another order
than torch's reduction, and silu_and_mul uses a polynomial exp where torch uses SLEEF's, so those two
may differ in the last place: float32 within 1e-6 relative; in bf16/fp16 a one-unit difference in the
rounded intermediate (the normalised row, the activation) can become two units after the product
with the weight or with up, so the tolerance is two units (2 * 2^-7 and 2 * 2^-10 relative).
"""
import pytest
import torch

import pagedgen.ops  # noqa: F401  (loads pagedgen._C)
from pagedgen.ops import reference

pytestmark = pytest.mark.skipif(
    not pagedgen.ops.extension_available("cpu"), reason="pagedgen._C is not built: " + pagedgen.ops.extension_error("cpu")
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {
    torch.float32: dict(atol=1e-6, rtol=1e-6),
    torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2),
    torch.float16: dict(atol=1e-3, rtol=2e-3),
}


def rows(num_tokens, hidden, dtype, seed, stride_pad=0):
    """[num_tokens, hidden] random rows, as a view with a row stride of hidden + stride_pad."""
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(num_tokens, hidden + stride_pad, generator=gen).to(dtype)
    return full[:, :hidden]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, hidden, stride_pad", [(1, 64, 0), (37, 64, 5), (300, 576, 0), (3000, 2048, 0)])
def test_rms_norm(num_tokens, hidden, stride_pad, dtype):
    x = rows(num_tokens, hidden, dtype, 0, stride_pad) * 3
    weight = rows(1, hidden, dtype, 1)[0].contiguous()
    out = torch.full((num_tokens, hidden), float("nan"), dtype=dtype)
    torch.ops.pagedgen.rms_norm(out, x, weight, 1e-5)
    expected = torch.empty_like(out)
    reference.rms_norm(expected, x, weight, 1e-5)
    torch.testing.assert_close(out, expected, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, hidden", [(1, 64), (45, 64), (3000, 2048)])
def test_fused_add_rms_norm(num_tokens, hidden, dtype):
    x, residual = rows(num_tokens, hidden, dtype, 2).contiguous(), rows(num_tokens, hidden, dtype, 3).contiguous()
    weight = rows(1, hidden, dtype, 4)[0].contiguous()
    x_ref, residual_ref = x.clone(), residual.clone()
    torch.ops.pagedgen.fused_add_rms_norm(x, residual, weight, 1e-6)
    reference.fused_add_rms_norm(x_ref, residual_ref, weight, 1e-6)
    assert torch.equal(residual, residual_ref)  # the add is elementwise: bitwise
    torch.testing.assert_close(x, x_ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_size", [(8, 4, 8), (9, 3, 64), (32, 8, 128)])
def test_rotary_embedding_bitwise(num_heads, num_kv_heads, head_size, dtype):
    """On q/k views of one qkv buffer, as the model calls it; v must stay untouched."""
    from transformers import LlamaConfig

    from pagedgen.model.llama import rope_cos_sin

    config = LlamaConfig(hidden_size=num_heads * head_size, num_attention_heads=num_heads, head_dim=head_size)
    cos, sin = rope_cos_sin(config, head_size, 700)
    num_tokens = 50
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, generator=gen).to(dtype)
    positions = torch.randint(0, 700, (num_tokens,), generator=gen)
    expected = qkv.clone()

    def views(t):
        q = t[:, : num_heads * head_size].view(num_tokens, num_heads, head_size)
        k = t[:, num_heads * head_size : (num_heads + num_kv_heads) * head_size].view(num_tokens, num_kv_heads, head_size)
        return q, k

    torch.ops.pagedgen.rotary_embedding(positions, *views(qkv), cos, sin)
    reference.rotary_embedding(positions, *views(expected), cos, sin)
    assert torch.equal(qkv, expected)


def test_rotary_embedding_rejects_bad_positions():
    cos = sin = torch.zeros(16, 8)
    q, k = torch.zeros(2, 2, 8), torch.zeros(2, 1, 8)
    with pytest.raises(RuntimeError, match=r"positions\[1\] = 16 is outside \[0, 16\)"):
        torch.ops.pagedgen.rotary_embedding(torch.tensor([0, 16]), q, k, cos, sin)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, d", [(1, 172), (77, 172), (600, 1536)])
def test_silu_and_mul(num_tokens, d, dtype):
    x = rows(num_tokens, 2 * d, dtype, 6) * 4  # gates well into both tails of silu
    out = torch.full((num_tokens, d), float("nan"), dtype=dtype)
    torch.ops.pagedgen.silu_and_mul(out, x)
    expected = torch.empty_like(out)
    reference.silu_and_mul(expected, x)
    torch.testing.assert_close(out, expected, **TOL[dtype])


def test_layer_ops_reject_wrong_dtype_and_shape():
    with pytest.raises(RuntimeError, match="dtype must be float32, bfloat16 or float16"):
        torch.ops.pagedgen.rms_norm(torch.zeros(2, 4, dtype=torch.float64), torch.zeros(2, 4, dtype=torch.float64),
                                    torch.ones(4, dtype=torch.float64), 1e-5)
    with pytest.raises(RuntimeError, match=r"weight must be \[4\]"):
        torch.ops.pagedgen.rms_norm(torch.zeros(2, 4), torch.zeros(2, 4), torch.ones(5), 1e-5)
    with pytest.raises(RuntimeError, match="out must be"):
        torch.ops.pagedgen.silu_and_mul(torch.zeros(2, 3), torch.zeros(2, 8))


def opcheck_inputs():
    x, residual, w = torch.randn(3, 16), torch.randn(3, 16), torch.randn(16)
    qkv = torch.randn(3, 4 * 8)
    return {
        "rms_norm": (torch.empty(3, 16), x, w, 1e-5),
        "fused_add_rms_norm": (x.clone(), residual, w, 1e-5),
        "rotary_embedding": (torch.tensor([0, 5, 2]), qkv[:, :16].view(3, 2, 8), qkv[:, 16:24].view(3, 1, 8),
                             torch.randn(8, 8), torch.randn(8, 8)),
        "silu_and_mul": (torch.empty(3, 8), torch.randn(3, 16)),
    }


@pytest.mark.parametrize("name", ["rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul"])
def test_opcheck(name):
    torch.library.opcheck(getattr(torch.ops.pagedgen, name).default, opcheck_inputs()[name])
