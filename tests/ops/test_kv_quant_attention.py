"""The CPU attention kernel reading the 1-byte KV cache itself (``paged_attention_quantized``,
csrc/cpu/kv_codes.h, csrc/cpu/attention_general.h): its conversions of all 256 codes, its result
against float32 attention over the dequantized cache (the reference copy path and the float kernel),
bitwise against the float kernel's general path when every scale is 1, batch invariance bit for
bit, and its bad calls.
"""
import pytest
import torch

from attention_batches import UNUSED_BLOCK, varlen_batch
from pagedgen import ops
from pagedgen.ops import kv_quant, reference

pytestmark = pytest.mark.skipif(not ops.has_kernel("paged_attention_quantized"),
                                reason="pagedgen._C without the paged_attention_quantized CPU kernel")

NAMES = ["int8", "fp8", "fp8_e5m2"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# decode rows, a chunk after a prefix, a whole prompt, a verify block of 3 rows, a padding row
SPECS = [(1, 1), (70, 1), (37, 5), (50, 13), (45, 3), (0, 1), (33, 33)]


def _quantized(batch, name):
    """batch's float caches as a 1-byte cache: (key_cache, value_cache, key_scales, value_scales)."""
    code = kv_quant.KV_CACHE_DTYPES[name][0]
    kc, ks = kv_quant.quantize(batch["key_cache"], code)
    vc, vs = kv_quant.quantize(batch["value_cache"], code)
    return kc, vc, ks, vs


def _args(batch, window):
    return (batch["block_tables"], batch["seq_lens"], batch["query_start_loc"], batch["query"].shape[2] ** -0.5, window)


def _scores_with_bf16_dot(dtype, head_size) -> bool:
    """The float kernel scores bf16 with vdpbf16ps on this build (other bits than the float path)."""
    return dtype == torch.bfloat16 and head_size % 32 == 0 and ops.cpu_isa() in ("avx512_bf16", "amx")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("head_size", [8, 32])
def test_all_256_codes_convert_as_torch_does(name, head_size):
    """The kernels' conversions (kv_codes.h: int8 widened, e5m2 as fp16 bits, e4m3 placed as fp16
    bits with 2^8 in the scale, its NaN codes) over every code, through kv_dequantize_blocks, which
    shares them: bitwise torch's float(code) * float(scale), NaNs where torch has them."""
    code = kv_quant.KV_CACHE_DTYPES[name][0]
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(code).reshape(1, 256 // (2 * head_size), 2, head_size)
    for scales in (torch.ones(codes.shape[:3], dtype=torch.bfloat16),
                   torch.tensor([1e-30, 3.5, 2.0 ** -20, 1e4] * 16, dtype=torch.bfloat16)[: codes.shape[1] * 2].view(codes.shape[:3])):
        for dtype in DTYPES:
            want = torch.empty(codes.shape, dtype=dtype)
            reference.kv_dequantize_blocks(want, codes, scales, torch.tensor([0]))
            got = torch.empty_like(want)
            torch.ops.pagedgen.kv_dequantize_blocks(got, codes, scales, torch.tensor([0]))
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
            assert torch.equal(got.isnan(), want.isnan())


CASES = [(32, 2, 1, 16, 0), (64, 3, 3, 16, 0), (80, 1, 2, 8, 0), (128, 2, 4, 32, 0), (64, 2, 2, 16, 20), (16, 2, 2, 16, 0),
         (8, 1, 4, 4, 5)]  # head_size, num_kv_heads, group, block_size, window


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size,num_kv_heads,group,block_size,window", CASES)
def test_kernel_is_float32_attention_over_the_dequantized_cache(name, dtype, head_size, num_kv_heads, group, block_size,
                                                                window):
    """Against the oracle (the reference ops over the float32 dequantized cache) and the compiled float
    kernel in float32 over the same values: equal up to float rounding (the kernel applies each
    token's scale to its scores and weights instead of to its values)."""
    # released entries (blocks before a window) 0, not UNUSED_BLOCK: the copy path's gather reads them
    batch = varlen_batch(SPECS, num_kv_heads * group, num_kv_heads, head_size, block_size, dtype, window=window,
                         seed=head_size, unused=0)
    kc, vc, ks, vs = _quantized(batch, name)
    args = _args(batch, window)
    got = torch.full_like(batch["query"], float("nan"))
    ops.paged_attention_quantized(got, batch["query"], kc, vc, ks, vs, *args)
    assert not bool(got.isnan().any())  # NaN slots the call must not read have NaN scales
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1.6e-2)
    fp32 = torch.empty(got.shape)
    ops.paged_attention(fp32, batch["query"].float(), kv_quant.dequantize(kc, ks), kv_quant.dequantize(vc, vs), *args)
    torch.testing.assert_close(got, fp32.to(dtype), **tol)
    if head_size in (8, 64) and dtype != torch.float16:  # the reference copy path (slow): the oracle
        ref = torch.empty_like(got)
        kv_quant.paged_attention_quantized(reference.paged_attention, reference.kv_dequantize_blocks, ref, batch["query"],
                                           kc, vc, ks, vs, *args)
        torch.testing.assert_close(got, ref, **tol)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size,num_kv_heads,group,block_size,window", CASES)
def test_unit_scales_give_the_float_kernels_bits(monkeypatch, name, dtype, head_size, num_kv_heads, group, block_size,
                                                 window):
    """With every scale 1 the kernel must read exactly the codes' values (e4m3: times 2^-8, then 2^8
    on the scores and weights: exact), so its result is bitwise the float kernel's general path over
    the codes as a cache of the query's dtype (every code is exact in bf16 and fp16): the reading of
    codes in place, into tiles and in transposed tiles checked bit for bit. (Where the float kernel
    scores bf16 with vdpbf16ps, AVX512-BF16, within rounding only.)"""
    batch = varlen_batch(SPECS, num_kv_heads * group, num_kv_heads, head_size, block_size, dtype, window=window, seed=1)
    kc, vc, ks, vs = _quantized(batch, name)
    ks.fill_(1.0), vs.fill_(1.0)
    args = _args(batch, window)
    got = torch.full_like(batch["query"], float("nan"))
    ops.paged_attention_quantized(got, batch["query"], kc, vc, ks, vs, *args)
    monkeypatch.setenv("PAGEDGEN_CPU_ATTENTION", "general")  # the quantized kernel's path, whatever the head size
    want = torch.full_like(got, float("nan"))
    ops.paged_attention(want, batch["query"], kc.to(dtype), vc.to(dtype), *args)
    if _scores_with_bf16_dot(dtype, head_size):
        torch.testing.assert_close(got, want, atol=1e-2, rtol=1.6e-2)
    else:
        assert torch.equal(got, want)


def _attend(batch, cache, ends_and_lens, scale, window):
    """Rows [end - q_len, end) of the prompt for each (end, q_len), as sequences of one call sharing
    the prompt's block table; their outputs in that order."""
    ends = [e for e, _ in ends_and_lens]
    q_lens = [q for _, q in ends_and_lens]
    query = torch.cat([batch["query"][e - q : e] for e, q in ends_and_lens])
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    out = torch.full_like(query, float("nan"))
    ops.paged_attention_quantized(out, query, *cache, batch["block_tables"].expand(len(ends), -1),
                                  torch.tensor(ends, dtype=torch.int32), qsl, scale, window)
    return out


@pytest.mark.parametrize("name", ["int8", "fp8"])
@pytest.mark.parametrize("dtype,head_size,num_kv_heads,group,window",
                         [(torch.bfloat16, 64, 3, 3, 0), (torch.float32, 16, 2, 2, 0), (torch.float16, 80, 2, 1, 37)])
def test_rows_get_the_same_bits_in_any_batch(name, dtype, head_size, num_kv_heads, group, window):
    """A prompt attended in one chunk, in chunks, token by token (decode rows), as verify blocks,
    among other sequences and on one thread or two: every row bitwise the same."""
    n = 130
    batch = varlen_batch([(n, n)], num_kv_heads * group, num_kv_heads, head_size, 16, dtype, window=window, seed=7)
    cache = _quantized(batch, name)
    scale = head_size ** -0.5
    whole = _attend(batch, cache, [(n, n)], scale, window)
    assert not bool(whole.isnan().any())
    assert torch.equal(_attend(batch, cache, [(e, 1) for e in range(1, n + 1)], scale, window), whole)
    assert torch.equal(_attend(batch, cache, [(17, 17), (100, 83), (n, n - 100)], scale, window), whole)
    ends = [(4, 3), (40, 5), (77, 9), (n, 2)]  # verify blocks (and short chunks) of several sequences
    want = torch.cat([whole[e - q : e] for e, q in ends])
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            assert torch.equal(_attend(batch, cache, ends, scale, window), want)
            mixed = [(n, 1), (33, 33), (n, n), (9, 1)]  # the whole prompt among decode rows and a chunk
            got = _attend(batch, cache, mixed, scale, window)
            assert torch.equal(got[34 : 34 + n], whole) and torch.equal(got[:1], whole[-1:])
            assert torch.equal(got[1:34], whole[:33]) and torch.equal(got[-1:], whole[8:9])
    finally:
        torch.set_num_threads(threads)


def test_bad_calls_are_refused_before_any_work():
    batch = varlen_batch([(20, 4), (9, 1)], 4, 2, 32, 8, torch.float32, seed=1)
    kc, vc, ks, vs = _quantized(batch, "int8")
    args = _args(batch, 0)
    out = torch.full_like(batch["query"], 7.0)
    op = torch.ops.pagedgen.paged_attention_quantized
    with pytest.raises(RuntimeError, match="key_scales must be bfloat16"):
        op(out, batch["query"], kc, vc, ks.float(), vs, *args)
    with pytest.raises(RuntimeError, match=r"value_scales \[.*\] must be key_cache's"):
        op(out, batch["query"], kc, vc, ks, vs[:, :4], *args)
    with pytest.raises(RuntimeError, match="key_cache must hold int8, float8_e4m3fn or float8_e5m2 codes"):
        op(out, batch["query"], kc.float(), vc, ks, vs, *args)
    with pytest.raises(RuntimeError, match="value_cache must have key_cache's dtype"):
        op(out, batch["query"], kc, vc.view(torch.float8_e4m3fn), ks, vs, *args)
    with pytest.raises(RuntimeError, match="out and query must share one dtype"):
        op(out.bfloat16(), batch["query"], kc, vc, ks, vs, *args)
    tables = batch["block_tables"].clone()
    tables[0, 1] = kc.shape[0]
    with pytest.raises(RuntimeError, match=rf"block_tables\[0, 1\] = {kc.shape[0]} is outside the cache's blocks"):
        op(out, batch["query"], kc, vc, ks, vs, tables, *args[1:])
    assert bool((out == 7.0).all())  # nothing written
    with pytest.raises(ValueError, match="key_scales must be"):  # the Python door's ValueError
        ops.paged_attention_quantized(out, batch["query"], kc, vc, ks[:1], vs, *args)
    assert tables[1, 3] == UNUSED_BLOCK  # entries past a sequence's blocks are not read, not checked
    ops.paged_attention_quantized(out, batch["query"], kc, vc, ks, vs, batch["block_tables"], *args[1:])
    torch.library.opcheck(op, (out, batch["query"], kc, vc, ks, vs, *args))
