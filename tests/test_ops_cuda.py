"""The CUDA kernels of pagedgen._C against the PyTorch reference (pagedgen/ops/reference.py), plus
``torch.library.opcheck``. Needs a CUDA GPU; without one every test here is skipped. With one, a
missing CUDA build is a failure, not a skip.

Poisoning makes the comparisons strict: outputs start as NaN (every element must be written), and
every cache slot outside the attended contexts (padding in the last block, unused blocks, the block
that unused block-table entries point to) holds NaN, so reading one poisons the result.

paged_attention picks split-K when fewer than 4 blocks per multiprocessor would run otherwise and
the block table spans more than 256 tokens (csrc/cuda/attention_params.cuh, plan_attention): the
small batches below take the split-K path, the ``many_seqs`` and short-context cases the single pass.
"""
import pytest
import torch

from pagedgen import ops
from pagedgen.ops import reference

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]

DEVICE = "cuda"
OPS = torch.ops.pagedgen
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # ~ one output rounding step


@pytest.fixture(scope="module", autouse=True)
def cuda_kernels():
    assert ops.extension_available("cuda"), ops.extension_error("cuda")


def num_sms() -> int:
    return torch.cuda.get_device_properties(DEVICE).multi_processor_count


def paged_batch(contexts, block_size, num_kv_heads, head_size, dtype, *, seed=0, extra_table=0, device=DEVICE):
    """Caches and block tables holding random keys/values for `contexts` tokens per sequence.

    Returns key_cache, value_cache [num_blocks, block_size, num_kv_heads, head_size] (NaN outside
    the contexts), block_tables [num_seqs, max_blocks] int32 (distinct random blocks; entries past a
    context point to the all-NaN block 0), seq_lens [num_seqs] int32.
    """
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-c // block_size) for c in contexts]
    max_blocks = max(blocks_per_seq + [1]) + extra_table
    num_blocks = sum(blocks_per_seq) + 1 + 3  # + the poison block 0 + unused ones
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    block_tables = torch.zeros(len(contexts), max_blocks, dtype=torch.int32)
    free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    for i, context in enumerate(contexts):
        for b in range(blocks_per_seq[i]):
            block = free.pop()
            block_tables[i, b] = block
            n = min(block_size, context - b * block_size)
            key_cache[block, :n] = torch.randn(n, num_kv_heads, head_size, generator=g).to(dtype)
            value_cache[block, :n] = torch.randn(n, num_kv_heads, head_size, generator=g).to(dtype)
    seq_lens = torch.tensor(contexts, dtype=torch.int32)
    return (t.to(device) for t in (key_cache, value_cache, block_tables, seq_lens))


