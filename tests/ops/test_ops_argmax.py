"""pagedgen::argmax, the sampler's greedy token: the CPU kernel of pagedgen._C against
``logits.max(dim=-1).indices`` (its reference), which it must equal exactly: the first maximal index on
ties, the first NaN's index in a row with a NaN, 0 for a row of -inf, -0.0 equal to +0.0. In float32,
bfloat16 and float16, over vocab sizes around the vector width (16 floats with AVX-512, 8 with AVX2)
and the kernel's 4-vector blocks, a 49152 + 3 vocabulary (SmolLM's 49152), strided rows, plus
torch.library.opcheck.
"""
import pytest
import torch

import pagedgen.ops
from pagedgen.ops import reference
from pagedgen.sample.sampler import greedy_ids

pytestmark = pytest.mark.skipif(
    not pagedgen.ops.extension_available("cpu"), reason="pagedgen._C is not built: " + pagedgen.ops.extension_error("cpu")
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
VOCABS = [1, 2, 15, 16, 17, 31, 63, 64, 65, 127, 129, 1000, 49152 + 3]
INF, NAN = float("inf"), float("nan")


def kernel(logits: torch.Tensor) -> torch.Tensor:
    out = torch.full((logits.shape[0],), -1, dtype=torch.int64)
    torch.ops.pagedgen.argmax(out, logits)
    return out


def assert_as_torch(logits: torch.Tensor) -> None:
    expected = logits.max(dim=-1).indices
    assert torch.equal(expected, logits.argmax(dim=-1))  # the two torch spellings agree
    got = kernel(logits)
    bad = (got != expected).nonzero().flatten().tolist()[:5]
    assert not bad, f"rows {bad}: kernel {got[bad].tolist()}, torch {expected[bad].tolist()}"


def strided(num_rows: int, vocab: int, dtype, stride_pad: int, fill=None, seed: int = 0) -> torch.Tensor:
    """[num_rows, vocab] as a view with row stride vocab + stride_pad (random normal, or ``fill``)."""
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(num_rows, vocab + stride_pad, generator=gen) * 4 if fill is None else torch.full(
        (num_rows, vocab + stride_pad), fill)
    return full.to(dtype)[:, :vocab]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("stride_pad", [0, 5])
def test_argmax_random(vocab, stride_pad, dtype):
    assert_as_torch(strided(7, vocab, dtype, stride_pad))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 17, 64, 129, 49152 + 3])
