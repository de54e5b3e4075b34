"""Batch invariance of the CPU kernels (issue 13): each op's output rows do not depend on the other rows.

For every op of the model's step: the same row computed alone, in a batch of 7 and in a batch of 300,
at several positions in the batch, gives the same bits. For paged_attention also: a sequence alone or
among other sequences, and a prompt prefilled in one chunk, in chunks of any size, or decoded row by
row (and as the old one-row-per-token layout) gives bitwise the same outputs, with and without a
sliding window, on one thread or two.
"""
import pytest
import torch

from attention_batches import attention_args, varlen_batch
from pagedgen import ops

pytestmark = pytest.mark.skipif(
    not ops.extension_available("cpu"), reason=f"pagedgen._C CPU kernels unavailable: {ops.extension_error('cpu')}"
)

OPS = torch.ops.pagedgen
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BATCHES = [(1, [0]), (7, [0, 3, 6]), (300, [0, 151, 299])]  # batch size, positions of the row in it


def gen(seed):
    return torch.Generator().manual_seed(seed)


def bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same_bits(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(bits(a), bits(b)), what


def in_batches(row, make_others, run):
    """run(batch) -> outputs [n, ...]; row [...] is placed at each position of each batch size, the other
    rows drawn by make_others(n). Returns the row's output from every placement."""
    results = []
    for n, positions in BATCHES:
        for at in positions:
            batch = make_others(n)
            batch[at] = row
            results.append(((n, at), run(batch)[at]))
    return results


# ---- the small per-token layers -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 2048, 37])
def test_rms_norm_rows_independent(hidden, dtype):
    g = gen(hidden)
    weight = torch.randn(hidden, generator=g).to(dtype)
    row = (torch.randn(hidden, generator=g) * 3).to(dtype)

    def run(x):
        out = torch.empty_like(x)
        OPS.rms_norm(out, x, weight, 1e-5)
        return out

    placements = in_batches(row, lambda n: (torch.randn(n, hidden, generator=g) * 5).to(dtype), run)
    for where, out in placements:
        assert_same_bits(out, placements[0][1], where)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 2048])
def test_fused_add_rms_norm_rows_independent(hidden, dtype):
    g = gen(hidden + 1)
    weight = torch.randn(hidden, generator=g).to(dtype)
    x_row, res_row = torch.randn(hidden, generator=g).to(dtype), torch.randn(hidden, generator=g).to(dtype)
    norms, sums = [], []
    for n, positions in BATCHES:
        for at in positions:
            x, res = torch.randn(n, hidden, generator=g).to(dtype), torch.randn(n, hidden, generator=g).to(dtype)
            x[at], res[at] = x_row, res_row
            OPS.fused_add_rms_norm(x, res, weight, 1e-6)
            norms.append(x[at].clone())
            sums.append(res[at].clone())
    for i in range(1, len(norms)):
        assert_same_bits(norms[i], norms[0], i)
        assert_same_bits(sums[i], sums[0], i)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_size", [(9, 3, 64), (32, 4, 64), (8, 4, 8)])
def test_rotary_embedding_rows_independent(num_heads, num_kv_heads, head_size, dtype):
    g = gen(head_size)
    cos, sin = torch.randn(1000, head_size, generator=g), torch.randn(1000, head_size, generator=g)
    width = (num_heads + 2 * num_kv_heads) * head_size
    row, row_pos = torch.randn(width, generator=g).to(dtype), 417
    results = []
    for n, positions in BATCHES:
        for at in positions:
            qkv = torch.randn(n, width, generator=g).to(dtype)
            pos = torch.randint(0, 1000, (n,), generator=g)
            qkv[at], pos[at] = row, row_pos
            q = qkv[:, : num_heads * head_size].view(n, num_heads, head_size)
            k = qkv[:, num_heads * head_size : (num_heads + num_kv_heads) * head_size].view(n, num_kv_heads, head_size)
            OPS.rotary_embedding(pos, q, k, cos, sin)
            results.append(qkv[at].clone())
    for i in range(1, len(results)):
        assert_same_bits(results[i], results[0], i)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1536, 5632, 13])
def test_silu_and_mul_rows_independent(d, dtype):
    g = gen(d)
    row = (torch.randn(2 * d, generator=g) * 4).to(dtype)

    def run(x):
        out = torch.empty(x.shape[0], d, dtype=dtype)
        OPS.silu_and_mul(out, x)
        return out

    placements = in_batches(row, lambda n: (torch.randn(n, 2 * d, generator=g) * 4).to(dtype), run)
    for where, out in placements:
        assert_same_bits(out, placements[0][1], where)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [49152, 32000, 13])
