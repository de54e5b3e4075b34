"""Builders of varlen paged-attention inputs for the kernel tests (CPU, CUDA, CUDA emulation).

A batch is a list of sequences, each given as ``(seq_len, q_len)``: the sequence has ``seq_len``
tokens in the cache after the step, the last ``q_len`` of which are this step's query rows (a decode
row: q_len 1; a prefill chunk after a cached prefix: seq_len > q_len > 1; a whole prompt: equal).
"""
import contextlib

import torch

UNUSED_BLOCK = 1 << 30  # block-table entry that must never be read (the CPU kernel rejects it)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def window_start(position: int, window: int) -> int:
    """First position a row at ``position`` attends to (transformers' sliding-window mask)."""
    return max(0, position - window + 1) if window > 0 else 0


def varlen_batch(specs, num_heads, num_kv_heads, head_size, block_size, dtype, *, window=0, seed=0, unused=UNUSED_BLOCK,
                 device="cpu"):
    """Random queries and a shuffled paged cache for ``specs`` = [(seq_len, q_len), ...].

    Every slot the batch must not read holds NaN: slots past a sequence's length, slots before the
    window of its first row; block-table entries past a sequence's blocks and of blocks wholly before
    that window are ``unused`` (blocks returned to the pool; with a spare NaN block 0 when ``unused``
    is 0, as the CUDA tests need a readable entry).

    Returns a dict: query [T, H, D]; key_cache, value_cache [num_blocks, block_size, Hkv, D];
    block_tables [S, max_blocks] int32; seq_lens [S] int32; query_start_loc [S + 1] int32.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [cdiv(n, block_size) for n, _ in specs]
    num_blocks = sum(blocks_per_seq) + 4  # block 0 and a few others stay unused (NaN)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0 is never handed out
    # one spare column so that some entries are always padding
    block_tables = torch.full((len(specs), max(blocks_per_seq + [0]) + 1), unused, dtype=torch.int32)
    for s, (seq_len, q_len) in enumerate(specs):
        first = window_start(max(seq_len - q_len, 0), window)  # the first row's window starts first
        for b in range(blocks_per_seq[s]):
            if (b + 1) * block_size <= first:
                continue  # wholly before the window: returned to the pool, never read
            block = perm.pop()
            block_tables[s, b] = block
            lo, hi = max(first - b * block_size, 0), min(block_size, seq_len - b * block_size)
            key_cache[block, lo:hi] = torch.randn(hi - lo, num_kv_heads, head_size, generator=gen).to(dtype)
            value_cache[block, lo:hi] = torch.randn(hi - lo, num_kv_heads, head_size, generator=gen).to(dtype)
    q_lens = [q for _, q in specs]
    query_start_loc = torch.tensor([0] + torch.tensor(q_lens, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)
    query = torch.randn(sum(q_lens), num_heads, head_size, generator=gen).to(dtype)
    batch = dict(
        query=query, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
        seq_lens=torch.tensor([n for n, _ in specs], dtype=torch.int32), query_start_loc=query_start_loc,
    )  # fmt: skip
    return {k: v.to(device) for k, v in batch.items()}


def attention_args(batch, out, scale, window=0):
    """The positional arguments of paged_attention for ``batch`` (see varlen_batch)."""
    return (out, batch["query"], batch["key_cache"], batch["value_cache"], batch["block_tables"], batch["seq_lens"],
            batch["query_start_loc"], scale, window)


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


# the CUDA kernels' tests (test_ops_cuda.py on a GPU, test_cuda_emulation.py on the CPU): tolerances and batches
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # ~ one output rounding step


def paged_batch(specs, block_size, num_kv_heads, num_heads, head_size, dtype, *, window=0, seed=0, device="cuda"):
    """A varlen batch (attention_batches.varlen_batch) on `device`: specs [(seq_len, q_len), ...];
    every slot the call must not read is NaN, unread block-table entries point to the all-NaN block 0."""
    return varlen_batch(specs, num_heads, num_kv_heads, head_size, block_size, dtype, window=window, seed=seed,
                        unused=0, device=device)


def decode_specs(contexts):
    """One decode row per context (a context of 0: a padding row at position -1, zeros)."""
    return [(c, 1) for c in contexts]
