"""The model's fused small layers (rms_norm, fused_add_rms_norm, rotary_embedding, silu_and_mul): CPU
kernels of pagedgen._C against their PyTorch references (transformers' own sequence of ops), plus
torch.library.opcheck, in float32, bfloat16 and float16, over odd sizes, non-contiguous inputs and the
sizes of the benchmark models (135M SmolLM: hidden 576, intermediate 1536, 9 heads, 3 KV heads, head
64; TinyLlama-1.1B: hidden 2048, intermediate 5632, 32 heads, 4 KV heads, head 64).

Exactness: rotary_embedding rounds where torch rounds (the extension is built without floating-point
contraction), so it must match bitwise in every dtype; the residual add of fused_add_rms_norm too.
RMSNorm sums its squares in the order of torch's own CPU sum for the build's vector width, so it is
bitwise too when torch reduces with that width (its default on the machine that built the extension;
an ATEN_CPU_CAPABILITY or PAGEDGEN_CPU_ISA override can change either side, and then the two agree to
an ulp or two). silu_and_mul uses a polynomial exp where torch uses SLEEF's, so in float32 it may
differ in the last place or two (1e-6 relative); in bf16/fp16 it is within one unit in the last place
of the output dtype (`ulps` below; measured bitwise on 10M random elements).
"""

import pytest
import torch

import pagedgen.ops  # noqa: F401  (loads pagedgen._C)
from pagedgen.ops import reference

