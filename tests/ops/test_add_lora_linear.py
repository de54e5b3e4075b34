"""``add_lora_linear`` (multi-LoRA, issue 48): the PyTorch reference against a per-row float64 sum, the
CPU kernel against the reference (tails of every size, mixed dtypes, rows of no adapter left bit for
bit), each row's bits independent of the other rows, their slots, their order and the threads, opcheck
and the kernel's argument errors."""
import pytest
import torch

from pagedgen import ops
from pagedgen.ops import reference

needs_kernel = pytest.mark.skipif(not ops.has_kernel("add_lora_linear"), reason="pagedgen._C has no add_lora_linear CPU kernel (AVX2)")
KERNEL = getattr(torch.ops.pagedgen, "add_lora_linear", None) if ops.extension_available("cpu") else None


def case(m, k, slices, rank, num_slots, dtype, wdtype=None, seed=0):
    """(out, input, lora_a, lora_b, slots): random rows, slots drawn from [-1, num_slots)."""
    g = torch.Generator().manual_seed(seed)
    n, parts = sum(slices), len(slices)
    out = torch.randn(m, n, generator=g).to(dtype)
    x = torch.randn(m, k, generator=g).to(dtype)
    a = (torch.randn(num_slots, k, parts * rank, generator=g) * 0.1).to(wdtype or dtype)
    b = (torch.randn(num_slots, rank, n, generator=g) * 0.1).to(wdtype or dtype)
    slots = torch.randint(-1, num_slots, (m,), generator=g, dtype=torch.int32)
    return out, x, a, b, slots


def run(fn, out, x, a, b, slots, slices):
    y = out.clone()
    fn(y, x, a, b, slots, list(slices))
    return y


def float64_delta(x, a, b, slots, slices):
    """Each row's delta in float64, one row at a time (the definition)."""
    rank, m = b.shape[1], x.shape[0]
    d = torch.zeros(m, sum(slices), dtype=torch.float64)
    for i in range(m):
        s = int(slots[i])
        if s < 0:
            continue
        h = x[i].double() @ a[s].double()  # [P R]
        off = 0
        for p, size in enumerate(slices):
            d[i, off:off + size] = h[p * rank:(p + 1) * rank] @ b[s, :, off:off + size].double()
            off += size
    return d


def test_reference_is_the_per_row_sum_and_leaves_base_rows():
    slices = (40, 8, 8)
    out, x, a, b, slots = case(23, 37, slices, 4, 3, torch.float32)
    slots[:3] = -1
    got = run(reference.add_lora_linear, out, x, a, b, slots, slices)
    want = out.double() + float64_delta(x, a, b, slots, slices)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[:3], out[:3])
    # a part's columns take only that part's rank block of the shrink: zeroing part 1's A changes only its columns
    a2 = a.clone()
    a2[:, :, 4:8] = 0
    got2 = run(reference.add_lora_linear, out, x, a2, b, slots, slices)
    assert torch.equal(got2[:, :40], got[:, :40]) and torch.equal(got2[:, 48:], got[:, 48:])


@needs_kernel
@pytest.mark.parametrize("dtype,wdtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                          (torch.bfloat16, torch.float32)], ids=str)
def test_kernel_matches_reference(dtype, wdtype):
    # tails: K % 8, P R % 16, slice sizes % 16 and < 8; one slot, many slots; a row alone; no row adapted
    for m, k, slices, rank, num_slots in ((1, 8, (16,), 16, 1), (13, 37, (40, 8, 8), 4, 3), (50, 576, (576, 192, 192), 16, 4),
                                          (9, 100, (3, 29), 5, 2), (31, 64, (172, 172), 8, 5), (0, 16, (16,), 16, 2)):
        out, x, a, b, slots = case(m, k, slices, rank, num_slots, dtype, wdtype, seed=m + k)
        if m == 9:
            slots[:] = -1
        got = run(KERNEL, out, x, a, b, slots, slices)
        want = run(reference.add_lora_linear, out, x, a, b, slots, slices)
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(got.float(), want.float(), **tol)
        none = slots < 0
        assert torch.equal(got[none], out[none]), (m, k, slices)  # rows of no adapter: untouched, bit for bit


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_independent_of_batch_slots_order_and_threads(dtype):
    """Batch invariance: each row alone gives the bits it gets among 1-300 rows of any slots, in any order, on 1 or 2 threads."""
    slices = (576, 192, 192)
    out, x, a, b, slots = case(300, 576, slices, 16, 4, dtype, seed=7)
    alone = torch.cat([run(KERNEL, out[i:i + 1], x[i:i + 1], a, b, slots[i:i + 1], slices) for i in range(300)])
    threads = torch.get_num_threads()
    try:
        for t in sorted({1, 2, threads}):
            torch.set_num_threads(t)
            for n in (7, 25, 300):
                assert torch.equal(run(KERNEL, out[:n], x[:n], a, b, slots[:n], slices), alone[:n]), (t, n)
            perm = torch.randperm(300, generator=torch.Generator().manual_seed(t))
            assert torch.equal(run(KERNEL, out[perm], x[perm], a, b, slots[perm], slices), alone[perm]), t
            one_slot = torch.full((300,), 2, dtype=torch.int32)  # every row in one slot: other tiles
            want = torch.cat([run(KERNEL, out[i:i + 1], x[i:i + 1], a, b, one_slot[:1], slices) for i in range(0, 300, 37)])
            assert torch.equal(run(KERNEL, out, x, a, b, one_slot, slices)[::37], want), t
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_opcheck():
    out, x, a, b, slots = case(11, 40, (24, 8), 4, 3, torch.bfloat16)
    torch.library.opcheck(torch.ops.pagedgen.add_lora_linear, (out, x, a, b, slots, [24, 8]))


@needs_kernel
def test_argument_errors():
    slices = [24, 8]
    out, x, a, b, slots = case(5, 40, slices, 4, 3, torch.float32)
    bad = [
        ((out, x[:, :39], a, b, slots, slices), "lora_a must be contiguous"),
        ((out[:4], x, a, b, slots, slices), "out must be"),
        ((out, x, a, b[:, :3].contiguous(), slots, slices), "must be len\\(output_slices\\)"),
        ((out, x, a, b, slots, [20, 8]), "must sum to out.s columns 32"),
        ((out, x, a, b, slots, [16, 16]), None),  # sizes may be anything summing to N
        ((out, x, a, b, slots, [-8, 40]), "must be >= 0"),
        ((out, x, a, b, slots.long(), slices), "slots must be int32"),
        ((out, x, a, b, torch.tensor([0, 1, 3, -1, 0], dtype=torch.int32), slices), r"slots\[2\] = 3 must be -1 or in \[0, 3\)"),
        ((out.bfloat16(), x, a, b, slots, slices), "input and out must be one dtype"),
        ((out, x, a, b.half(), slots, slices), "lora_a and lora_b must be one dtype"),
        ((out, x.t().contiguous().t(), a, b, slots, slices), "input must be \\[M, K\\] with contiguous rows"),
    ]
    for args, message in bad:
        y = args[0].clone()
        if message is None:
            KERNEL(y, *args[1:])
            continue
        with pytest.raises(RuntimeError, match=message):
            KERNEL(y, *args[1:])
