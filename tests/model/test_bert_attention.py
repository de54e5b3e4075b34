"""The encoders' attention (pagedgen/model/bert.py, ``AttentionPlan.attend``): the varlen_attention
kernel path against the length-bucket SDPA path it replaces where the kernel is built, on one step of
sequences of mixed lengths (1 to 70 tokens, across the 16-row buckets and the kernel's 32-token
tiles) in the encoder's layout (q, k, v side by side in one [T, 3 H D] tensor): float32 within 1e-5,
bfloat16 within a rounding of the output; and the same plan serves every layer of a step."""
import pytest
import torch

from pagedgen import ops
from pagedgen.model.bert import AttentionPlan

pytestmark = pytest.mark.skipif(not ops.has_kernel("varlen_attention"), reason="no varlen_attention CPU kernel")

LENGTHS = [1, 9, 16, 17, 70, 33, 2, 48, 31]


def _step(dtype, heads=12, head_size=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(sum(LENGTHS), 3 * heads * head_size, generator=g).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return qkv, qsl


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("head_size", [32, 64])
def test_kernel_path_matches_bucketed_sdpa(dtype, tol, head_size):
    qkv, qsl = _step(dtype, heads=384 // head_size, head_size=head_size)
    kernel, bucketed = AttentionPlan(qsl), AttentionPlan(qsl, kernel=False)
    assert kernel.cu_seqlens is not None and not kernel.groups and bucketed.cu_seqlens is None and bucketed.groups
    got, want = kernel.attend(qkv, head_size), bucketed.attend(qkv, head_size)
    assert got.shape == want.shape == (qkv.shape[0], qkv.shape[1] // 3) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_a_sequence_alone_equals_it_in_the_step():
    qkv, qsl = _step(torch.float32, seed=1)
    together = AttentionPlan(qsl).attend(qkv, 32)
    bounds = qsl.tolist()
    for a, b in zip(bounds, bounds[1:]):
        alone = AttentionPlan(torch.tensor([0, b - a], dtype=torch.int32)).attend(qkv[a:b], 32)
        assert torch.equal(alone, together[a:b])
