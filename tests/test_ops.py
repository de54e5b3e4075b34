"""CPU kernels of pagedgen._C against the plain PyTorch references in pagedgen/ops/reference.py (the
oracle), plus torch.library.opcheck of every op.

Tolerances of paged_attention (the cache ops copy, so they must match exactly): kernel and reference
both compute in float32 from the same inputs and differ only in summation order and the kernel's
polynomial exp (~1e-7 relative), so float32 must agree to 1e-5. In bf16/fp16 that float32 result is
then rounded to the output dtype, where the two can land one unit in the last place apart (up to
2^-7 relative for bf16, 2^-10 for fp16); the tolerances below allow about two such units.
"""
import contextlib

import pytest
import torch

from pagedgen import ops
from pagedgen.ops import reference

pytestmark = pytest.mark.skipif(
    not ops.extension_available("cpu"),
    reason=f"pagedgen._C CPU kernels unavailable: {ops.extension_error('cpu')}",
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2),
    torch.float16: dict(atol=1e-3, rtol=2e-3),
}
UNUSED_BLOCK = 1 << 30  # block-table entries past a sequence's length: must never be read


@contextlib.contextmanager
def single_thread():
    """Runs the reference ops on one thread: their many tiny ATen calls only pay for a thread team
    (and wait for a second core on a busy machine). The kernels keep the default thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_paged(seq_lens, num_heads, num_kv_heads, head_size, block_size, dtype, seed=0):
    """A random batch over a shuffled cache: each sequence owns random, non-contiguous physical blocks."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [cdiv(n, block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # a few blocks nobody uses
    shape = (num_blocks, block_size, num_kv_heads, head_size)  # [num_blocks, block_size, num_kv_heads, head_size]
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    # block_tables: [num_seqs, max_blocks], one spare column so that some entries are always unused
    block_tables = torch.full((len(seq_lens), max(blocks_per_seq + [0]) + 1), UNUSED_BLOCK, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = perm[used : used + n]
        used += n
    # query: [num_seqs, num_heads, head_size]
    query = torch.randn(len(seq_lens), num_heads, head_size, generator=gen).to(dtype)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32)  # [num_seqs]
    return query, key_cache, value_cache, block_tables, seq_lens


def check_attention(seq_lens, num_heads, num_kv_heads, head_size, block_size, dtype, seed=0):
    query, key_cache, value_cache, block_tables, lens = make_paged(
        seq_lens, num_heads, num_kv_heads, head_size, block_size, dtype, seed
    )
    scale = head_size**-0.5
    out = torch.full_like(query, float("nan"))  # every element must be written
    torch.ops.pagedgen.paged_attention(out, query, key_cache, value_cache, block_tables, lens, scale)
    expected = torch.empty_like(query)
    with single_thread():
        reference.paged_attention(expected, query, key_cache, value_cache, block_tables, lens, scale)
    torch.testing.assert_close(out.float(), expected.float(), **TOL[dtype])


# ---------------------------------------------------------------------------------------------------
# paged_attention

# Short contexts, full grid: lengths around the block size (1, bs - 1, bs, bs + 1) and a few others.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_size", [8, 64, 128])
@pytest.mark.parametrize("gqa", [1, 2, 4, 8])
def test_paged_attention_grid(gqa, head_size, block_size, dtype):
    lens = [1, block_size - 1, block_size, block_size + 1, 37, 100]
    check_attention(lens, 2 * gqa, 2, head_size, block_size, dtype)


# Long contexts (up to 1,000 tokens, mixed lengths in one batch, non-multiples of the block size).
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "gqa, head_size, block_size, seq_lens",
    [
        (2, 8, 16, [1000, 999, 517, 3]),
        (4, 64, 32, [1000, 333]),
        (1, 128, 8, [1000, 64]),
        (8, 8, 16, [801, 1]),
    ],
)
def test_paged_attention_long(gqa, head_size, block_size, seq_lens, dtype):
    check_attention(seq_lens, 2 * gqa, 2, head_size, block_size, dtype)


# The default model's shapes: 8 query heads, 4 KV heads, head_dim 8.
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_default_model(dtype):
    check_attention([5, 128, 300, 1000, 17, 2], 8, 4, 8, 16, dtype)


# Head sizes off the compiled list (20, 96: run-time loops) and the other compiled ones (16, 32, 256);
# odd block sizes.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_size, block_size", [(16, 16), (20, 5), (32, 1), (96, 16), (256, 7)])
def test_paged_attention_other_sizes(head_size, block_size, dtype):
    check_attention([1, 13, 70, 200], 4, 2, head_size, block_size, dtype)


