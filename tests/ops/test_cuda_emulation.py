"""The CUDA attention kernels, run on the CPU: tests/support/cuda_emulation compiles the kernel sources of
csrc/cuda as host C++ (one thread per CUDA thread, barriers for __syncthreads and shuffles) and
this file compares them with the PyTorch reference, as tests/ops/test_ops_cuda.py does on a GPU. It
checks the kernels' logic (thread layout, masking, online softmax, split-K merge, GQA chunks, the
host-side plan, the trap on a block id outside the cache) where no GPU is available; the GPU tests
remain the word on the real thing. The emulation builds the kernels without torch, so the op's
argument checks (csrc/op_checks.h) are not part of it: tests/ops/test_ops_checks.py runs those through
the compiled CUDA op's own entry.

Needs g++ (C++20) and the CUDA toolkit's headers (cuda_fp16.h); skipped without them.
"""
import ctypes
import hashlib
import os
import shutil
import subprocess

import pytest
import torch

from conftest import ROOT
from attention_batches import TOL, attention_args, decode_specs, paged_batch  # the same batch builder (NaN poisoning) as on the GPU
from pagedgen.ops import reference

SOURCES = [os.path.join(ROOT, "tests", "support", "cuda_emulation", f) for f in ("emulation.h", "attention_emu.cpp")] + [
    os.path.join(ROOT, "csrc", "cuda", f)
    for f in ("attention_params.cuh", "kernel_utils.cuh", "attention_fast.cuh", "attention_generic.cu", "attention_reduce.cu")
]
DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
H200_SMS = 132


def _cuda_include() -> str | None:
    from torch.utils import cpp_extension

    for home in (os.environ.get("CUDA_HOME"), cpp_extension.CUDA_HOME, "/usr/local/cuda"):
        if home and os.path.isfile(os.path.join(home, "include", "cuda_fp16.h")):
            return os.path.join(home, "include")
    return None


@pytest.fixture(scope="module")
def emulator():
    """The compiled emulation library (built once per source change under build/cuda_emulation)."""
    include, cxx = _cuda_include(), shutil.which("g++")
    if include is None or cxx is None:
        pytest.skip("needs g++ and the CUDA toolkit headers (cuda_fp16.h) to build the kernel emulation")
    digest = hashlib.sha256(b"".join(open(f, "rb").read() for f in SOURCES) + include.encode()).hexdigest()[:16]
    lib = os.path.join(ROOT, "build", "cuda_emulation", f"attention_emu_{digest}.so")
    if not os.path.exists(lib):
        os.makedirs(os.path.dirname(lib), exist_ok=True)
        cmd = [cxx, "-std=c++20", "-O1", "-pthread", "-shared", "-fPIC", "-w", f"-I{ROOT}/csrc/cuda",
               f"-I{ROOT}/tests/support/cuda_emulation", f"-I{include}", SOURCES[1], "-o", lib + ".tmp"]
        subprocess.run(cmd, check=True)
        os.replace(lib + ".tmp", lib)
    return ctypes.CDLL(lib)


def emulated_paged_attention(emulator, out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                             scale, sliding_window=0, num_sms=H200_SMS, expect_trap=False):
    """paged_attention through the emulated kernels (CPU tensors); returns the plan taken as
    (partition_size, max_partitions, heads_per_block, fast kernel). ``expect_trap``: a kernel must
    have trapped (a block id outside the cache; on a GPU the launch fails there)."""
    plan = (ctypes.c_int * 4)()
    ptr = lambda t: ctypes.c_void_p(t.data_ptr())  # noqa: E731
    i64 = ctypes.c_int64
    rc = emulator.emu_paged_attention(
        DTYPE_CODE[query.dtype], ptr(out), ptr(query), ptr(key_cache), ptr(value_cache), ptr(block_tables),
        ptr(seq_lens), ptr(query_start_loc), query.shape[0], block_tables.shape[0], query.shape[1], key_cache.shape[2],
        query.shape[2], key_cache.shape[0], key_cache.shape[1], block_tables.shape[1], i64(query.stride(0)), i64(query.stride(1)),
        i64(out.stride(0)), i64(out.stride(1)), i64(block_tables.stride(0)), ctypes.c_float(scale), sliding_window,
        num_sms, 1, plan)
    assert rc == (2 if expect_trap else 0)
    return tuple(plan)


