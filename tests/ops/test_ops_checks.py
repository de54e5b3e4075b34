"""The argument checks shared by the CPU and CUDA kernels (csrc/op_checks.h): every bad call of
tests/support/op_bad_calls.py raises a RuntimeError naming the argument, from the CPU kernel and, with CPU
tensors, from the CUDA kernel's own entry (reached through the dispatcher's CUDA key: the checks read
no pointer, and the CUDA kernel refuses CPU tensors at its device check, which comes last). So a
machine without a GPU runs the very checks (compiled by the same build) that guard the CUDA ops;
tests/ops/test_ops_cuda.py runs the same list on a GPU.

The values inside the tensors (block ids, slots, seq_lens, query_start_loc) are checked by the CPU
kernels on the host (tests/ops/test_ops.py, tests/ops/test_ops_attention.py) and guarded inside the CUDA
kernels (tests/ops/test_cuda_emulation.py, tests/ops/test_ops_cuda.py).
"""
import pytest
import torch

from op_bad_calls import CASES, MIXES_DEVICES, arguments, bad_call, valid_call
from pagedgen import ops
from pagedgen.ops import reference

pytestmark = pytest.mark.skipif(
    not ops.extension_available("cpu"),
    reason=f"pagedgen._C CPU kernels unavailable: {ops.extension_error('cpu')}",
)

OPS = ("paged_attention", "reshape_and_cache", "copy_blocks", "swap_blocks")
LAYER_OPS = ("rms_norm", "fused_add_rms_norm", "silu_and_mul")  # CPU kernels only, sharing the output checks


def kernel_call(op: str, key: str, args: tuple) -> None:
    """Runs the kernel of dispatch key ``key`` ("CPU" or "CUDA") of ``op`` on ``args``, whatever
    devices the tensors are on."""
    keys = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))
    getattr(torch.ops.pagedgen, op).default.redispatch(keys, *args)


def has_cuda_kernel(op: str) -> bool:
    return ops.has_kernel(op, "cuda")


@pytest.mark.parametrize("case", [c for c, (_, _, _, kernels) in CASES.items() if "cpu" in kernels])
def test_cpu_kernel_rejects(case):
    op, args, message = bad_call(case, "cpu", "meta")
    with pytest.raises(RuntimeError, match=message):
        kernel_call(op, "CPU", args)


@pytest.mark.parametrize("case", [c for c, (_, _, _, kernels) in CASES.items() if kernels == ("cuda",)])
def test_cpu_kernel_takes_what_only_cuda_rejects(case):
    # strides the CUDA kernel assumes and the CPU kernel reads through: the call runs on the CPU
    op, args, _ = bad_call(case, "cpu", "meta")
    assert op == "paged_attention"
    kernel_call(op, "CPU", args)
    expected = torch.empty(args[0].shape)
    reference.paged_attention(expected, *args[1:])
    torch.testing.assert_close(args[0], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", [c for c, (_, _, _, kernels) in CASES.items() if "cuda" in kernels and c not in MIXES_DEVICES])
def test_cuda_kernel_entry_rejects(case):
    op, args, message = bad_call(case, "cpu", "meta")
    if not has_cuda_kernel(op):
        pytest.skip("pagedgen._C was built without CUDA kernels")
    with pytest.raises(RuntimeError, match=message):
        kernel_call(op, "CUDA", args)


@pytest.mark.parametrize(
    "op, message",
    [("paged_attention", "paged_attention \\(CUDA kernel\\): tensors must be on a CUDA device, got cpu"),
     ("reshape_and_cache", "reshape_and_cache \\(CUDA kernel\\): tensors must be on a CUDA device, got cpu"),
     ("copy_blocks", "copy_blocks \\(CUDA kernel\\): tensors must be on a CUDA device, got cpu"),
     ("swap_blocks", "swap_blocks \\(CUDA kernel\\): src or dst must be on a CUDA device, got cpu and cpu")],
)
def test_cuda_kernel_entry_refuses_cpu_tensors(op, message):
    # the last check of each CUDA op: a valid call on CPU tensors never reaches a launch or a copy
    if not has_cuda_kernel(op):
        pytest.skip("pagedgen._C was built without CUDA kernels")
    with pytest.raises(RuntimeError, match=message):
        kernel_call(op, "CUDA", arguments(op, valid_call(op, "cpu")))


@pytest.mark.parametrize("op", OPS)
def test_cpu_kernel_refuses_another_device(op):
    args = valid_call(op, "cpu")
    first = next(iter(args))
    args[first] = args[first].to("meta")
    with pytest.raises(RuntimeError, match="must be on a CPU device, got meta|one device"):
        kernel_call(op, "CPU", arguments(op, args))


@pytest.mark.parametrize("op", OPS + LAYER_OPS)
def test_valid_calls_pass(op):
    # the baseline every case breaks: accepted as it is (so each case fails for its own reason)
    args = valid_call(op, "cpu")
    getattr(torch.ops.pagedgen, op)(*arguments(op, args))


def test_empty_calls_are_no_ops():
    # zero rows, zero sequences, zero tokens, zero pairs: accepted, nothing written
    cache = torch.randn(2, 4, 1, 8)
    before = cache.clone()
    empty_i32 = torch.zeros(0, dtype=torch.int32)
    out = torch.empty(0, 2, 8)
    torch.ops.pagedgen.paged_attention(out, torch.empty(0, 2, 8), cache, cache, torch.zeros(0, 3, dtype=torch.int32),
                                       empty_i32, torch.zeros(1, dtype=torch.int32), 1.0, 0)
    key = torch.empty(0, 1, 8)
    torch.ops.pagedgen.reshape_and_cache(key, key, cache, cache, torch.zeros(0, dtype=torch.long))
    torch.ops.pagedgen.copy_blocks(cache, cache, torch.zeros(0, 2, dtype=torch.long))
    torch.ops.pagedgen.swap_blocks(cache, cache.clone(), torch.zeros(0, 2, dtype=torch.long))
    assert torch.equal(cache, before)
