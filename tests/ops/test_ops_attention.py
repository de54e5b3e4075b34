"""The CPU kernel of the varlen paged_attention op against the PyTorch reference (pagedgen/ops/
reference.py, the oracle): decode rows, prefill chunks from position 0, chunks that start mid-block
after a cached prefix, mixed in one call; GQA ratios 1-8; head sizes 8/16 (the small-head path on
AVX-512 and AVX2 + FMA builds, else the general one) and 32-256 and run-time sizes; sliding windows;
both paths.

Tolerances: kernel and reference both compute in float32 from the same inputs and differ only in
summation order and the kernel's polynomial exp (~1e-7 relative), so float32 must agree to 1e-5. In
bf16/fp16 that float32 result is then rounded to the output dtype, where the two can land one unit in
the last place apart (2^-8 relative for bf16, 2^-11 for fp16); the tolerances allow two such units.

Poisoning makes the comparisons strict: every cache slot the call must not read (past a sequence's
length, before its window) is NaN, and block-table entries it must not read (padding, blocks wholly
before a window: returned to the pool) name a block outside the cache, which the kernel rejects.
"""

import pytest
import torch

from attention_batches import UNUSED_BLOCK, attention_args, single_thread, varlen_batch
from pagedgen import ops
from pagedgen.ops import reference

pytestmark = pytest.mark.skipif(
    not ops.extension_available("cpu"), reason=f"pagedgen._C CPU kernels unavailable: {ops.extension_error('cpu')}"
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2),
    torch.float16: dict(atol=1e-3, rtol=2e-3),
}


def run_kernel(batch, scale, window=0):
    out = torch.full_like(batch["query"], float("nan"))  # every element must be written
    torch.ops.pagedgen.paged_attention(*attention_args(batch, out, scale, window))
    return out


def run_reference(batch, scale, window=0):
    out = torch.full_like(batch["query"], float("nan"))
    with single_thread():
        reference.paged_attention(*attention_args(batch, out, scale, window))
    return out


def check(specs, num_heads, num_kv_heads, head_size, block_size, dtype, *, window=0, seed=0):
    batch = varlen_batch(specs, num_heads, num_kv_heads, head_size, block_size, dtype, window=window, seed=seed)
    scale = head_size**-0.5
    out = run_kernel(batch, scale, window)
    expected = run_reference(batch, scale, window)
    torch.testing.assert_close(out.float(), expected.float(), **TOL[dtype])
    return out


# A mixed step: decode rows (short and across blocks), a whole prompt, a chunk starting mid-block after
# a cached prefix, a one-token context, a chunk ending on a block boundary.
def mixed_specs(block_size):
    return [(1, 1), (block_size + 1, 1), (37, 37), (100, 29), (3 * block_size, block_size + 2), (260, 1), (61, 60)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [8, 64, 128])
@pytest.mark.parametrize("gqa", [1, 2, 4, 8])
def test_varlen_grid(gqa, head_size, dtype):
    check(mixed_specs(16), 2 * gqa, 2, head_size, 16, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 5, 8, 32])
@pytest.mark.parametrize("head_size", [8, 64])
def test_varlen_block_sizes(block_size, head_size, dtype):
    check(mixed_specs(block_size), 6, 2, head_size, block_size, dtype, seed=block_size)


# Head sizes off the compiled list (20, 96: run-time loops) and the other compiled ones (16, 32, 256).
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_size, block_size", [(16, 16), (20, 5), (32, 1), (96, 16), (256, 7)])
def test_varlen_other_head_sizes(head_size, block_size, dtype):
    check([(1, 1), (13, 13), (70, 30), (200, 1)], 4, 2, head_size, block_size, dtype)


# Long contexts: decode over 1,000 tokens, a 300-token chunk after a 700-token prefix, a whole prompt.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gqa, head_size, block_size", [(2, 8, 16), (4, 64, 32), (1, 128, 8), (8, 16, 16)])
def test_varlen_long(gqa, head_size, block_size, dtype):
    check([(1000, 1), (1000, 300), (517, 517), (999, 1)], 2 * gqa, 2, head_size, block_size, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [1, 7, 16, 40, 1000])