def check(emulator, batch, *, window=0, num_sms=H200_SMS):
    query = batch["query"]
    out = torch.full_like(query, float("nan"))
    scale = query.shape[-1] ** -0.5
    args = attention_args(batch, out, scale, window)
    plan = emulated_paged_attention(emulator, *args, num_sms=num_sms)
    expected = torch.empty(query.shape, dtype=torch.float32)
    reference.paged_attention(*attention_args(batch, expected, scale, window))
    torch.testing.assert_close(out.float(), expected, atol=TOL[query.dtype], rtol=TOL[query.dtype])
    return plan


CASES = {  # dtype, head_size, num_kv_heads, group, block_size, contexts, num_sms, expected (split, fast)
    "fast-split-gqa4": (torch.float32, 128, 2, 4, 16, [0, 1, 13, 300, 777], H200_SMS, (True, True)),
    "fast-single-gqa8": (torch.bfloat16, 64, 1, 8, 16, [0, 1, 15, 300], 1, (False, True)),
    "fast-ragged-d80": (torch.float16, 80, 1, 2, 8, [1, 9, 400], H200_SMS, (True, True)),
    "fast-d256-gqa3-masked-head": (torch.bfloat16, 256, 2, 3, 32, [2, 100, 290], 1, (False, True)),
    "fast-gqa16-chunks-bs7": (torch.float32, 112, 1, 16, 7, [3, 270], H200_SMS, (True, True)),
    "generic-d8-split-bs5": (torch.bfloat16, 8, 2, 4, 5, [0, 1, 13, 300, 777], H200_SMS, (True, False)),
    "generic-d40-gqa12": (torch.float16, 40, 1, 12, 16, [1, 77, 260], 1, (False, False)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_emulated_paged_attention(emulator, case):
    dtype, head_size, num_kv_heads, group, block_size, contexts, num_sms, (split, fast) = CASES[case]
    batch = paged_batch(decode_specs(contexts), block_size, num_kv_heads, num_kv_heads * group, head_size, dtype,
                        device="cpu")
    plan = check(emulator, batch, num_sms=num_sms)
    assert (plan[0] > 0, bool(plan[3])) == (split, fast), plan


@pytest.mark.parametrize("head_size", [64, 8])
def test_emulated_varlen_strided_query(emulator, head_size):
    # prompts, a chunk mid-block after a cached prefix, decode rows, an empty and a padding sequence;
    # q a view of a fused qkv projection
    specs = [(150, 150), (45, 20), (9, 1), (0, 0), (0, 1), (33, 1)]
    batch = paged_batch(specs, 16, 2, 4, head_size, torch.bfloat16, device="cpu")
    T = batch["query"].shape[0]
    qkv = torch.randn(T, (4 + 2 * 2) * head_size).to(torch.bfloat16)
    qkv[:, : 4 * head_size] = batch["query"].reshape(T, -1)
    batch["query"] = qkv[:, : 4 * head_size].view(T, 4, head_size)
    check(emulator, batch)


@pytest.mark.parametrize("window, num_sms", [(7, 1), (100, H200_SMS), (300, H200_SMS)])
@pytest.mark.parametrize("head_size", [128, 8])
def test_emulated_sliding_window(emulator, window, num_sms, head_size):
    # split-K with partitions wholly before the window (num_sms 132), single pass (1)
    specs = [(700, 1), (260, 40), (30, 30), (1, 1)]
    batch = paged_batch(specs, 16, 2, 4, head_size, torch.float32, window=window, device="cpu")
    plan = check(emulator, batch, window=window, num_sms=num_sms)
    assert (plan[0] > 0) == (num_sms > 1), plan


@pytest.mark.parametrize("bad_block", [-1, "num_blocks"])
@pytest.mark.parametrize("head_size", [128, 8])  # the fast and the generic kernel
def test_emulated_block_id_outside_the_cache_traps(emulator, bad_block, head_size):
    # a block id the host cannot check without a device sync: the kernel traps (on a GPU the launch
    # fails) instead of reading outside the cache; a table entry past the span is never read
    batch = paged_batch(decode_specs([40, 20]), 16, 2, 4, head_size, torch.float32, device="cpu")
    args = attention_args(batch, torch.empty_like(batch["query"]), 0.1)
    batch["block_tables"][:, -1] = 1 << 30  # the spare column, past both spans: not read
    emulated_paged_attention(emulator, *args)
    batch["block_tables"][1, 0] = batch["key_cache"].shape[0] if bad_block == "num_blocks" else bad_block
    emulated_paged_attention(emulator, *args, expect_trap=True)