# The small-head path (head sizes 8 and 16 with AVX-512): items of one column tile of KV heads (few
# rows) or all KV heads (many rows); an odd KV head count (a half-width last column tile at head size
# 8); group sizes with (1, 2, 4, 8) and without (3) a compiled accumulator; block sizes that do (16,
# 32) and do not (8, 5) hold whole 16-token runs; contexts across the 256-token softmax tile.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [5, 8, 16, 32])
@pytest.mark.parametrize("head_size", [8, 16])
@pytest.mark.parametrize("num_kv_heads, gqa", [(1, 8), (3, 1), (3, 3), (4, 2), (5, 4)])
@pytest.mark.parametrize("num_seqs", [3, 40])
def test_paged_attention_small_heads(num_seqs, num_kv_heads, gqa, head_size, block_size, dtype):
    lens = [1, 15, 16, 17, 255, 256, 257, 600][:num_seqs] + [1 + (37 * i) % 300 for i in range(max(0, num_seqs - 8))]
    check_attention(lens, num_kv_heads * gqa, num_kv_heads, head_size, block_size, dtype, seed=num_seqs)


# The general path for the head sizes the small-head path takes on AVX-512 builds (selected with
# PAGEDGEN_CPU_ATTENTION=general, which the kernel reads at each call), so that both are covered.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size, block_size, num_kv_heads", [(8, 16, 4), (8, 5, 3), (16, 8, 2)])
def test_paged_attention_general_path_small_heads(head_size, block_size, num_kv_heads, dtype, monkeypatch):
    monkeypatch.setenv("PAGEDGEN_CPU_ATTENTION", "general")
    check_attention([1, 16, 33, 300, 0, 700], 2 * num_kv_heads, num_kv_heads, head_size, block_size, dtype)


def test_paged_attention_32k_context():
    check_attention([32768, 40], 4, 2, 64, 16, torch.float32)


def test_paged_attention_zero_length_rows_are_zero():
    query, key_cache, value_cache, block_tables, lens = make_paged([0, 20, 0], 4, 2, 8, 16, torch.float32)
    out = torch.full_like(query, float("nan"))
    torch.ops.pagedgen.paged_attention(out, query, key_cache, value_cache, block_tables, lens, 0.3)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(out[2], torch.zeros_like(out[2]))
    expected = torch.empty_like(query)
    with single_thread():
        reference.paged_attention(expected, query, key_cache, value_cache, block_tables, lens, 0.3)
    torch.testing.assert_close(out, expected, **TOL[torch.float32])


def test_paged_attention_strided_query_and_out():
    """query/out may be views (a slice of a fused qkv tensor, a transposed buffer): strides are honoured."""
    num_seqs, num_heads, num_kv_heads, head_size = 5, 8, 4, 8
    query, key_cache, value_cache, block_tables, lens = make_paged(
        [1, 17, 64, 100, 250], num_heads, num_kv_heads, head_size, 16, torch.float32
    )
    expected = torch.empty_like(query)
    with single_thread():
        reference.paged_attention(expected, query, key_cache, value_cache, block_tables, lens, 0.3)
    # query: the first num_heads * head_size columns of a [num_seqs, (num_heads + 2 * num_kv_heads) * head_size] qkv
    qkv = torch.randn(num_seqs, (num_heads + 2 * num_kv_heads) * head_size)
    qkv[:, : num_heads * head_size] = query.reshape(num_seqs, -1)
    q_view = qkv[:, : num_heads * head_size].view(num_seqs, num_heads, head_size)
    # query with a non-unit last stride; out as a transposed [num_heads, num_seqs, head_size] buffer
    q_transposed = query.transpose(1, 2).contiguous().transpose(1, 2)
    for q in (q_view, q_transposed):
        buffer = torch.full((num_heads, num_seqs, 2 * head_size), float("nan"))
        out = buffer[:, :, ::2].transpose(0, 1)  # [num_seqs, num_heads, head_size], strides (2D, S*2D, 2)
        torch.ops.pagedgen.paged_attention(out, q, key_cache, value_cache, block_tables, lens, 0.3)
        torch.testing.assert_close(out, expected, **TOL[torch.float32])
        assert buffer[:, :, 1::2].isnan().all(), "wrote outside the out view"


