"""The 1-byte KV cache's ops (pagedgen/ops/kv_quant.py): the quantized write, the attention over the
dequantized blocks against the float op over the whole dequantized cache (the oracle), the scales
moving with copy_blocks / swap_blocks, the error bounds of the codes, and the bad calls.

The attention is compared with its oracle, float32 attention over the float32 dequantized cache
(the copy path with the reference ops); tests/ops/test_kv_quant_attention.py covers the CPU kernel's
own cases (its conversions, bitwise checks, batch invariance). Slots the call must not read are
NaN (attention_batches.varlen_batch) and stay NaN through quantization, so reading one would show.
"""
import pytest
import torch

from attention_batches import paged_batch
from pagedgen import ops
from pagedgen.ops import kv_quant, reference

NAMES = ["int8", "fp8", "fp8_e5m2"]
SPECS = [(1, 1), (37, 1), (50, 13), (16, 16), (0, 1), (70, 1)]  # decode, chunk after a prefix, prompt, padding row


def _quantized(batch, name):
    """batch's float caches as a 1-byte cache: (key_cache, value_cache, key_scales, value_scales)."""
    code = kv_quant.KV_CACHE_DTYPES[name][0]
    kc, ks = kv_quant.quantize(batch["key_cache"], code)
    vc, vs = kv_quant.quantize(batch["value_cache"], code)
    return kc, vc, ks, vs


@pytest.mark.parametrize("name", NAMES)
def test_codes_are_within_half_a_step_of_the_value(name):
    code, qmax = kv_quant.KV_CACHE_DTYPES[name]
    x = torch.randn(64, 4, 32, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, 64)[:, None, None]
    x[3, 1] = 0.0  # a zero vector: scale 0, codes 0
    codes, scales = kv_quant.quantize(x, code)
    assert codes.dtype == code and scales.dtype == torch.bfloat16 and scales.shape == (64, 4)
    back = kv_quant.dequantize(codes, scales, torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    if name == "int8":  # uniform steps of amax / 127 (the bf16 scale is within 2^-8 of it)
        bound = amax / qmax * 0.51
    else:  # e4m3: 3 mantissa bits, e5m2: 2 (relative), plus the subnormals' absolute step near 0
        rel = 2.0 ** -4 if name == "fp8" else 2.0 ** -3
        bound = x.abs() * rel + amax / qmax * 2.0 ** (-9 if name == "fp8" else -16) * 2
    assert bool(((back - x).abs() <= bound).all())
    assert bool((back[3, 1] == 0).all()) and float(scales[3, 1]) == 0.0


@pytest.mark.parametrize("name", NAMES)
def test_write_is_per_token_whatever_the_batch(name):
    """reshape_and_cache_quantized: each slot gets quantize(its own vector), whether the tokens come in
    one call or one at a time, in any order; negative slots are skipped."""
    gen = torch.Generator().manual_seed(1)
    key, value = torch.randn(20, 2, 16, generator=gen), torch.randn(20, 2, 16, generator=gen)
    slots = torch.randperm(48, generator=gen)[:20]
    slots[5] = -1
    one = kv_quant.allocate(name, 3, 16, 2, 16, torch.float32, "cpu")
    each = kv_quant.allocate(name, 3, 16, 2, 16, torch.float32, "cpu")
    for t in one + each:
        t.zero_()
    ops.reshape_and_cache_quantized(key, value, *one, slots)
    for i in reversed(range(20)):
        ops.reshape_and_cache_quantized(key[i : i + 1], value[i : i + 1], *each, slots[i : i + 1])
    for a, b in zip(one, each):
        assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a, b.view(torch.uint8) if b.element_size() == 1 else b)
    code = kv_quant.KV_CACHE_DTYPES[name][0]
    codes, scales = kv_quant.quantize(key, code)
    s = slots[0]
    assert torch.equal(one[0].view(-1, 2, 16)[s].float(), codes[0].float()) and torch.equal(one[2].view(-1, 2)[s], scales[0])
    unwritten = sorted(set(range(48)) - set(slots.tolist()))  # slot -1 was skipped: 29 slots keep their zeros
    assert len(unwritten) == 29 and not bool(one[0].view(-1, 2, 16)[unwritten].float().any())


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_size,group,window", [(16, 2, 0), (64, 1, 0), (64, 4, 20)])
def test_attention_is_float32_attention_over_the_dequantized_cache(name, dtype, head_size, group, window):
    """ops.paged_attention_quantized (the CPU kernel when built) against its oracle: the copy path with
    the reference ops (float32 attention over the float32 dequantized cache); the copy path over the
    compiled float op too (its fallback), with the step's gather plan."""
    batch = paged_batch(SPECS, 16, 2, 2 * group, head_size, dtype, window=window, seed=3, device="cpu")
    kc, vc, ks, vs = _quantized(batch, name)
    args = (batch["block_tables"], batch["seq_lens"], batch["query_start_loc"], head_size ** -0.5, window)
    want = torch.full_like(batch["query"], float("nan"))
    kv_quant.paged_attention_quantized(reference.paged_attention, reference.kv_dequantize_blocks, want, batch["query"], kc, vc, ks, vs, *args)
    got = torch.full_like(batch["query"], float("nan"))
    ops.paged_attention_quantized(got, batch["query"], kc, vc, ks, vs, *args)
    assert not bool(got.isnan().any())
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1.6e-2)
    torch.testing.assert_close(got, want, **tol)
    plan = kv_quant.gather_plan(batch["block_tables"], batch["seq_lens"], 16)
    copied = torch.full_like(got, float("nan"))
    kv_quant.paged_attention_quantized(ops.paged_attention, ops.kv_dequantize_blocks, copied, batch["query"], kc, vc, ks, vs,
                                       *args, gathered=plan)
    torch.testing.assert_close(copied, want, **tol)


