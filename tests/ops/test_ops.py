"""CPU kernels of the paged KV-cache ops (reshape_and_cache, copy_blocks, swap_blocks) against the plain
PyTorch references in pagedgen/ops/reference.py (the oracle), plus torch.library.opcheck and the fake
kernels. They copy, so they must match exactly, in every dtype. paged_attention is tested in
test_ops_attention.py, the layer ops in test_layer_ops.py, batch invariance in
test_ops_batch_invariance.py.
"""

import pytest
import torch

from attention_batches import single_thread
from pagedgen import ops
from pagedgen.ops import reference

pytestmark = pytest.mark.skipif(
    not ops.extension_available("cpu"),
    reason=f"pagedgen._C CPU kernels unavailable: {ops.extension_error('cpu')}",
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


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
    gen = torch.Generator().manual_seed(0)
    key_cache, value_cache = torch.randn(8, 8, 2, 8, generator=gen), torch.randn(8, 8, 2, 8, generator=gen)
    key, value = torch.randn(5, 2, 8, generator=gen), torch.randn(5, 2, 8, generator=gen)
    slots = torch.tensor([0, 3, -1, 9, 20])
    pairs = torch.tensor([[0, 5], [1, 4]])
    return {
        "reshape_and_cache": (key, value, key_cache.clone(), value_cache.clone(), slots),
        "copy_blocks": (key_cache.clone(), value_cache.clone(), pairs),
        "swap_blocks": (key_cache, torch.zeros(6, *key_cache.shape[1:]), pairs),
    }


@pytest.mark.parametrize("name", ["reshape_and_cache", "copy_blocks", "swap_blocks"])
def test_opcheck(name):
    torch.library.opcheck(getattr(torch.ops.pagedgen, name).default, small_inputs()[name])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["reshape_and_cache", "copy_blocks", "swap_blocks"])
def test_opcheck_half_dtypes(name, dtype):
    args = tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in small_inputs()[name])
    torch.library.opcheck(getattr(torch.ops.pagedgen, name).default, args)


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
        key, value, *rest = fake["reshape_and_cache"]
        with pytest.raises(Exception, match="differ"):
            torch.ops.pagedgen.reshape_and_cache(key, value[:3], *rest)