def test_paged_attention_prefill_rows_with_expanded_table():
    """Prefill as the engine runs it: one row per prompt token (seq_len = position + 1), for a few
    prompts of mixed lengths. A prompt's rows share its block table: through a stride-0 expand()
    for one prompt, as a materialised copy for the whole batch."""
    prompts = [150, 7, 61]
    _, key_cache, value_cache, tables, _ = make_paged(prompts, 8, 4, 8, 16, torch.float32)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(sum(prompts), 8, 8, generator=gen)  # [num_tokens, num_heads, head_size]
    lens = torch.cat([torch.arange(1, n + 1, dtype=torch.int32) for n in prompts])  # [num_tokens]
    rows_table = torch.cat([tables[i : i + 1].expand(n, -1) for i, n in enumerate(prompts)])  # [num_tokens, max_blocks]
    expected = torch.empty_like(q)
    with single_thread():
        reference.paged_attention(expected, q, key_cache, value_cache, rows_table, lens, 0.35)
    out = torch.full_like(q, float("nan"))
    torch.ops.pagedgen.paged_attention(out, q, key_cache, value_cache, rows_table, lens, 0.35)
    torch.testing.assert_close(out, expected, **TOL[torch.float32])
    first = tables[0:1].expand(prompts[0], -1)  # stride 0 along the rows
    assert first.stride(0) == 0
    n = prompts[0]
    out_first = torch.full_like(q[:n], float("nan"))
    torch.ops.pagedgen.paged_attention(out_first, q[:n], key_cache, value_cache, first, lens[:n], 0.35)
    torch.testing.assert_close(out_first, expected[:n], **TOL[torch.float32])


def test_paged_attention_same_result_with_one_or_two_threads():
    args = make_paged([3, 500, 40, 1000, 77, 12, 260, 9], 8, 4, 64, 16, torch.bfloat16)
    outs = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = torch.empty_like(args[0])
            torch.ops.pagedgen.paged_attention(out, *args, 0.125)
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda a: a.update(block_tables=a["block_tables"].long()), "int32"),
        (lambda a: a.update(seq_lens=a["seq_lens"] + 100), "exceeds"),
        (lambda a: a["block_tables"].__setitem__((1, 0), 999), "outside the cache"),
        (lambda a: a["block_tables"].__setitem__((1, 0), -1), "outside the cache"),
        (lambda a: a.update(key_cache=a["key_cache"].half()), "one dtype"),
        (lambda a: a.update(query=a["query"][:, :3], out=a["out"][:, :3]), "multiple of num_kv_heads"),
        (lambda a: a.update(out=a["out"][:1]), "must match query"),
        (lambda a: a.update(key_cache=a["key_cache"].transpose(1, 2).contiguous().transpose(1, 2)), "contiguous"),
    ],
)
def test_paged_attention_rejects_bad_inputs(mutate, message):
    query, key_cache, value_cache, block_tables, lens = make_paged([5, 20], 4, 2, 8, 16, torch.float32)
    args = dict(
        out=torch.empty_like(query), query=query, key_cache=key_cache, value_cache=value_cache,
        block_tables=block_tables, seq_lens=lens,
    )  # fmt: skip
    mutate(args)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.pagedgen.paged_attention(*args.values(), 0.3)


# ---------------------------------------------------------------------------------------------------
# reshape_and_cache, copy_blocks, swap_blocks


def random_slots(num_tokens, num_slots, num_padding, gen):
    """Distinct random slots for num_tokens tokens, num_padding of them -1 (padding)."""
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen)[:num_padding]] = -1
    return slots  # [num_tokens] int64


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size, num_kv_heads, head_size", [(8, 2, 8), (16, 4, 64), (32, 1, 128)])
def test_reshape_and_cache(block_size, num_kv_heads, head_size, dtype):
    gen = torch.Generator().manual_seed(1)
    num_blocks, num_tokens = 10, 50
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache, value_cache = torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)
    key = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(dtype)
    slots = random_slots(num_tokens, num_blocks * block_size, 7, gen)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    with single_thread():
        reference.reshape_and_cache(key, value, expected_k, expected_v, slots)
    before_k = key_cache.clone()
    torch.ops.pagedgen.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)
    # Only the valid slots changed: padding tokens (-1) wrote nothing.
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    assert torch.equal(key_cache.flatten(0, 1)[~written], before_k.flatten(0, 1)[~written])
    assert torch.equal(key_cache.flatten(0, 1)[slots[slots >= 0]], key[slots >= 0])


def test_reshape_and_cache_strided_and_converted_inputs():
    """key/value as slices of a fused qkv tensor, in float32 going into a bfloat16 cache."""
    gen = torch.Generator().manual_seed(2)
    num_tokens, num_heads, num_kv_heads, head_size, block_size = 20, 8, 4, 8, 16
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, generator=gen)
    key = qkv[:, num_heads * head_size :][:, : num_kv_heads * head_size].view(num_tokens, num_kv_heads, head_size)
    value = qkv[:, (num_heads + num_kv_heads) * head_size :].view(num_tokens, num_kv_heads, head_size)
    key_cache = torch.zeros(4, block_size, num_kv_heads, head_size, dtype=torch.bfloat16)
    value_cache = torch.zeros_like(key_cache)
    slots = random_slots(num_tokens, 4 * block_size, 3, gen)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    with single_thread():
        reference.reshape_and_cache(key, value, expected_k, expected_v, slots)
    torch.ops.pagedgen.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)