def test_argmax_rows_independent(vocab, dtype):
    """The sampler's greedy argmax: a row's token, ties included, whatever the other rows."""
    g = gen(vocab)
    row = torch.randint(-2, 3, (vocab,), generator=g).to(dtype)  # many tied maxima

    def run(x):
        out = torch.empty(x.shape[0], dtype=torch.int64)
        OPS.argmax(out, x)
        return out

    placements = in_batches(row, lambda n: (torch.randn(n, vocab, generator=g) * 4).to(dtype), run)
    for where, out in placements:
        assert torch.equal(out, placements[0][1]), where


@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache_rows_independent(dtype):
    """A token's cache slot receives the same bits whatever the other tokens of the call."""
    g = gen(5)
    shape = (400, 16, 3, 64)
    row_k, row_v, row_slot = torch.randn(3, 64, generator=g).to(dtype), torch.randn(3, 64, generator=g).to(dtype), 77
    for n, positions in BATCHES:
        for at in positions:
            kc, vc = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
            key, value = torch.randn(n, 3, 64, generator=g).to(dtype), torch.randn(n, 3, 64, generator=g).to(dtype)
            slots = torch.randperm(400 * 16 - 1, generator=g)[:n]
            slots[slots >= row_slot] += 1  # distinct slots, none of them the row's
            key[at], value[at], slots[at] = row_k, row_v, row_slot
            OPS.reshape_and_cache(key, value, kc, vc, slots)
            assert_same_bits(kc.view(-1, 3, 64)[row_slot], row_k, (n, at))
            assert_same_bits(vc.view(-1, 3, 64)[row_slot], row_v, (n, at))


# ---- paged_attention -------------------------------------------------------------------------------

ATTENTION_CASES = [  # dtype, num_heads, num_kv_heads, head_size, block_size, window
    (torch.float32, 8, 4, 8, 16, 0),     # stories260K's shape
    (torch.bfloat16, 9, 3, 64, 16, 0),   # the 135M SmolLM shape
    (torch.float32, 32, 4, 64, 16, 24),  # TinyLlama's shape, a sliding window
    (torch.float16, 4, 4, 128, 5, 0),
    (torch.bfloat16, 6, 2, 16, 8, 40),
    (torch.float32, 4, 1, 20, 16, 0),    # a run-time head size
    (torch.bfloat16, 32, 2, 128, 16, 24),  # 16 query heads per KV head (bf16 scores of many pairs), a window
]


def prompt_cache(n, num_heads, num_kv_heads, head_size, block_size, dtype, seed=0):
    """One prompt of n tokens, all of them in the cache, and its query rows [n, H, D]."""
    return varlen_batch([(n, n)], num_heads, num_kv_heads, head_size, block_size, dtype, seed=seed)


def attend_chunks(batch, chunks, scale, window):
    """The prompt's rows computed chunk after chunk (each chunk one call, after the earlier ones)."""
    outs, start = [], 0
    for size in chunks:
        end = start + size
        part = dict(batch, query=batch["query"][start:end], seq_lens=torch.tensor([end], dtype=torch.int32),
                    query_start_loc=torch.tensor([0, size], dtype=torch.int32))
        out = torch.empty_like(part["query"])
        OPS.paged_attention(*attention_args(part, out, scale, window))
        outs.append(out)
        start = end
    return torch.cat(outs)


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: f"{c[0]}-h{c[1]}-kv{c[2]}-d{c[3]}-bs{c[4]}-w{c[5]}")
def test_prefill_chunking_and_decode_give_the_same_bits(case):
    dtype, H, Hkv, D, bs, window = case
    n = 300  # across the 256-token tile of the small-head path
    batch = prompt_cache(n, H, Hkv, D, bs, dtype)
    scale = D**-0.5
    whole = attend_chunks(batch, [n], scale, window)
    for chunks in ([1] * n, [17, 100, 183], [bs + 1, 2 * bs - 1, n - 3 * bs], [255, 45], [n - 1, 1]):
        assert_same_bits(attend_chunks(batch, chunks, scale, window), whole, chunks[:4])
    # every row as its own one-token sequence of one call (the layout of one row per prompt token)
    rows = dict(batch, block_tables=batch["block_tables"].expand(n, -1),
                seq_lens=torch.arange(1, n + 1, dtype=torch.int32), query_start_loc=torch.arange(n + 1, dtype=torch.int32))
    out = torch.empty_like(batch["query"])
    OPS.paged_attention(*attention_args(rows, out, scale, window))
    assert_same_bits(out, whole, "one row per token")