def test_argmax_ties(vocab, dtype):
    """Small integers (many equal maxima), and one maximum placed twice, at every pair of positions
    drawn from the row's vector boundaries and its tail."""
    gen = torch.Generator().manual_seed(1)
    assert_as_torch(torch.randint(-3, 3, (64, vocab), generator=gen).to(dtype))
    places = sorted({p for p in (0, 1, 15, 16, 17, 63, 64, 65, vocab // 2, vocab - 17, vocab - 2, vocab - 1) if 0 <= p < vocab})
    pairs = [(a, b) for a in places for b in places if a <= b]
    logits = strided(len(pairs), vocab, dtype, 3, seed=2)
    for row, (a, b) in enumerate(pairs):
        logits[row, a] = logits[row, b] = 100.0
    assert_as_torch(logits)
    assert kernel(logits).tolist() == [a for a, _ in pairs]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 16, 17, 65, 1000, 49152 + 3])
def test_argmax_nan_inf_and_signed_zeros(vocab, dtype):
    """NaN anywhere (the first one wins, even over +inf), rows of -inf, +inf maxima, -0.0 == +0.0."""
    places = sorted({p for p in (0, 1, 15, 16, 63, 64, vocab // 3, vocab - 2, vocab - 1) if 0 <= p < vocab})
    cases = []
    for a in places:
        for b in places:
            cases.append(((a, NAN), (b, NAN)))  # two NaNs: the first
            cases.append(((a, INF), (b, NAN)))  # NaN beats +inf wherever it is
            cases.append(((a, INF), (b, INF)))  # +inf ties
    logits = strided(len(cases), vocab, dtype, 2, seed=3)
    for row, case in enumerate(cases):
        for place, value in case:
            logits[row, place] = value
    assert_as_torch(logits)
    assert_as_torch(strided(3, vocab, dtype, 1, fill=-INF))  # all -inf: 0
    nan_in_inf = strided(len(places), vocab, dtype, 1, fill=-INF)
    for row, p in enumerate(places):
        nan_in_inf[row, p] = NAN
    assert_as_torch(nan_in_inf)
    # signed zeros: -0.0 and +0.0 equal, the first wins whatever its sign; the rest of the row negative
    for first, second in ((-0.0, 0.0), (0.0, -0.0), (-0.0, -0.0)):
        zeros = strided(len(places), vocab, dtype, 0, fill=-1.0)
        for row, p in enumerate(places):
            zeros[row, p] = first
            zeros[row, places[-1]] = second if p != places[-1] else first
        assert_as_torch(zeros)
    assert_as_torch(strided(2, vocab, dtype, 0, fill=-0.0))
    assert_as_torch(strided(2, vocab, dtype, 0, fill=0.0))


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_special_value_mix(dtype):
    """Rows drawn from a handful of values (specials included) in random proportions, many vocab sizes."""
    values = torch.tensor([-INF, -1.0, -0.0, 0.0, 1.0, 2.5, INF, NAN])
    gen = torch.Generator().manual_seed(4)
    for vocab in [1, 3, 16, 33, 64, 100, 257, 4099]:
        weights = torch.rand(200, len(values), generator=gen) ** 4  # skewed: some rows almost free of a value
        weights[:, -1] *= torch.rand(200, generator=gen).lt(0.5)  # half the rows without NaN
        weights[:, -2] *= torch.rand(200, generator=gen).lt(0.5)  # half without +inf
        picks = torch.multinomial(weights, vocab, replacement=True, generator=gen)  # [200, vocab]
        assert_as_torch(values[picks].to(dtype))


def test_argmax_no_rows_and_the_wrappers():
    for dtype in DTYPES:
        out = torch.empty(0, dtype=torch.int64)
        torch.ops.pagedgen.argmax(out, torch.empty(0, 5, dtype=dtype))
        assert greedy_ids(torch.empty(0, 5, dtype=dtype)).shape == (0,)
        logits = strided(9, 301, dtype, 4, seed=5)
        for impl in (pagedgen.ops.argmax, reference.argmax):
            out = torch.full((9,), -1, dtype=torch.int64)
            impl(out, logits)
            assert torch.equal(out, logits.max(dim=-1).indices)
        assert torch.equal(greedy_ids(logits), logits.max(dim=-1).indices)
    strided_out = torch.full((9, 2), -1, dtype=torch.int64)[:, 0]  # an out with stride 2
    torch.ops.pagedgen.argmax(strided_out, logits)
    assert torch.equal(strided_out, logits.max(dim=-1).indices)


def test_argmax_rejects_wrong_dtype_and_shape():
    out = torch.empty(2, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="argmax: dtype must be float32, bfloat16 or float16"):
        torch.ops.pagedgen.argmax(out, torch.zeros(2, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"argmax: out must be int64 \[2\]"):
        torch.ops.pagedgen.argmax(torch.empty(2, dtype=torch.int32), torch.zeros(2, 4))
    with pytest.raises(RuntimeError, match=r"argmax: out must be int64 \[2\]"):
        torch.ops.pagedgen.argmax(torch.empty(3, dtype=torch.int64), torch.zeros(2, 4))
    with pytest.raises(RuntimeError, match=r"argmax: logits must be \[num_rows, vocab\]"):
        torch.ops.pagedgen.argmax(out, torch.zeros(4))
    with pytest.raises(RuntimeError, match=r"argmax: logits must be \[num_rows, vocab\]"):
        torch.ops.pagedgen.argmax(out, torch.zeros(4, 2).t())  # last dim not contiguous
    with pytest.raises(RuntimeError, match="vocab >= 1"):
        torch.ops.pagedgen.argmax(out, torch.zeros(2, 0))


@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck(dtype):
    logits = strided(5, 37, dtype, 3, seed=6)
    torch.library.opcheck(torch.ops.pagedgen.argmax.default, (torch.empty(5, dtype=torch.int64), logits))