def check_attention(query, key_cache, value_cache, block_tables, seq_lens, *, out=None):
    """Runs the kernel into a NaN-filled `out` and compares it with the reference (float32)."""
    scale = query.shape[-1] ** -0.5
    if out is None:
        out = torch.full_like(query, float("nan"))
    else:
        out.fill_(float("nan"))
    OPS.paged_attention(out, query, key_cache, value_cache, block_tables, seq_lens, scale)
    expected = torch.empty(query.shape, dtype=torch.float32, device=DEVICE)
    reference.paged_attention(expected, query, key_cache, value_cache, block_tables, seq_lens, scale)
    tol = TOL[query.dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
    assert (out[seq_lens.cpu() <= 0] == 0).all(), "empty contexts must give zeros"


def random_query(num_seqs, num_heads, head_size, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_seqs, num_heads, head_size, generator=g).to(dtype).to(DEVICE)


# ---- paged_attention ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_size", [8, 64, 80, 128, 256])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_paged_attention(dtype, head_size, group, block_size):
    num_kv_heads = 2
    contexts = [0, 1, block_size - 1, block_size, block_size + 1, 100, 257, 515, 1000]  # split-K
    kc, vc, bt, sl = paged_batch(contexts, block_size, num_kv_heads, head_size, dtype)
    q = random_query(len(contexts), num_kv_heads * group, head_size, dtype)
    check_attention(q, kc, vc, bt, sl)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_size", [8, 96, 112, 128])
def test_paged_attention_short_contexts_single_pass(dtype, head_size):
    contexts = [1, 2, 15, 16, 17, 200, 0, 255]  # table of 16 blocks x 16 = 256 tokens: single pass
    kc, vc, bt, sl = paged_batch(contexts, 16, 4, head_size, dtype)
    check_attention(random_query(len(contexts), 12, head_size, dtype), kc, vc, bt, sl)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("head_size", [8, 128])
def test_paged_attention_many_seqs_single_pass(dtype, head_size):
    num_kv_heads = 2
    num_seqs = 2 * num_sms() + 1  # >= 4 blocks per multiprocessor: single pass over long contexts
    g = torch.Generator().manual_seed(2)
    contexts = torch.randint(1, 1001, (num_seqs,), generator=g).tolist()
    contexts[:3] = [0, 3000, 1]
    kc, vc, bt, sl = paged_batch(contexts, 16, num_kv_heads, head_size, dtype)
    check_attention(random_query(num_seqs, num_kv_heads * 4, head_size, dtype), kc, vc, bt, sl)


@pytest.mark.parametrize("context", [4096, 32768])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_paged_attention_long_context_batch_one(context, dtype):
    kc, vc, bt, sl = paged_batch([context], 16, 8, 128, dtype)  # split into many partitions
    check_attention(random_query(1, 32, 128, dtype), kc, vc, bt, sl)


@pytest.mark.parametrize("group", [3, 6, 12, 16])
def test_paged_attention_group_sizes_beyond_powers_of_two(group):
    contexts = [7, 300, 700]
    kc, vc, bt, sl = paged_batch(contexts, 16, 2, 64, torch.bfloat16)
    check_attention(random_query(len(contexts), 2 * group, 64, torch.bfloat16), kc, vc, bt, sl)


@pytest.mark.parametrize("block_size", [1, 5, 12, 64])
def test_paged_attention_other_block_sizes(block_size):
    contexts = [1, 11, 130, 600]
    kc, vc, bt, sl = paged_batch(contexts, block_size, 2, 128, torch.float16)
    check_attention(random_query(len(contexts), 8, 128, torch.float16), kc, vc, bt, sl)


def test_paged_attention_wide_block_table():
    # a table far wider than the contexts (as an engine sized for max_model_len would pass)
    kc, vc, bt, sl = paged_batch([1, 40, 333], 16, 2, 128, torch.bfloat16, extra_table=500)
    check_attention(random_query(3, 8, 128, torch.bfloat16), kc, vc, bt, sl)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("aligned", [True, False])
def test_paged_attention_strided_query_and_out(dtype, aligned):
    # q as a view of a fused qkv projection (llama.py), out a view of a wider buffer; with an
    # unaligned q (one element of offset) the generic kernel takes over from the fast one.
    contexts = [5, 64, 700]
    num_heads, num_kv_heads, head_size = 8, 2, 128
    kc, vc, bt, sl = paged_batch(contexts, 16, num_kv_heads, head_size, dtype)
    width = (num_heads + 2 * num_kv_heads) * head_size + (0 if aligned else 1)
    qkv = torch.randn(len(contexts), width, dtype=dtype, device=DEVICE)
    offset = 0 if aligned else 1
    q = qkv[:, offset : offset + num_heads * head_size].view(len(contexts), num_heads, head_size)
    wide = torch.full((len(contexts), num_heads, head_size + 16), 7.0, dtype=dtype, device=DEVICE)
    out = wide[:, :, 8 : 8 + head_size]
    check_attention(q, kc, vc, bt, sl, out=out)
    assert (wide[:, :, :8] == 7).all() and (wide[:, :, 8 + head_size :] == 7).all(), "wrote outside out"


@pytest.mark.parametrize("head_size", [8, 128])
def test_paged_attention_prefill_rows(head_size):
    # the engine's prefill: one row per prompt token, seq_len = position + 1, rows of a prompt share
    # its block table (two prompts of 700 and 333 tokens)
    block_size, num_kv_heads, dtype = 16, 2, torch.bfloat16
    kc, vc, bt, _ = paged_batch([700, 333], block_size, num_kv_heads, head_size, dtype)
    rows = [(0, pos) for pos in range(700)] + [(1, pos) for pos in range(333)]
    block_tables = bt[[p for p, _ in rows]]
    seq_lens = torch.tensor([pos + 1 for _, pos in rows], dtype=torch.int32, device=DEVICE)
    check_attention(random_query(len(rows), 4 * num_kv_heads, head_size, dtype), kc, vc, block_tables, seq_lens)


def test_paged_attention_rejects_bad_arguments():
    kc, vc, bt, sl = paged_batch([5, 9], 16, 2, 64, torch.float16)
    q = random_query(2, 4, 64, torch.float16)
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="int32"):
        OPS.paged_attention(out, q, kc, vc, bt.long(), sl, 0.1)
    with pytest.raises(RuntimeError, match="dtype"):
        OPS.paged_attention(out.float(), q, kc, vc, bt, sl, 0.1)
    with pytest.raises(RuntimeError, match="multiple of num_kv_heads"):
        OPS.paged_attention(out[:, :3], q[:, :3], kc, vc, bt, sl, 0.1)
    with pytest.raises(RuntimeError, match="head_size"):
        OPS.paged_attention(out[..., :32], q[..., :32], kc, vc, bt, sl, 0.1)
    with pytest.raises(RuntimeError, match="must be on"):
        OPS.paged_attention(out, q, kc, vc, bt, sl.cpu(), 0.1)