@pytest.mark.parametrize("head_size, block_size", [(8, 16), (64, 16), (128, 5)])
def test_sliding_window(window, head_size, block_size, dtype):
    """Rows attend over (p - window, p]; blocks wholly before a sequence's window are never read."""
    specs = [(1, 1), (50, 1), (300, 1), (120, 120), (200, 77), (33, 2)]
    check(specs, 4, 2, head_size, block_size, dtype, window=window, seed=window)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size, block_size", [(64, 16), (80, 5)])
@pytest.mark.parametrize("window", [0, 40])
def test_many_decode_rows(window, head_size, block_size, dtype):
    """Enough decode rows that an item holds all KV heads of its row and, while it ends, prefetches the
    first tiles of the next row (attention_general.h): lengths around the 32-token tiles, poisoned
    slots and block tables, a window whose first block is returned to the pool."""
    lens = [1, 2, 31, 32, 33, 63, 64, 65, 96, 97, 150, 7] * 3
    specs = [(n, 1) for n in lens]
    two = check(specs, 8, 4, head_size, block_size, dtype, window=window, seed=window + head_size)
    with single_thread():  # one thread runs chunks of several consecutive rows: the next-row prefetch
        one = check(specs, 8, 4, head_size, block_size, dtype, window=window, seed=window + head_size)
    assert torch.equal(one, two)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_size, window",
    [(9, 3, 64, 0), (9, 3, 64, 40), (8, 4, 8, 0), (32, 4, 64, 24), (4, 2, 128, 0), (6, 2, 16, 40), (4, 1, 20, 0)],
)
def test_verify_blocks(num_heads, num_kv_heads, head_size, window, dtype):
    """Speculative verify steps: each sequence's last k + 1 rows (k = 1 .. 8) at the end of its context,
    the short multi-row blocks that stream K/V like decode rows (streamed_block, attention_general.h),
    contexts around the 32-token tiles and the small-head path's 256-token ones, among decode rows;
    on two threads and on one."""
    lens = [2, 9, 31, 33, 64, 70, 97, 130, 200, 257, 263, 300]
    specs = [(n, min(n, 2 + i % 8)) for i, n in enumerate(lens)] + [(150, 1), (40, 1)]
    seed = head_size + window
    two = check(specs, num_heads, num_kv_heads, head_size, 16, dtype, window=window, seed=seed)
    with single_thread():
        one = check(specs, num_heads, num_kv_heads, head_size, 16, dtype, window=window, seed=seed)
    assert torch.equal(one, two)


