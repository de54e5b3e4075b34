"""pagedgen::logprob_topk, the sampler's logprobs (issue 50): the CPU kernel of pagedgen._C against
its reference ``pagedgen.ops.reference.logprob_topk`` (the PyTorch code it replaced). Token ids, ranks
and the top-k ids equal the reference's exactly (ties by lowest token id, in bf16 too); the logprobs
agree to 1e-5 relative to the log-sum-exp (the kernel sums in its own order). Over float32, bfloat16
and float16, k_max 0..20, 1..300 rows, vocab sizes around the vector width (8 floats with AVX2, 16
with AVX-512), its 4-vector blocks and the float64 chunks, and a 49,152 + 3 vocabulary; masked (-inf)
entries, +inf and NaN rows; strided tensors. A row's bits do not depend on the other rows. Bad
arguments raise before anything is written. Plus torch.library.opcheck and the door's fallback past
``LOGPROB_TOPK_MAX``.
"""
import pytest
import torch

import pagedgen.ops
from pagedgen.ops import reference
from pagedgen.sample.logprobs import logprob_tensors

pytestmark = pytest.mark.skipif(
    not pagedgen.ops.has_kernel("logprob_topk"), reason="pagedgen._C has no logprob_topk kernel: " + pagedgen.ops.extension_error("cpu")
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
INF, NAN = float("inf"), float("nan")
RTOL = 1e-5  # of the log-sum-exp


def kernel(logits: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    out = torch.full((logits.shape[0], 3 + 2 * k), -7.0, dtype=torch.float64)
    torch.ops.pagedgen.logprob_topk(out, logits, ids, k)
    return out


def oracle(logits: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    out = torch.empty(logits.shape[0], 3 + 2 * k, dtype=torch.float64)
    reference.logprob_topk(out, logits, ids, k)
    return out


def assert_as_reference(logits: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """The kernel's packed rows against the reference's: ids, ranks, top ids exact; logprobs close."""
    got, want = kernel(logits, ids, k), oracle(logits, ids, k)
    exact = [0, 2] + list(range(3 + k, 3 + 2 * k))
    bad = (got[:, exact] != want[:, exact]).any(dim=1).nonzero().flatten().tolist()[:3]
    assert not bad, f"rows {bad}: kernel {got[bad].tolist()}, reference {want[bad].tolist()}"
    values = [1] + list(range(3, 3 + k))
    lse = torch.logsumexp(logits.float(), dim=-1, keepdim=True).double()  # the reference's, per row
    tol = RTOL * lse.abs().clamp(min=1.0)
    g, w = got[:, values], want[:, values]
    close = ((g - w).abs() <= tol) | (g == w) | (g.isnan() & w.isnan())
    bad = (~close).any(dim=1).nonzero().flatten().tolist()[:3]
    assert not bad, f"rows {bad}: kernel {got[bad].tolist()}, reference {want[bad].tolist()}"
    return got


def random_case(rows: int, vocab: int, dtype, seed: int, scale: float = 4.0, row_pad: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab + row_pad, generator=g) * scale).to(dtype)[:, :vocab]
    return logits, torch.randint(0, vocab, (rows,), generator=g)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 2, 7, 8, 9, 31, 32, 33, 63, 65, 257, 1000, 4099, 49152 + 3])
def test_random_logits_every_k(vocab, dtype):
    logits, ids = random_case(13, vocab, dtype, seed=vocab, row_pad=3)
    ks = {0, 1, 2, 5, 7, 19, 20} if vocab < 4000 else {0, 5, 20}
    for k in sorted(ks & set(range(min(vocab, 20) + 1))):
        assert_as_reference(logits, ids, k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_1_to_300_and_the_chosen_token_everywhere(dtype):
    """Many row counts; chosen tokens among the top ones (small ranks) as well as random ones."""
    for rows in (1, 2, 3, 17, 64, 300):
        logits, ids = random_case(rows, 3001, dtype, seed=rows)
        top = logits.float().argmax(dim=-1)
        ids[::2] = top[::2]  # rank 1 (or more on ties)
        assert_as_reference(logits, ids, 5)


@pytest.mark.parametrize("dtype, vocab", [(d, v) for d in DTYPES for v in (20, 33, 129, 4099)] + [(torch.bfloat16, 49152 + 3)])
def test_ties_go_to_the_lowest_token_id(vocab, dtype):
    """Few distinct values (bf16-like ties everywhere), and one maximum placed at pairs of positions."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randint(-3, 3, (40, vocab), generator=g).to(dtype)
    ids = torch.randint(0, vocab, (40,), generator=g)
    out = assert_as_reference(logits, ids, min(20, vocab))
    row = logits[0].float().tolist()
    expected = sorted(range(vocab), key=lambda j: (-row[j], j))[: min(20, vocab)]
    assert out[0, 3 + min(20, vocab):].long().tolist() == expected
    bf16 = (torch.randn(40, vocab, generator=g) * 2).to(torch.bfloat16).to(dtype)  # ~256 distinct values
    assert_as_reference(bf16, ids, min(20, vocab))
    places = sorted({p for p in (0, 1, 7, 8, 31, 32, vocab // 2, vocab - 2, vocab - 1) if 0 <= p < vocab})
    pairs = [(a, b) for a in places for b in places if a < b]
    logits, ids = random_case(len(pairs), vocab, dtype, seed=3)
    for r, (a, b) in enumerate(pairs):
        logits[r, a] = logits[r, b] = 50.0
        ids[r] = b
    out = assert_as_reference(logits, ids, 3)
    assert out[:, 3 + 3 : 3 + 5].long().tolist() == [list(p) for p in pairs] and out[:, 2].tolist() == [2.0] * len(pairs)


@pytest.mark.parametrize("dtype, vocab", [(d, v) for d in DTYPES for v in (9, 40, 1000, 4099)] + [(torch.bfloat16, 49152 + 3)])
def test_masked_entries(vocab, dtype):
    """-inf (masked) logits: most of a row, all but fewer than k of it (the -inf ones then enter
    the top k by id), the chosen token itself (its rank counts every entry), a whole row."""
    g = torch.Generator().manual_seed(4)
    logits, ids = random_case(12, vocab, dtype, seed=5)
    keep = [vocab, vocab // 10, 5, 3, 1, 1, 0, vocab // 2, 2, vocab, 7, 0]
    for r, n in enumerate(keep):
        masked = torch.randperm(vocab, generator=g)[: vocab - min(n, vocab)]
        logits[r, masked] = -INF
    ids[4] = int(torch.isfinite(logits[4].float()).nonzero()[0]) if keep[4] else 0
    ids[5] = int((~torch.isfinite(logits[5].float())).nonzero()[-1])  # a masked chosen token: rank = vocab
    out = assert_as_reference(logits, ids, min(vocab, 20))
    assert out[5, 2] == vocab and out[5, 1] == -INF
    assert out[6, 1] != out[6, 1]  # an all -inf row: lse -inf, logprobs -inf - -inf = NaN, as torch


@pytest.mark.parametrize("dtype", DTYPES)
def test_infinite_and_nan_rows(dtype):
    """+inf: lse +inf as torch's logsumexp. NaN: lse NaN, NaNs first in the top k (torch.topk's
    order), by id; the count of logits >= the chosen one stands; the other rows are untouched."""
    vocab, k = 100, 5
    logits, ids = random_case(6, vocab, dtype, seed=6)
    logits[1, 40] = INF
    logits[2, [3, 70, 77]] = INF
    assert_as_reference(logits[:3], ids[:3], k)
    logits[3, [90, 10]] = NAN
    logits[4, 5] = NAN
    ids[4] = 5
    logits[5] = NAN
    out = kernel(logits, ids, k)
    assert torch.equal(out[:3].view(torch.int64), kernel(logits[:3], ids[:3], k).view(torch.int64))  # the same bits
    for r in (3, 4, 5):
        x = logits[r].float().tolist()
        expected = sorted(range(vocab), key=lambda j: (x[j] == x[j], -x[j] if x[j] == x[j] else 0, j))[:k]
        assert out[r, 3 + k :].long().tolist() == expected, r
        assert out[r, 3 : 3 + k].isnan().all() and out[r, 0] == ids[r]
        chosen = x[int(ids[r])]
        assert out[r, 2] == sum(v >= chosen for v in x)
    assert out[4, 2] == 0 and out[5, 2] == 0  # a NaN chosen token: nothing compares >= NaN


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [49152, 32000, 13])
def test_a_rows_bits_do_not_depend_on_the_batch(vocab, dtype):
    g = torch.Generator().manual_seed(vocab)
    row = (torch.randn(vocab, generator=g) * 3).to(dtype)
    row[:: 7] = row[1]  # ties
    alone = kernel(row[None], torch.tensor([3 % vocab]), min(vocab, 20))
    for rows, at in ((2, 1), (7, 0), (64, 33), (300, 299)):
        logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
        logits[at] = row
        ids = torch.randint(0, vocab, (rows,), generator=g)
        ids[at] = 3 % vocab
        got = kernel(logits, ids, min(vocab, 20))[at : at + 1]
        assert torch.equal(got.view(torch.int64), alone.view(torch.int64)), (rows, at)


def test_strided_tensors_and_no_rows():
    logits, ids = random_case(9, 301, torch.bfloat16, seed=7, row_pad=5)  # row stride 306
    strided_ids = torch.stack([ids, ids], dim=1)[:, 0]  # stride 2
    want = kernel(logits.contiguous(), ids, 4)
    out = torch.zeros(9, 20, dtype=torch.float64)[:, : 3 + 8]  # row stride 20
    torch.ops.pagedgen.logprob_topk(out, logits, strided_ids, 4)
    assert torch.equal(out, want)
    for dtype in DTYPES:
        empty = torch.empty(0, 11, dtype=torch.float64)
        torch.ops.pagedgen.logprob_topk(empty, torch.empty(0, 5, dtype=dtype), torch.empty(0, dtype=torch.int64), 4)
        assert logprob_tensors(torch.empty(0, 5, dtype=dtype), torch.empty(0, dtype=torch.int64), 2).shape == (0, 7)


def test_the_door_and_logprob_tensors():
    """``ops.logprob_topk`` runs the kernel up to LOGPROB_TOPK_MAX and the reference past it;
    ``logprob_tensors`` packs through it, in the logits' own dtype (a strided last dim made contiguous)."""
    logits, ids = random_case(5, 700, torch.bfloat16, seed=8)
    assert pagedgen.ops.LOGPROB_TOPK_MAX == 20
    for k in (0, 20, 21, 64):
        got = logprob_tensors(logits, ids, k)
        assert got.shape == (5, 3 + 2 * k)
        if k > 20:
            assert torch.equal(got, oracle(logits, ids, k))
        else:
            assert torch.equal(got, kernel(logits, ids, k))
    columns = logits.t().contiguous().t()  # the same values with a strided last dim
    assert torch.equal(logprob_tensors(columns, ids, 3), kernel(logits, ids, 3))


def test_bad_arguments_raise_before_writing():
    logits, ids = random_case(3, 50, torch.float32, seed=9)
    op = torch.ops.pagedgen.logprob_topk

    def raises(match, out=None, x=logits, t=ids, k=2):
        out = torch.full((3, 7), -7.0, dtype=torch.float64) if out is None else out
        before = out.clone()
        with pytest.raises(RuntimeError, match=match):
            op(out, x, t, k)
        assert torch.equal(out, before)  # nothing written

    raises(r"token_ids\[1\] = 50 is outside \[0, 50\)", t=torch.tensor([0, 50, 1]))
    raises(r"token_ids\[2\] = -1 is outside \[0, 50\)", t=torch.tensor([0, 1, -1]))
    raises(r"k_max must be in \[0, 20\]", out=torch.zeros(3, 45, dtype=torch.float64), k=21)
    raises(r"k_max must be in \[0, 20\]", out=torch.zeros(3, 1, dtype=torch.float64), k=-1)
    raises(r"k_max must be in \[0, 4\]", out=torch.zeros(3, 13, dtype=torch.float64), x=logits[:, :4].contiguous(), k=5)
    raises(r"out must be \[3, 7\]", out=torch.zeros(3, 9, dtype=torch.float64))
    raises(r"out must be float64", out=torch.zeros(3, 7, dtype=torch.float32))
    raises("dtype must be float32, bfloat16 or float16", x=logits.double())
    raises("token_ids must be int64", t=ids.int())
    raises(r"token_ids must be \[3\]", t=ids[:2])
    raises(r"logits must be \[num_rows, vocab\]", x=logits[0])
    raises(r"logits must be \[num_rows, vocab\] with vocab >= 1", x=logits[:, :0])
    raises("contiguous rows", x=logits.t().contiguous().t())
    raises("contiguous rows", out=torch.zeros(7, 3, dtype=torch.float64).t())
    shared = torch.zeros(3, 7, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="out must not overlap logits"):
        op(shared, shared.view(torch.float32)[:, :12], ids, 2)  # logits inside out's memory


@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck(dtype):
    logits, ids = random_case(5, 37, dtype, seed=10, row_pad=3)
    torch.library.opcheck(torch.ops.pagedgen.logprob_topk.default, (torch.empty(5, 9, dtype=torch.float64), logits, ids, 3))