pytestmark = pytest.mark.skipif(
    not pagedgen.ops.extension_available("cpu"), reason="pagedgen._C is not built: " + pagedgen.ops.extension_error("cpu")
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FP32_TOL = dict(atol=1e-6, rtol=1e-6)
# (num_tokens, hidden) of the benchmark models and odd ones
NORM_SIZES = [(1, 64), (37, 64), (5, 7), (3, 1), (4, 3), (301, 100), (256, 576), (64, 2048), (2, 4097), (3, 70001)]


def ordered(t: torch.Tensor) -> torch.Tensor:
    """The floats of t as integers in value order (IEEE sign-magnitude -> two's complement; -0 == +0)."""
    bits = t.view({2: torch.int16, 4: torch.int32}[t.element_size()]).to(torch.int64)
    magnitude = bits & (0x7FFF if t.element_size() == 2 else 0x7FFFFFFF)
    return torch.where(bits >= 0, bits, -magnitude)


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance between a and b in units in the last place of their dtype."""
    assert a.dtype == b.dtype and a.shape == b.shape
    return int((ordered(a) - ordered(b)).abs().max()) if a.numel() else 0


# torch reduces with the vector width the loaded CPU kernels assume (csrc/cpu/norm.cpp,
# torch_order_sum_of_squares): 16 floats where both use AVX-512, 8 where both use AVX2
_WIDE = "avx512f" in pagedgen.ops.cpu_isa_features()
SAME_SUM_ORDER = (torch.backends.cpu.get_cpu_capability() == "AVX512") == _WIDE and (
    _WIDE or torch.backends.cpu.get_cpu_capability() == "AVX2")


def assert_bitwise(out, expected):
    if SAME_SUM_ORDER:
        assert ulps(out, expected) == 0, f"{ulps(out, expected)} ulps of {out.dtype} from the reference"
    else:
        assert ulps(out, expected) <= 2


def assert_close_to_reference(out, expected):
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, expected, **FP32_TOL)
    else:
        assert ulps(out, expected) <= 1, f"{ulps(out, expected)} ulps of {out.dtype} from the reference"


def rows(num_tokens, hidden, dtype, seed, stride_pad=0):
    """[num_tokens, hidden] random rows, as a view with a row stride of hidden + stride_pad."""
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(num_tokens, hidden + stride_pad, generator=gen).to(dtype)
    return full[:, :hidden]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, hidden", NORM_SIZES)
@pytest.mark.parametrize("stride_pad", [0, 5])
def test_rms_norm(num_tokens, hidden, stride_pad, dtype):
    x = rows(num_tokens, hidden, dtype, 0, stride_pad) * 3
    weight = rows(1, hidden, dtype, 1)[0].contiguous()
    out = rows(num_tokens, hidden, dtype, 2, 3).fill_(float("nan"))  # a strided out, every element written
    torch.ops.pagedgen.rms_norm(out, x, weight, 1e-5)
    expected = torch.empty(num_tokens, hidden, dtype=dtype)
    reference.rms_norm(expected, x, weight, 1e-5)
    assert_bitwise(out, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, hidden", NORM_SIZES)
@pytest.mark.parametrize("stride_pad", [0, 3])
def test_fused_add_rms_norm(num_tokens, hidden, stride_pad, dtype):
    x, residual = rows(num_tokens, hidden, dtype, 2, stride_pad), rows(num_tokens, hidden, dtype, 3, stride_pad)
    weight = rows(1, hidden, dtype, 4)[0].contiguous()
    x_ref, residual_ref = x.clone(), residual.clone()
    torch.ops.pagedgen.fused_add_rms_norm(x, residual, weight, 1e-6)
    reference.fused_add_rms_norm(x_ref, residual_ref, weight, 1e-6)
    assert torch.equal(residual, residual_ref)  # the add is elementwise: bitwise
    assert_bitwise(x, x_ref)


# (num_heads, num_kv_heads, head_size): stories260K, the 135M SmolLM, TinyLlama, Llama-2-7B, and odd
# head sizes (halves that are not whole vectors: 3, 5, 6, 10, 20, 40, 48)
ROTARY_SHAPES = [(8, 4, 8), (9, 3, 64), (32, 4, 64), (32, 8, 128), (4, 2, 6), (3, 1, 10), (2, 2, 12), (5, 1, 20),
                 (2, 1, 40), (4, 4, 80), (2, 1, 96), (1, 1, 256)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_size", ROTARY_SHAPES)
def test_rotary_embedding_bitwise(num_heads, num_kv_heads, head_size, dtype):
    """On q/k views of one qkv buffer (non-contiguous rows), as the model calls it; v stays untouched."""
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
@pytest.mark.parametrize("num_tokens, d", [(1, 172), (77, 172), (3, 1), (9, 13), (256, 1536), (40, 5632), (600, 1536)])
@pytest.mark.parametrize("stride_pad", [0, 7])
def test_silu_and_mul(num_tokens, d, stride_pad, dtype):
    x = rows(num_tokens, 2 * d, dtype, 6, stride_pad) * 4  # gates well into both tails of silu
    out = rows(num_tokens, d, dtype, 7, stride_pad).fill_(float("nan"))
    torch.ops.pagedgen.silu_and_mul(out, x)
    expected = torch.empty(num_tokens, d, dtype=dtype)
    reference.silu_and_mul(expected, x)
    assert_close_to_reference(out, expected)


def test_bf16_store_of_denormal_and_nan_results():
    """bf16 results that are denormal or NaN are rounded as c10 does (denormals kept, NaN -> 0x7FC0),
    also where the build stores 16 lanes with AVX512-BF16's vcvtneps2bf16 (which flushes denormals to
    zero and keeps a NaN's sign): a vector with such a lane takes the integer rounding, the others the
    instruction. 64 gates: the second and fourth 16-lane vectors hold one denormal or NaN result each."""
    gate = torch.randn(64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    gate[16 + 5], gate[48 + 11] = 3e-39, float("nan")  # silu(g) ~ g / 2: a bf16 denormal; NaN
    gate[48 + 12] = -float("nan")
    x = torch.cat([gate, torch.full_like(gate, 1.5)])[None]  # [1, 128]: up = 1.5
    out = torch.empty(1, 64, dtype=torch.bfloat16)
    torch.ops.pagedgen.silu_and_mul(out, x)
    expected = torch.empty_like(out)
    reference.silu_and_mul(expected, x)
    nan = expected.isnan()
    assert torch.equal(out.isnan(), nan)
    assert (out.view(torch.int16)[nan] == 0x7FC0).all()  # c10's NaN, whatever the input's sign
    assert ulps(out[~nan], expected[~nan]) <= 1
    assert out[0, 16 + 5] != 0 and out[0, 16 + 5].float().abs() < torch.finfo(torch.bfloat16).tiny  # not flushed


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_extreme_gates(dtype):
    """Large gates of both signs (silu -> x and -> -0), zeros, infinities: as torch's."""
    values = [0.0, -0.0, 1e-30, -1e-30, 20.0, -20.0, 87.0, -87.0, 88.5, -88.5, 89.0, -89.0, 100.0, -100.0,
              float("inf"), float("-inf")]
    gate = torch.tensor(values).to(dtype)
    x = torch.cat([gate, torch.full_like(gate, 1.5)])[None]  # [1, 2d]: up = 1.5
    out = torch.empty(1, len(values), dtype=dtype)
    torch.ops.pagedgen.silu_and_mul(out, x)
    expected = torch.empty_like(out)
    reference.silu_and_mul(expected, x)
    finite = expected.isfinite()
    assert torch.equal(out.isfinite(), finite)
    torch.testing.assert_close(out[~finite], expected[~finite], equal_nan=True, rtol=0, atol=0)  # inf, NaN
    assert_close_to_reference(out[finite], expected[finite])


def test_layer_ops_reject_wrong_dtype_and_shape():
    with pytest.raises(RuntimeError, match="dtype must be float32, bfloat16 or float16"):
        torch.ops.pagedgen.rms_norm(torch.zeros(2, 4, dtype=torch.float64), torch.zeros(2, 4, dtype=torch.float64),
                                    torch.ones(4, dtype=torch.float64), 1e-5)
    with pytest.raises(RuntimeError, match=r"weight must be \[4\]"):
        torch.ops.pagedgen.rms_norm(torch.zeros(2, 4), torch.zeros(2, 4), torch.ones(5), 1e-5)
    with pytest.raises(RuntimeError, match="out must be"):
        torch.ops.pagedgen.silu_and_mul(torch.zeros(2, 3), torch.zeros(2, 8))
    with pytest.raises(RuntimeError, match="dtype must be float32, bfloat16 or float16"):
        torch.ops.pagedgen.silu_and_mul(torch.zeros(2, 4, dtype=torch.float64), torch.zeros(2, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="dtype must be float32, bfloat16 or float16"):
        q = torch.zeros(2, 2, 8, dtype=torch.float64)
        torch.ops.pagedgen.rotary_embedding(torch.tensor([0, 1]), q, q.clone(), torch.zeros(4, 8), torch.zeros(4, 8))


def opcheck_inputs(dtype):
    gen = torch.Generator().manual_seed(0)
    x, residual, w = (torch.randn(3, 16, generator=gen).to(dtype), torch.randn(3, 16, generator=gen).to(dtype),
                      torch.randn(16, generator=gen).to(dtype))
    qkv = torch.randn(3, 4 * 8, generator=gen).to(dtype)
    return {
        "rms_norm": (torch.empty(3, 16, dtype=dtype), x, w, 1e-5),
        "fused_add_rms_norm": (x.clone(), residual, w, 1e-5),
        "rotary_embedding": (torch.tensor([0, 5, 2]), qkv[:, :16].view(3, 2, 8), qkv[:, 16:24].view(3, 1, 8),
                             torch.randn(8, 8, generator=gen), torch.randn(8, 8, generator=gen)),
        "silu_and_mul": (torch.empty(3, 8, dtype=dtype), torch.randn(3, 16, generator=gen).to(dtype)),
    }


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul"])
def test_opcheck(name, dtype):
    torch.library.opcheck(getattr(torch.ops.pagedgen, name).default, opcheck_inputs(dtype)[name])