def test_sliding_window_matches_transformers_mask():
    """The window's boundary is transformers' own: sliding_window_overlay(w) keeps kv_idx > q_idx - w."""
    from transformers.masking_utils import sliding_window_overlay

    window, n = 5, 12
    keep = sliding_window_overlay(window)
    batch = varlen_batch([(n, n)], 1, 1, 16, 4, torch.float32)
    batch["value_cache"] = torch.zeros_like(batch["value_cache"])
    # V = one-hot of the position: row p's output is its attention distribution over positions
    for t in range(n):
        batch["value_cache"][int(batch["block_tables"][0, t // 4]), t % 4, 0, t] = 1.0
    out = run_kernel(batch, 0.1, window)[:, 0, :n]  # [n rows, n positions]
    for p in range(n):
        attended = {t for t in range(n) if out[p, t] > 0}
        assert attended == {t for t in range(p + 1) if keep(0, 0, p, t)}, p


# The small-head path (head sizes 8 and 16 on AVX-512 and AVX2 + FMA): items of one column tile of KV
# heads (few rows) or all KV heads (many rows); an odd KV head count (on AVX-512, a half-width last
# column tile at head size 8); group sizes with and without a compiled accumulator; block sizes that
# do (16, 32) and do not (8, 5) hold whole 16-token runs; contexts and chunks across the 256-token
# softmax tile.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [5, 16, 32])
@pytest.mark.parametrize("head_size", [8, 16])
@pytest.mark.parametrize("num_kv_heads, gqa", [(1, 8), (3, 1), (3, 3), (4, 2), (5, 4)])
def test_small_heads(num_kv_heads, gqa, head_size, block_size, dtype):
    specs = [(1, 1), (15, 15), (17, 1), (255, 1), (256, 256), (600, 345), (257, 1)] + [(1 + 37 * i, 1) for i in range(12)]
    check(specs, num_kv_heads * gqa, num_kv_heads, head_size, block_size, dtype, seed=block_size)


# The general path for the head sizes the small-head path takes on AVX-512 / AVX2 builds (selected with
# PAGEDGEN_CPU_ATTENTION=general, which the kernel reads at each call), so that both are covered.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size, block_size, num_kv_heads", [(8, 16, 4), (8, 5, 3), (16, 8, 2)])
def test_general_path_small_heads(head_size, block_size, num_kv_heads, dtype, monkeypatch):
    monkeypatch.setenv("PAGEDGEN_CPU_ATTENTION", "general")
    check([(1, 1), (16, 16), (33, 20), (300, 1), (700, 90)], 2 * num_kv_heads, num_kv_heads, head_size, block_size, dtype)
    check([(40, 40), (300, 1)], 2 * num_kv_heads, num_kv_heads, head_size, block_size, dtype, window=9)


def test_32k_context():
    check([(32768, 1), (40, 1), (32768, 3)], 4, 2, 64, 16, torch.float32)


def test_empty_sequences_and_padding_rows():
    """Sequences with no new tokens take no rows; rows at a negative position (seq_len < q_len, such as
    CUDA-graph padding with seq_len 0) are zeros."""
    base = varlen_batch([(20, 3), (5, 5), (9, 1)], 4, 2, 8, 16, torch.float32)
    tables = base["block_tables"]
    pad = torch.full_like(tables[:1], UNUSED_BLOCK)
    batch = dict(
        base,
        # rows: 2 of a padding sequence, 3 of seq A, 5 of B, 1 of C, 4 of B again with a 2-token context
        query=torch.cat([torch.randn(2, 4, 8), base["query"], torch.randn(4, 4, 8)]),
        block_tables=torch.cat([pad, tables[0:1], pad, tables[1:2], tables[2:3], pad, tables[1:2]]),
        seq_lens=torch.tensor([0, 20, 0, 5, 9, 0, 2], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 2, 5, 5, 10, 11, 11, 15], dtype=torch.int32),
    )
    out = run_kernel(batch, 0.3)
    zeros = torch.zeros(4, 8)
    for row in (0, 1, 11, 12):
        assert torch.equal(out[row], zeros), row
    torch.testing.assert_close(out, run_reference(batch, 0.3), **TOL[torch.float32])


def test_strided_query_and_out():
    """query/out may be views (a slice of a fused qkv tensor, a transposed buffer): strides are honoured."""
    num_heads, num_kv_heads, head_size = 8, 4, 8
    batch = varlen_batch([(1, 1), (17, 17), (100, 36), (250, 1)], num_heads, num_kv_heads, head_size, 16, torch.float32)
    expected = run_reference(batch, 0.3)
    query = batch["query"]
    T = query.shape[0]
    qkv = torch.randn(T, (num_heads + 2 * num_kv_heads) * head_size)
    qkv[:, : num_heads * head_size] = query.reshape(T, -1)
    q_view = qkv[:, : num_heads * head_size].view(T, num_heads, head_size)
    q_transposed = query.transpose(1, 2).contiguous().transpose(1, 2)  # a non-unit last stride
    for q in (q_view, q_transposed):
        buffer = torch.full((num_heads, T, 2 * head_size), float("nan"))
        out = buffer[:, :, ::2].transpose(0, 1)  # [T, num_heads, head_size], strides (2D, T*2D, 2)
        torch.ops.pagedgen.paged_attention(*attention_args({**batch, "query": q}, out, 0.3))
        torch.testing.assert_close(out, expected, **TOL[torch.float32])
        assert buffer[:, :, 1::2].isnan().all(), "wrote outside the out view"


def test_block_table_view_with_zero_row_stride():
    """block_tables is read through its strides: one table expand()ed for several sequences."""
    batch = varlen_batch([(150, 150)], 8, 4, 8, 16, torch.float32)
    query = torch.randn(150, 8, 8)
    multi = dict(batch, query=query, block_tables=batch["block_tables"].expand(3, -1),
                 seq_lens=torch.tensor([150, 100, 60], dtype=torch.int32),
                 query_start_loc=torch.tensor([0, 50, 100, 150], dtype=torch.int32))
    assert multi["block_tables"].stride(0) == 0
    torch.testing.assert_close(run_kernel(multi, 0.35), run_reference(multi, 0.35), **TOL[torch.float32])


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda a: a.update(block_tables=a["block_tables"].long()), "int32"),
        (lambda a: a.update(seq_lens=a["seq_lens"] + 100), "capacity"),
        (lambda a: a["block_tables"].__setitem__((1, 0), 999), "outside the cache"),
        (lambda a: a["block_tables"].__setitem__((1, 0), -1), "outside the cache"),
        (lambda a: a.update(key_cache=a["key_cache"].half()), "one dtype"),
        (lambda a: a.update(query=a["query"][:, :3], out=a["out"][:, :3]), "multiple of num_kv_heads"),
        (lambda a: a.update(out=a["out"][:1]), "must match query"),
        (lambda a: a.update(key_cache=a["key_cache"].transpose(1, 2).contiguous().transpose(1, 2)), "contiguous"),
        (lambda a: a.update(query_start_loc=a["query_start_loc"][:-1]), r"num_seqs \+ 1"),
        (lambda a: a.update(query_start_loc=torch.tensor([0, 5, 3], dtype=torch.int32)), "must run from 0"),
        (lambda a: a.update(query_start_loc=torch.tensor([0, 7, 6], dtype=torch.int32)), "must not decrease"),
        (lambda a: a.update(query_start_loc=a["query_start_loc"].long()), "int32"),
        (lambda a: a.update(sliding_window=-1), "sliding_window"),
    ],
)
def test_rejects_bad_inputs(mutate, message):
    batch = varlen_batch([(5, 5), (20, 1)], 4, 2, 8, 16, torch.float32)
    args = dict(out=torch.empty_like(batch["query"]), **batch, scale=0.3, sliding_window=0)
    mutate(args)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.pagedgen.paged_attention(
            args["out"], args["query"], args["key_cache"], args["value_cache"], args["block_tables"], args["seq_lens"],
            args["query_start_loc"], args["scale"], args["sliding_window"])