# ---- reshape_and_cache ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype,cache_dtype",
    [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
     (torch.float32, torch.bfloat16)],
    ids=str,
)
@pytest.mark.parametrize("head_size", [8, 80, 128])
def test_reshape_and_cache(dtype, cache_dtype, head_size):
    num_tokens, num_kv_heads, num_heads, num_blocks, block_size = 77, 2, 4, 20, 16
    g = torch.Generator().manual_seed(3)
    # key and value as strided views of a fused qkv projection, as the model passes them
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, generator=g).to(dtype).to(DEVICE)
    key = qkv[:, num_heads * head_size : (num_heads + num_kv_heads) * head_size].view(num_tokens, num_kv_heads, head_size)
    value = qkv[:, (num_heads + num_kv_heads) * head_size :].view(num_tokens, num_kv_heads, head_size)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[::7] = -1  # padding
    slot_mapping = slots.to(DEVICE)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.randn(shape, generator=g).to(cache_dtype).to(DEVICE)
    value_cache = torch.randn(shape, generator=g).to(cache_dtype).to(DEVICE)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    reference.reshape_and_cache(key, value, expected_k, expected_v, slot_mapping)
    OPS.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)


def test_reshape_and_cache_rejects_bad_arguments():
    cache = torch.zeros(4, 8, 2, 64, device=DEVICE)
    key = torch.zeros(3, 2, 64, device=DEVICE)
    with pytest.raises(RuntimeError, match="int64"):
        OPS.reshape_and_cache(key, key, cache, cache.clone(), torch.zeros(3, dtype=torch.int32, device=DEVICE))
    with pytest.raises(RuntimeError, match="does not fit"):
        OPS.reshape_and_cache(key[:, :1], key[:, :1], cache, cache.clone(), torch.zeros(3, dtype=torch.long, device=DEVICE))


# ---- copy_blocks ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mapping_device", ["cpu", DEVICE])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_shape", [(16, 2, 8), (5, 1, 3)])  # (5, 1, 3): not whole 16-byte vectors
def test_copy_blocks(mapping_device, dtype, block_shape):
    g = torch.Generator().manual_seed(4)
    shape = (32, *block_shape)
    key_cache = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
    value_cache = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
    blocks = torch.randperm(32, generator=g)
    mapping = torch.stack([blocks[:10], blocks[10:20]], dim=1)  # no dst is another pair's src
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    reference.copy_blocks(expected_k, expected_v, mapping)
    OPS.copy_blocks(key_cache, value_cache, mapping.to(mapping_device))
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)