def test_gather_plan_reads_each_block_once():
    tables = torch.tensor([[5, 2, 9, 0], [2, 7, 0, 0], [3, 0, 0, 0]], dtype=torch.int32)
    blocks, renumbered = kv_quant.gather_plan(tables, torch.tensor([40, 17, 0], dtype=torch.int32), 16)
    assert blocks.tolist() == [2, 5, 7, 9]
    assert renumbered.tolist() == [[1, 0, 3, 0], [0, 2, 0, 0], [0, 0, 0, 0]]
    blocks, _ = kv_quant.gather_plan(tables[2:], torch.tensor([0], dtype=torch.int32), 16)
    assert blocks.tolist() == [0]  # nothing read: one block keeps the shapes valid


@pytest.mark.parametrize("name", NAMES)
def test_copy_and_swap_move_codes_and_scales(name):
    """copy_blocks / swap_blocks (the kernels when built, else the reference) on the codes and the
    bf16 scales: the destination blocks read back as the source blocks did."""
    gen = torch.Generator().manual_seed(2)
    cache = kv_quant.allocate(name, 6, 4, 2, 8, torch.float32, "cpu")
    ops.reshape_and_cache_quantized(torch.randn(24, 2, 8, generator=gen), torch.randn(24, 2, 8, generator=gen), *cache, torch.arange(24))
    before = [kv_quant.dequantize(cache[i], cache[i + 2], torch.float32).clone() for i in (0, 1)]
    ops.copy_blocks(cache[0], cache[1], torch.tensor([[1, 4]]))
    ops.copy_blocks(cache[2], cache[3], torch.tensor([[1, 4]]))
    swap = kv_quant.allocate(name, 3, 4, 2, 8, torch.float32, "cpu")
    for t, st in zip(cache, swap):
        ops.swap_blocks(t, st, torch.tensor([[2, 0], [0, 2]]))
    for t, st in zip(cache, swap):
        ops.swap_blocks(st, t, torch.tensor([[0, 5]]))
    for i in (0, 1):
        after = kv_quant.dequantize(cache[i], cache[i + 2], torch.float32)
        assert torch.equal(after[4], before[i][1]) and torch.equal(after[5], before[i][2])
        assert torch.equal(after[:4], before[i][:4])


def test_bad_calls_name_the_argument():
    cache = kv_quant.allocate("int8", 2, 4, 2, 8, torch.float32, "cpu")
    k = torch.zeros(1, 2, 8)
    with pytest.raises(ValueError, match="past the cache's 8 slots"):
        ops.reshape_and_cache_quantized(k, k, *cache, torch.tensor([8]))
    with pytest.raises(ValueError, match="key_scales must be"):
        ops.reshape_and_cache_quantized(k, k, cache[0], cache[1], cache[2][:1], cache[3], torch.tensor([0]))
    with pytest.raises(ValueError, match=r"value_scales must be .* torch.bfloat16, got .* torch.float32"):
        ops.reshape_and_cache_quantized(k, k, cache[0], cache[1], cache[2], cache[3].float(), torch.tensor([0]))
    with pytest.raises(ValueError, match="must be int8 or float8"):
        ops.reshape_and_cache_quantized(k, k, cache[0].float(), cache[1].float(), cache[2], cache[3], torch.tensor([0]))
    with pytest.raises(ValueError, match="codes must be int8, float8_e4m3fn or float8_e5m2, got torch.uint8"):
        kv_quant.quantize(k, torch.uint8)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        kv_quant.check_kv_cache_dtype("int4")
    with pytest.raises(TypeError, match="kv_cache_dtype must be a str"):
        kv_quant.check_kv_cache_dtype(torch.int8)