def test_reshape_and_cache_rejects_bad_inputs():
    key = torch.randn(3, 2, 8)
    cache = torch.zeros(2, 4, 2, 8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.pagedgen.reshape_and_cache(key, key, cache, cache.clone(), torch.tensor([0, 8, 1]))
    with pytest.raises(RuntimeError, match="int64"):
        torch.ops.pagedgen.reshape_and_cache(key, key, cache, cache.clone(), torch.tensor([0, 1, 2], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="num_kv_heads"):
        torch.ops.pagedgen.reshape_and_cache(key[:, :1], key[:, :1], cache, cache.clone(), torch.tensor([0, 1, 2]))


def random_pairs(num_src, num_dst, num_pairs, gen, disjoint=False):
    """[num_pairs, 2] int64 (src, dst); destinations distinct, and disjoint from the sources if asked."""
    perm = torch.randperm(num_dst, generator=gen)
    dst = perm[:num_pairs]
    src_pool = perm[num_pairs:] if disjoint else torch.arange(num_src)
    src = src_pool[torch.randint(len(src_pool), (num_pairs,), generator=gen)]
    return torch.stack([src, dst], dim=1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks(dtype):
    gen = torch.Generator().manual_seed(3)
    shape = (12, 16, 4, 8)
    key_cache, value_cache = torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)
    mapping = random_pairs(12, 12, 5, gen, disjoint=True)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    with single_thread():
        reference.copy_blocks(expected_k, expected_v, mapping)
    torch.ops.pagedgen.copy_blocks(key_cache, value_cache, mapping)
    assert not torch.equal(expected_k, key_cache.clone().random_())  # sanity: the comparison can fail
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)
    with pytest.raises(RuntimeError, match="outside"):
        torch.ops.pagedgen.copy_blocks(key_cache, value_cache, torch.tensor([[0, 12]]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_swap_blocks(dtype):
    gen = torch.Generator().manual_seed(4)
    src = torch.randn(10, 8, 2, 64, generator=gen).to(dtype)  # e.g. a device cache
    dst = torch.randn(7, 8, 2, 64, generator=gen).to(dtype)  # e.g. the CPU swap space
    mapping = random_pairs(10, 7, 4, gen)
    expected = dst.clone()
    with single_thread():
        reference.swap_blocks(src, expected, mapping)
    torch.ops.pagedgen.swap_blocks(src, dst, mapping)
    assert torch.equal(dst, expected)
    ops.swap_blocks(dst, src, mapping.flip(1))  # and back, through pagedgen.ops (CPU tensors only)
    assert torch.equal(src[mapping[:, 0]], dst[mapping[:, 1]])
    with pytest.raises(RuntimeError, match="block shape"):
        torch.ops.pagedgen.swap_blocks(src, dst[:, :4], mapping)
    with pytest.raises(RuntimeError, match="outside"):
        torch.ops.pagedgen.swap_blocks(src, dst, torch.tensor([[0, 7]]))


# ---------------------------------------------------------------------------------------------------
# opcheck (schema, fake kernels, autograd registration, AOT dispatch) and the fake kernels' checks


def small_inputs():
    query, key_cache, value_cache, block_tables, lens = make_paged([9, 0, 16], 4, 2, 8, 8, torch.float32)
    key, value = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    slots = torch.tensor([0, 3, -1, 9, 20])
    pairs = torch.tensor([[0, 5], [1, 4]])
    return {
        "reshape_and_cache": (key, value, key_cache.clone(), value_cache.clone(), slots),
        "paged_attention": (torch.empty_like(query), query, key_cache, value_cache, block_tables, lens, 0.35),
        "copy_blocks": (key_cache.clone(), value_cache.clone(), pairs),
        "swap_blocks": (key_cache, torch.zeros(6, *key_cache.shape[1:]), pairs),
    }


@pytest.mark.parametrize("name", ["reshape_and_cache", "paged_attention", "copy_blocks", "swap_blocks"])
def test_opcheck(name):
    torch.library.opcheck(getattr(torch.ops.pagedgen, name).default, small_inputs()[name])


def test_fake_kernels_check_shapes():
    """Under FakeTensorMode the registered fakes run (no data) and reject inconsistent shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    inputs = small_inputs()
    with FakeTensorMode() as mode:
        fake = {
            name: tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
            for name, args in inputs.items()
        }
        for name, args in fake.items():
            getattr(torch.ops.pagedgen, name)(*args)
        out, query, *rest = fake["paged_attention"]
        with pytest.raises(Exception, match="differ"):
            torch.ops.pagedgen.paged_attention(out[:, :2], query, *rest)
        key, value, *rest = fake["reshape_and_cache"]
        with pytest.raises(Exception, match="differ"):
            torch.ops.pagedgen.reshape_and_cache(key, value[:3], *rest)