def test_copy_blocks_rejects_out_of_range_cpu_mapping():
    cache = torch.zeros(4, 8, 2, 64, device=DEVICE)
    with pytest.raises(RuntimeError, match="outside"):
        OPS.copy_blocks(cache, cache.clone(), torch.tensor([[0, 4]]))


# ---- swap_blocks ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "src_device,dst_device,pinned",
    [(DEVICE, "cpu", True), ("cpu", DEVICE, True), ("cpu", DEVICE, False), (DEVICE, "cpu", False),
     (DEVICE, DEVICE, False)],
)
def test_swap_blocks(src_device, dst_device, pinned):
    # torch.ops.pagedgen.swap_blocks itself, not the pagedgen.ops wrapper: with one CPU and one CUDA
    # tensor the dispatcher must pick the CUDA kernel (CUDA outranks CPU), in both directions
    g = torch.Generator().manual_seed(5)
    src = torch.randn(24, 16, 2, 64, generator=g).to(torch.bfloat16)
    dst = torch.randn(20, 16, 2, 64, generator=g).to(torch.bfloat16)
    src = src.pin_memory() if (pinned and src_device == "cpu") else src.to(src_device)
    dst = dst.pin_memory() if (pinned and dst_device == "cpu") else dst.to(dst_device)
    mapping = torch.tensor([[3, 7], [4, 8], [5, 9], [0, 0], [23, 19], [10, 2]])  # a run of three, then singles
    expected = dst.cpu().clone()
    reference.swap_blocks(src.cpu(), expected, mapping)
    OPS.swap_blocks(src, dst, mapping)
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), expected)


def test_swap_blocks_through_wrapper_and_checks():
    src = torch.randn(4, 16, 2, 64, device=DEVICE)
    dst = torch.zeros(4, 16, 2, 64).pin_memory()
    ops.swap_blocks(src, dst, torch.tensor([[1, 2]]))
    torch.cuda.synchronize()
    assert torch.equal(dst[2], src[1].cpu()) and not dst[1].any()
    with pytest.raises(RuntimeError, match="outside"):
        OPS.swap_blocks(src, dst, torch.tensor([[4, 0]]))
    with pytest.raises(RuntimeError, match="block shape"):
        OPS.swap_blocks(src, torch.zeros(4, 8, 2, 64), torch.tensor([[0, 0]]))


# ---- opcheck ---------------------------------------------------------------------------------------


def _opcheck_cases():
    kc, vc, bt, sl = paged_batch([3, 40, 300], 16, 2, 64, torch.float16)
    kc, vc = torch.nan_to_num(kc), torch.nan_to_num(vc)  # opcheck compares runs: no NaN
    q = random_query(3, 4, 64, torch.float16)
    key = torch.randn(5, 2, 64, dtype=torch.float16, device=DEVICE)
    slots = torch.tensor([0, 17, -1, 40, 3], device=DEVICE)
    mapping = torch.tensor([[1, 5], [2, 6]])
    return {
        "paged_attention": (torch.empty_like(q), q, kc, vc, bt, sl, 0.125),
        "reshape_and_cache": (key, key.clone(), kc.clone(), vc.clone(), slots),
        "copy_blocks": (kc.clone(), vc.clone(), mapping),
        "swap_blocks_out": (kc, torch.zeros(kc.shape, dtype=kc.dtype).pin_memory(), mapping),
        "swap_blocks_in": (torch.randn(kc.shape).to(kc.dtype), kc.clone(), mapping),
    }


@pytest.mark.parametrize("case", ["paged_attention", "reshape_and_cache", "copy_blocks", "swap_blocks_out", "swap_blocks_in"])
def test_opcheck(case):
    args = _opcheck_cases()[case]
    op = getattr(OPS, case.removesuffix("_out").removesuffix("_in"))
    torch.library.opcheck(op.default, args)