def test_block_bytes_are_about_half_of_bf16():
    from pagedgen.config import ModelConfig

    cfg = ModelConfig("LlamaForCausalLM", 100, 576, 30, 9, 3, 64, 2048, True, torch.bfloat16)  # random-135m's shape
    assert cfg.kv_bytes_per_token("int8") == 2 * 30 * 3 * 66  # 64 codes and a bf16 scale per head
    assert cfg.kv_bytes_per_token() == 2 * 30 * 3 * 128
    assert cfg.kv_bytes_per_token() / cfg.kv_bytes_per_token("fp8") > 1.9
    layer = kv_quant.allocate("fp8", 10, 16, 3, 64, torch.bfloat16, "cpu")
    assert sum(t.numel() * t.element_size() for t in layer) * 30 == 10 * 16 * cfg.kv_bytes_per_token("fp8")


needs_kernel = pytest.mark.skipif(not ops.has_kernel("kv_dequantize_blocks"), reason="pagedgen._C without the kv_dequantize_blocks CPU kernel")


@needs_kernel
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_size", [8, 24, 64, 128])
def test_dequantize_kernel_is_bitwise_the_reference(name, dtype, head_size):
    gen = torch.Generator().manual_seed(head_size)
    code = kv_quant.KV_CACHE_DTYPES[name][0]
    x = torch.randn(7, 16, 3, head_size, generator=gen) * torch.logspace(-4, 3, 7)[:, None, None, None]
    codes, scales = kv_quant.quantize(x, code)
    blocks = torch.tensor([5, 0, 6, 5, 2])  # any order, repeats allowed
    want = torch.empty(5, 16, 3, head_size, dtype=dtype)
    reference.kv_dequantize_blocks(want, codes, scales, blocks)
    got = torch.full_like(want, float("nan"))
    torch.ops.pagedgen.kv_dequantize_blocks(got, codes, scales, blocks)
    assert torch.equal(got.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       want.view(torch.int16 if dtype != torch.float32 else torch.int32))
    assert torch.equal(want, kv_quant.dequantize(codes[blocks], scales[blocks], dtype))


@needs_kernel
def test_dequantize_kernel_checks_and_opcheck():
    codes, scales = kv_quant.quantize(torch.randn(3, 4, 2, 8), torch.int8)
    out = torch.empty(2, 4, 2, 8)
    with pytest.raises(RuntimeError, match=r"blocks\[1\] = 3 is outside \[0, 3\)"):
        torch.ops.pagedgen.kv_dequantize_blocks(out, codes, scales, torch.tensor([0, 3]))
    with pytest.raises(RuntimeError, match="scales must be bfloat16"):
        torch.ops.pagedgen.kv_dequantize_blocks(out, codes, scales.float(), torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="codes must be int8, float8_e4m3fn or float8_e5m2"):
        torch.ops.pagedgen.kv_dequantize_blocks(out, codes.float(), scales, torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="out .* must be"):
        torch.ops.pagedgen.kv_dequantize_blocks(out[:1], codes, scales, torch.tensor([0, 1]))
    torch.library.opcheck(torch.ops.pagedgen.kv_dequantize_blocks, (out, codes, scales, torch.tensor([2, 0])))


@pytest.mark.skipif(not ops.has_kernel("reshape_and_cache_quantized"), reason="pagedgen._C without the reshape_and_cache_quantized CPU kernel")
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_kernel_is_bitwise_the_reference(name, dtype):
    """The CPU kernel of the write (csrc/cpu/kv_quantize.cpp) against kv_quant's PyTorch ops: the same
    codes and scales byte for byte, from strided key/value views (a qkv projection's), over values of
    many magnitudes, a zero vector and padding slots; other slots untouched."""
    gen = torch.Generator().manual_seed(5)
    qkv = (torch.randn(40, 3, 2, 24, generator=gen) * torch.logspace(-6, 4, 40)[:, None, None, None]).to(dtype)
    qkv[7, 1, 0] = 0.0
    key, value = qkv[:, 1], qkv[:, 2]  # [40, 2, 24], strided
    slots = torch.randperm(56, generator=gen)[:40]
    slots[[3, 30]] = -1
    want = kv_quant.allocate(name, 7, 8, 2, 24, dtype, "cpu")
    got = kv_quant.allocate(name, 7, 8, 2, 24, dtype, "cpu")
    for a, b in zip(want, got):
        a.view(torch.uint8 if a.element_size() == 1 else torch.int16).fill_(3)
        b.view(torch.uint8 if b.element_size() == 1 else torch.int16).fill_(3)
    kv_quant.reshape_and_cache_quantized(key, value, *want, slots)
    torch.ops.pagedgen.reshape_and_cache_quantized(key, value, *got, slots)
    for a, b in zip(want, got):
        bits = torch.uint8 if a.element_size() == 1 else torch.int16
        assert torch.equal(a.view(bits), b.view(bits))
    with pytest.raises(RuntimeError, match=r"slot_mapping\[0\] = 56 is outside the cache's 56 slots"):
        torch.ops.pagedgen.reshape_and_cache_quantized(key[:1], value[:1], *got, torch.tensor([56]))
    if name == "int8":  # (torch's schema check compares mutated float8 tensors with an op float8 lacks)
        torch.library.opcheck(torch.ops.pagedgen.reshape_and_cache_quantized, (key, value, *got, slots))