def attend_as_decode_rows(batch, n, scale, window):
    """Every row of the prompt as a decode row: its own one-token sequence of one call."""
    rows = dict(batch, block_tables=batch["block_tables"].expand(n, -1),
                seq_lens=torch.arange(1, n + 1, dtype=torch.int32), query_start_loc=torch.arange(n + 1, dtype=torch.int32))
    out = torch.empty_like(batch["query"])
    OPS.paged_attention(*attention_args(rows, out, scale, window))
    return out


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: f"{c[0]}-h{c[1]}-kv{c[2]}-d{c[3]}-bs{c[4]}-w{c[5]}")
def test_verify_blocks_give_the_decode_rows_bits(case):
    """Speculative verify: the last k + 1 rows (k = 1 .. 8) of several sequences, one short multi-row
    block each (streamed like decode rows, attention_general.h), in one call, on one thread or two:
    bitwise the rows computed one at a time as decode rows."""
    dtype, H, Hkv, D, bs, window = case
    n = 300
    batch = prompt_cache(n, H, Hkv, D, bs, dtype)
    scale = D**-0.5
    decode = attend_as_decode_rows(batch, n, scale, window)
    threads = torch.get_num_threads()
    try:
        for rows in range(2, 10):
            # the same prompt cut at several contexts (around the 32- and 256-token tiles): sequences
            # of `rows` new tokens each, sharing the prompt's block table
            ends = [rows + 1, 33, 64 + rows, 100, 255, 256 + rows, n]
            verify = dict(batch, block_tables=batch["block_tables"].expand(len(ends), -1),
                          seq_lens=torch.tensor(ends, dtype=torch.int32),
                          query_start_loc=torch.arange(len(ends) + 1, dtype=torch.int32) * rows,
                          query=torch.cat([batch["query"][e - rows : e] for e in ends]))
            expected = torch.cat([decode[e - rows : e] for e in ends])
            for t in (1, 2):
                torch.set_num_threads(t)
                out = torch.empty_like(verify["query"])
                OPS.paged_attention(*attention_args(verify, out, scale, window))
                assert_same_bits(out, expected, (rows, t))
    finally:
        torch.set_num_threads(threads)


def other_sequences(count, seed):
    """count companions: decode rows and some prefill chunks, longer ones in small batches."""
    g = gen(seed)
    lens = torch.randint(1, 400 if count < 10 else 60, (count,), generator=g).tolist()
    q_lens = [1 if i % 5 else min(n, 1 + i % 37) for i, n in enumerate(lens)]
    return list(zip(lens, q_lens))


def attend_with_others(target, H, Hkv, D, bs, dtype, window, count, at, seed):
    """The target sequence (seq_len, q_len) at index `at` among `count` other sequences; its rows' output."""
    specs = other_sequences(count, seed)
    specs.insert(at, target)
    batch = varlen_batch(specs, H, Hkv, D, bs, dtype, window=window, seed=seed)
    # the target's own cache content and queries, whatever the companions: copy them in
    alone = varlen_batch([target], H, Hkv, D, bs, dtype, window=window, seed=99)
    nb = alone["block_tables"].shape[1] - 1
    for b in range(nb):
        src, dst = int(alone["block_tables"][0, b]), int(batch["block_tables"][at, b])
        if src < (1 << 30):
            batch["key_cache"][dst] = alone["key_cache"][src]
            batch["value_cache"][dst] = alone["value_cache"][src]
    first = int(batch["query_start_loc"][at])
    batch["query"][first : first + target[1]] = alone["query"]
    out = torch.empty_like(batch["query"])
    OPS.paged_attention(*attention_args(batch, out, D**-0.5, window))
    return out[first : first + target[1]]


@pytest.mark.parametrize("case", ATTENTION_CASES[:5], ids=lambda c: f"{c[0]}-h{c[1]}-kv{c[2]}-d{c[3]}-bs{c[4]}-w{c[5]}")
@pytest.mark.parametrize("target", [(233, 1), (180, 61)], ids=["decode", "chunk"])
def test_sequence_alone_or_among_others_gives_the_same_bits(case, target):
    dtype, H, Hkv, D, bs, window = case
    alone = attend_with_others(target, H, Hkv, D, bs, dtype, window, 0, 0, seed=1)
    for count, positions in ((6, [0, 3, 6]), (299, [0, 150, 299])):
        for at in positions:
            got = attend_with_others(target, H, Hkv, D, bs, dtype, window, count, at, seed=count + at)
            assert_same_bits(got, alone, (count + 1, at))


def test_one_or_two_threads_give_the_same_bits():
    specs = [(3, 3), (500, 1), (40, 17), (1000, 300), (77, 1), (12, 12), (260, 1), (9, 1)]
    for D in (8, 64):
        batch = varlen_batch(specs, 8, 4, D, 16, torch.bfloat16)
        outs = []
        threads = torch.get_num_threads()
        try:
            for n in (1, 2):
                torch.set_num_threads(n)
                out = torch.empty_like(batch["query"])
                OPS.paged_attention(*attention_args(batch, out, 0.125, 0))
                outs.append(out)
        finally:
            torch.set_num_threads(threads)
        assert_same_bits(outs[0], outs[1], D)
