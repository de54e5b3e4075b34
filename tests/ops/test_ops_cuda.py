"""The CUDA kernels of pagedgen._C against the PyTorch reference (pagedgen/ops/reference.py), plus
``torch.library.opcheck``. Needs a CUDA GPU; without one every test here is skipped. With one, a
missing CUDA build is a failure, not a skip.

Poisoning makes the comparisons strict: outputs start as NaN (every element must be written), and
every cache slot outside the attended spans (padding in the last block, positions before a sliding
window, unused blocks, the block that unused block-table entries point to) holds NaN, so reading one
poisons the result. Batches are varlen (tests/support/attention_batches.py): decode rows, prefill chunks,
padding rows (seq_len 0, zeros) in one call.

Bad arguments: every call of tests/support/op_bad_calls.py must raise (the checks shared with the CPU
kernels, csrc/op_checks.h); values the host cannot see without a sync are guarded in the kernels
(a trap on a block id outside the cache, skipped slots and pairs).

paged_attention picks split-K when fewer than 4 blocks per multiprocessor would run otherwise and
the block table spans more than 256 tokens (csrc/cuda/attention_params.cuh, plan_attention): the
small batches below take the split-K path, the ``many_seqs`` and short-context cases the single pass.
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import ROOT
from attention_batches import TOL, attention_args, decode_specs, paged_batch, varlen_batch
from op_bad_calls import CASES, arguments, bad_call, valid_call
from pagedgen import ops
from pagedgen.ops import reference

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]

DEVICE = "cuda"
OPS = torch.ops.pagedgen


@pytest.fixture(scope="module", autouse=True)
def cuda_kernels():
    assert ops.extension_available("cuda"), ops.extension_error("cuda")


def num_sms() -> int:
    return torch.cuda.get_device_properties(DEVICE).multi_processor_count


def check_attention(batch, *, window=0, out=None):
    """Runs the kernel into a NaN-filled `out` and compares it with the reference (float32)."""
    query = batch["query"]
    scale = query.shape[-1] ** -0.5
    if out is None:
        out = torch.full_like(query, float("nan"))
    else:
        out.fill_(float("nan"))
    OPS.paged_attention(*attention_args(batch, out, scale, window))
    expected = torch.empty(query.shape, dtype=torch.float32, device=query.device)
    reference.paged_attention(*attention_args(batch, expected, scale, window))
    tol = TOL[query.dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
    return out


# ---- paged_attention ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_size", [8, 64, 80, 128, 256])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_paged_attention(dtype, head_size, group, block_size):
    contexts = [0, 1, block_size - 1, block_size, block_size + 1, 100, 257, 515, 1000]  # split-K
    check_attention(paged_batch(decode_specs(contexts), block_size, 2, 2 * group, head_size, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_size", [8, 96, 112, 128])
def test_paged_attention_short_contexts_single_pass(dtype, head_size):
    contexts = [1, 2, 15, 16, 17, 200, 0, 255]  # table of 16 blocks x 16 = 256 tokens: single pass
    check_attention(paged_batch(decode_specs(contexts), 16, 4, 12, head_size, dtype))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("head_size", [8, 128])
def test_paged_attention_many_seqs_single_pass(dtype, head_size):
    num_seqs = 2 * num_sms() + 1  # >= 4 blocks per multiprocessor: single pass over long contexts
    g = torch.Generator().manual_seed(2)
    contexts = torch.randint(1, 1001, (num_seqs,), generator=g).tolist()
    contexts[:3] = [0, 3000, 1]
    check_attention(paged_batch(decode_specs(contexts), 16, 2, 8, head_size, dtype))


@pytest.mark.parametrize("context", [4096, 32768])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_paged_attention_long_context_batch_one(context, dtype):
    check_attention(paged_batch([(context, 1)], 16, 8, 32, 128, dtype))  # split into many partitions


@pytest.mark.parametrize("group", [3, 6, 12, 16])
def test_paged_attention_group_sizes_beyond_powers_of_two(group):
    check_attention(paged_batch(decode_specs([7, 300, 700]), 16, 2, 2 * group, 64, torch.bfloat16))


@pytest.mark.parametrize("block_size", [1, 5, 12, 64])
def test_paged_attention_other_block_sizes(block_size):
    check_attention(paged_batch(decode_specs([1, 11, 130, 600]), block_size, 2, 8, 128, torch.float16))


def test_paged_attention_wide_block_table():
    # a table far wider than the contexts (as an engine sized for max_model_len would pass)
    batch = paged_batch(decode_specs([1, 40, 333]), 16, 2, 8, 128, torch.bfloat16)
    batch["block_tables"] = torch.cat([batch["block_tables"], torch.zeros(3, 500, dtype=torch.int32, device=DEVICE)], 1)
    check_attention(batch)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("aligned", [True, False])
def test_paged_attention_strided_query_and_out(dtype, aligned):
    # q as a view of a fused qkv projection (llama.py), out a view of a wider buffer; with an
    # unaligned q (one element of offset) the generic kernel takes over from the fast one.
    num_heads, num_kv_heads, head_size = 8, 2, 128
    batch = paged_batch([(5, 1), (64, 64), (700, 30)], 16, num_kv_heads, num_heads, head_size, dtype)
    T = batch["query"].shape[0]
    width = (num_heads + 2 * num_kv_heads) * head_size + (0 if aligned else 1)
    qkv = torch.randn(T, width, dtype=dtype, device=DEVICE)
    offset = 0 if aligned else 1
    batch["query"] = qkv[:, offset : offset + num_heads * head_size].view(T, num_heads, head_size)
    wide = torch.full((T, num_heads, head_size + 16), 7.0, dtype=dtype, device=DEVICE)
    check_attention(batch, out=wide[:, :, 8 : 8 + head_size])
    assert (wide[:, :, :8] == 7).all() and (wide[:, :, 8 + head_size :] == 7).all(), "wrote outside out"


@pytest.mark.parametrize("head_size", [8, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_paged_attention_varlen_prefill_and_decode(head_size, dtype):
    # the engine's step: whole prompts, a chunk mid-block after a cached prefix, decode rows, an empty
    # sequence and padding rows (seq_len 0: zeros)
    specs = [(700, 700), (333, 100), (17, 1), (0, 0), (1000, 1), (0, 1), (45, 45)]
    out = check_attention(paged_batch(specs, 16, 2, 8, head_size, dtype))
    assert (out[700 + 100 + 1 + 1] == 0).all(), "a padding row must give zeros"


@pytest.mark.parametrize("window", [1, 16, 100, 4096])
@pytest.mark.parametrize("head_size", [8, 64, 128])
def test_paged_attention_sliding_window(window, head_size):
    # blocks wholly before a window hold NaN and table entries of the NaN block: never read
    specs = [(300, 300), (5000, 1), (2000, 77), (50, 1), (9, 9)]
    check_attention(paged_batch(specs, 16, 2, 8, head_size, torch.bfloat16, window=window), window=window)


def test_paged_attention_traps_on_a_block_id_outside_the_cache():
    # a value the host cannot check without a sync: the kernel traps (no read outside the cache), the
    # launch fails and the CUDA context is lost, so this runs in a process of its own
    script = textwrap.dedent("""
        import os, sys, torch
        sys.path.insert(0, "tests/support")
        from attention_batches import attention_args, varlen_batch
        import pagedgen.ops
        batch = varlen_batch([(40, 1), (20, 1)], 4, 2, 64, 16, torch.float16, unused=0, device="cuda")
        batch["block_tables"][1, 0] = batch["key_cache"].shape[0]  # one past the last block
        try:
            torch.ops.pagedgen.paged_attention(*attention_args(batch, torch.empty_like(batch["query"]), 0.1))
            torch.cuda.synchronize()
        except Exception as e:  # torch.AcceleratorError (a RuntimeError) on recent torch
            print("raised", type(e).__name__, str(e).splitlines()[0], flush=True)
            os._exit(0)  # the CUDA context is lost: skip the exit-time clean-up
        print("no error", flush=True)
        os._exit(1)
    """)
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "CUDA error" in run.stdout, (run.returncode, run.stdout, run.stderr[-2000:])


# ---- the shared argument checks (csrc/op_checks.h) -------------------------------------------------


@pytest.mark.parametrize("case", [c for c, (_, _, _, kernels) in CASES.items() if "cuda" in kernels])
def test_rejects_bad_arguments(case):
    # every bad call of tests/support/op_bad_calls.py, as tests/ops/test_ops_checks.py runs them on the CPU
    op, args, message = bad_call(case, DEVICE, "cpu")
    with pytest.raises(RuntimeError, match=message):
        getattr(OPS, op)(*args)


@pytest.mark.parametrize("op", ["paged_attention", "reshape_and_cache", "copy_blocks", "swap_blocks"])
def test_valid_calls_pass(op):
    # the baseline every case breaks
    getattr(OPS, op)(*arguments(op, valid_call(op, DEVICE)))
    torch.cuda.synchronize()


def test_empty_calls_are_no_ops():
    cache = torch.randn(2, 4, 1, 8, device=DEVICE)
    before = cache.clone()
    i32 = dict(dtype=torch.int32, device=DEVICE)
    OPS.paged_attention(torch.empty(0, 2, 8, device=DEVICE), torch.empty(0, 2, 8, device=DEVICE), cache, cache,
                        torch.zeros(0, 3, **i32), torch.zeros(0, **i32), torch.zeros(1, **i32), 1.0, 0)
    key = torch.empty(0, 1, 8, device=DEVICE)
    OPS.reshape_and_cache(key, key, cache, cache, torch.zeros(0, dtype=torch.long, device=DEVICE))
    OPS.copy_blocks(cache, cache, torch.zeros(0, 2, dtype=torch.long, device=DEVICE))
    OPS.swap_blocks(cache, torch.zeros(2, 4, 1, 8), torch.zeros(0, 2, dtype=torch.long))
    torch.cuda.synchronize()
    assert torch.equal(cache, before)


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


def test_reshape_and_cache_skips_slots_past_the_cache():
    # slots stay on the GPU (checking them would sync): one past the cache is skipped, nothing written
    # outside; the CPU kernel raises instead
    cache = torch.zeros(4, 8, 2, 64, device=DEVICE)
    key = torch.randn(3, 2, 64, device=DEVICE)
    padded = torch.zeros(6, 8, 2, 64, device=DEVICE)  # the caches as views of a larger buffer: 2 guard blocks
    key_cache, value_cache = padded[:4], torch.zeros(4, 8, 2, 64, device=DEVICE)
    OPS.reshape_and_cache(key, key, key_cache, value_cache, torch.tensor([0, 32, 9], device=DEVICE))
    expected = cache.clone()
    expected.view(32, 2, 64)[0], expected.view(32, 2, 64)[9] = key[0], key[2]
    assert torch.equal(key_cache, expected) and torch.equal(value_cache, expected)
    assert not padded[4:].any(), "wrote past the cache"


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


def test_copy_blocks_skips_out_of_range_pairs_of_a_cuda_mapping():
    # a CUDA mapping stays on the GPU (checking it would sync): pairs outside the cache are skipped
    padded = torch.randn(6, 8, 2, 64, device=DEVICE)  # blocks 4 and 5: a guard past the cache
    key_cache, value_cache = padded[:4], torch.randn(4, 8, 2, 64, device=DEVICE)
    before_k, before_v, guard = key_cache.clone(), value_cache.clone(), padded[4:].clone()
    OPS.copy_blocks(key_cache, value_cache, torch.tensor([[0, 1], [0, 4], [-1, 2], [3, 2]], device=DEVICE))
    for cache, before in ((key_cache, before_k), (value_cache, before_v)):
        expected = before.clone()
        expected[1], expected[2] = before[0], before[3]
        assert torch.equal(cache, expected)
    assert torch.equal(padded[4:], guard), "wrote past the cache"


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
    batch = paged_batch([(3, 1), (40, 40), (300, 7)], 16, 2, 4, 64, torch.float16)
    kc, vc = torch.nan_to_num(batch["key_cache"]), torch.nan_to_num(batch["value_cache"])  # opcheck compares runs: no NaN
    batch.update(key_cache=kc, value_cache=vc)
    q = batch["query"]
    key = torch.randn(5, 2, 64, dtype=torch.float16, device=DEVICE)
    slots = torch.tensor([0, 17, -1, 40, 3], device=DEVICE)
    mapping = torch.tensor([[1, 5], [2, 6]])
    return {
        "paged_attention": attention_args(batch, torch.empty_like(q), 0.125, 20),
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