def test_reference_fallback_through_ops_matches():
    """pagedgen.ops.paged_attention (the door the model uses) with a window, on the extension."""
    batch = varlen_batch([(30, 30), (64, 1)], 4, 2, 16, 8, torch.float32, window=10)
    out = torch.empty_like(batch["query"])
    ops.paged_attention(*attention_args(batch, out, 0.25, 10))
    torch.testing.assert_close(out, run_reference(batch, 0.25, 10), **TOL[torch.float32])


def opcheck_inputs():
    batch = varlen_batch([(9, 9), (0, 0), (16, 1), (30, 7)], 4, 2, 8, 8, torch.float32)
    batch["key_cache"] = batch["key_cache"].nan_to_num()  # opcheck compares runs: no NaN
    batch["value_cache"] = batch["value_cache"].nan_to_num()
    batch["block_tables"] = batch["block_tables"].clamp(max=batch["key_cache"].shape[0] - 1)
    return batch


@pytest.mark.parametrize("window", [0, 5])
def test_opcheck(window):
    batch = opcheck_inputs()
    torch.library.opcheck(torch.ops.pagedgen.paged_attention.default,
                          attention_args(batch, torch.empty_like(batch["query"]), 0.35, window))


def test_fake_kernel_checks_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    batch = opcheck_inputs()
    args = attention_args(batch, torch.empty_like(batch["query"]), 0.35)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        torch.ops.pagedgen.paged_attention(*fake)
        with pytest.raises(Exception, match="differ"):
            torch.ops.pagedgen.paged_attention(fake[0][:, :2], *fake[1:])
        with pytest.raises(Exception, match="same sequences"):
            torch.ops.pagedgen.paged_attention(*fake[:6], fake[6][:-1], *fake[7:])


def test_engine_on_the_reference_gives_the_kernels_tokens(stories_path, monkeypatch):
    """The engine's steps (chunked prefill after cached prefixes, decode rows, forks) through the
    PyTorch reference, the fallback without the extension, give the kernels' greedy tokens."""
    from pagedgen import LLM, SamplingParams

    prompts = ["Once upon a time", "The little dog ran to the park and saw"]
    params = SamplingParams(temperature=0, max_tokens=8)
    llm = LLM(stories_path, block_size=8, max_num_batched_tokens=6, max_model_len=128)  # prompts in chunks of <= 6
    kernel = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    monkeypatch.setattr(ops, "_impl", lambda name, device_type: getattr(reference, name))
    with single_thread():
        fallback = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert fallback == kernel
