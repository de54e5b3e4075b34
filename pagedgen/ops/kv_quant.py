"""The 1-byte KV cache (``LLM(kv_cache_dtype="int8" | "fp8" | "fp8_e4m3" | "fp8_e5m2")``, docs/kv_cache_dtype.md).

Layout of one layer (the float cache's, plus one scale per token and KV head in a side tensor):

    key_cache, value_cache:   [num_blocks, block_size, num_kv_heads, head_size]  int8 / float8 codes
    key_scales, value_scales: [num_blocks, block_size, num_kv_heads]             bfloat16

A token's head vector x (head_size floats) is stored as codes q and a scale s with
``s = bf16(max|x| / qmax)`` and ``q = quantize(clamp(x / s, -qmax, qmax))`` (int8: round half to
even, qmax 127; fp8: the float8 conversion, qmax 448 for e4m3 and 57344 for e5m2); it is read back
as ``x' = float(q) * float(s)``. Each stored value depends on that token's own
vector only: not on the other tokens of its block, nor on the step it was written in, nor on the
batch. So a cached prefix reads the same whoever wrote it (prefix caching, copy-on-write and swap
move codes and scales together, byte for byte), and batch invariance holds as for the float cache.
Why not one scale per (block, head) grown as tokens arrive: a block prefilled in one chunk would get
another scale, and other codes for its first tokens, than the same block decoded token by token.

A block costs ``block_size * num_kv_heads * (head_size + 2)`` bytes per layer for keys and as much
for values: 66 / 128 = 0.52 of a bfloat16 cache's for head_size 64 (1.94x the blocks in the same
memory), 0.51 for head_size 128; a quarter and a bit of a float32 cache's.

The read: the attention computes in float32 over the values ``float(q) * float(s)`` (not rounded to
the model's dtype). On the CPU a kernel does the write in one pass (``ops.reshape_and_cache_quantized``,
csrc/cpu/kv_quantize.cpp, the same bytes as ``reshape_and_cache_quantized`` below, its oracle), and
the attention kernel reads the codes and scales itself (``ops.paged_attention_quantized``,
csrc/cpu/attention*.h with csrc/cpu/kv_codes.h: K and V as float(code) in registers, each token's
scales applied to its scores and weights, no copy of the blocks; its per-row arithmetic is fixed, so
batch invariance holds as for the float cache). ``paged_attention_quantized`` below is the copy path,
the oracle of that kernel and its fallback where it is not built: it finds the blocks the step's
block tables name (each once, ``gather_plan``), dequantizes them into a compact float32 cache
(``ops.kv_dequantize_blocks``) and runs a float attention op over it in float32, the table
renumbered. The engine refuses the 1-byte cache on a GPU for now (no CUDA kernel reads it;
``torch.unique`` would sync and CUDA graphs could not capture it).
"""
from __future__ import annotations

from typing import Optional

import torch

#: kv_cache_dtype -> (torch dtype of the codes, largest code magnitude); "fp8" is e4m3, as in vLLM.
KV_CACHE_DTYPES = {
    "int8": (torch.int8, 127.0),
    "fp8": (torch.float8_e4m3fn, 448.0),
    "fp8_e4m3": (torch.float8_e4m3fn, 448.0),
    "fp8_e5m2": (torch.float8_e5m2, 57344.0),
}
_QMAX = {d: m for d, m in KV_CACHE_DTYPES.values()}  # code dtype -> largest code magnitude
#: dtype of the per-(token, KV head) scales
SCALE_DTYPE = torch.bfloat16
#: every accepted kv_cache_dtype, "auto" (the model's dtype) first
CHOICES = ("auto",) + tuple(KV_CACHE_DTYPES)


def check_kv_cache_dtype(name) -> str:
    """``name`` if it is one of ``CHOICES``; TypeError for a non-str, ValueError naming the choices."""
    if not isinstance(name, str):
        raise TypeError(f"LLM kv_cache_dtype must be a str, one of {CHOICES}, got {type(name).__name__}")
    if name not in CHOICES:
        raise ValueError(f"LLM kv_cache_dtype must be one of {CHOICES}, got {name!r}")
    return name


def allocate(kv_cache_dtype: str, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
             device, pin_memory: bool = False) -> tuple:
    """One layer's cache, uninitialised (pages backed on first touch): (key_cache, value_cache) of
    ``dtype`` for "auto", else (key_cache, value_cache, key_scales, value_scales) as in the module
    docstring."""
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    if kv_cache_dtype == "auto":
        return tuple(torch.empty(shape, dtype=dtype, device=device, pin_memory=pin_memory) for _ in range(2))
    code = KV_CACHE_DTYPES[kv_cache_dtype][0]
    caches = tuple(torch.empty(shape, dtype=code, device=device, pin_memory=pin_memory) for _ in range(2))
    scales = tuple(torch.empty(shape[:3], dtype=SCALE_DTYPE, device=device, pin_memory=pin_memory) for _ in range(2))
    return caches + scales


def quantize(x: torch.Tensor, code_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_size] (any float dtype) -> (codes [..., head_size] of ``code_dtype``, scales [...]
    bfloat16): one scale per vector, ``max|x| / qmax`` (a zero vector: scale 0, codes 0). ValueError
    for a ``code_dtype`` other than int8, float8_e4m3fn and float8_e5m2."""
    qmax = _QMAX.get(code_dtype)
    if qmax is None:
        raise ValueError(f"1-byte KV cache: codes must be int8, float8_e4m3fn or float8_e5m2, got {code_dtype}")
    xf = x.float()
    scales = (xf.abs().amax(dim=-1) / qmax).to(SCALE_DTYPE)  # [...]
    s = scales.float().unsqueeze(-1)
    q = torch.where(s > 0, xf / s, torch.zeros((), dtype=xf.dtype, device=xf.device)).clamp_(-qmax, qmax)
    if code_dtype == torch.int8:
        q = q.round_()  # half to even
    return q.to(code_dtype), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes [..., head_size], scales [...] -> ``float(codes) * float(scales)`` rounded to ``dtype``
    (float32: the values the attention reads)."""
    return (codes.float() * scales.float().unsqueeze(-1)).to(dtype)


def reshape_and_cache_quantized(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size] codes, written
    value_cache: torch.Tensor,
    key_scales: torch.Tensor,  # [num_blocks, block_size, num_kv_heads] bfloat16, written
    value_scales: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64, < 0 = padding (skipped)
) -> None:
    """Quantize each token's keys and values (module docstring) into its slot of the 1-byte cache.

    Raises:
        ValueError: a cache whose dtype is not one of ``KV_CACHE_DTYPES``', scales of another shape
            than the cache's first three dimensions, or a slot past the cache.
    """
    num_blocks, block_size, num_kv_heads, head_size = key_cache.shape
    check_write(key_cache, value_cache, key_scales, value_scales, slot_mapping)
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    for x, cache, scale_cache in ((key, key_cache, key_scales), (value, value_cache, value_scales)):
        codes, scales = quantize(x[valid], cache.dtype)
        cache.view(-1, num_kv_heads, head_size)[slots] = codes
        scale_cache.view(-1, num_kv_heads)[slots] = scales


def paged_attention_quantized(
    attention,  # the float op: pagedgen.ops.paged_attention (or the reference), same arguments
    dequantize_blocks,  # pagedgen.ops.kv_dequantize_blocks (or the reference): (out, codes, scales, blocks)
    out: torch.Tensor,  # [num_tokens, num_heads, head_size], written
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size] codes
    value_cache: torch.Tensor,
    key_scales: torch.Tensor,  # [num_blocks, block_size, num_kv_heads] bfloat16
    value_scales: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    sliding_window: int = 0,
    gathered: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> None:
    """``attention`` in float32 over the dequantized cache: the same result as dequantizing the whole
    cache to float32 and calling ``attention`` on it with a float32 query (the oracle of the CPU
    kernel), rounded to ``out``'s dtype once, reading only the blocks the tables name for ``seq_lens``. ``gathered``: ``gather_plan``'s answer for these
    tables, when the caller computed it once for all layers of the step.

    Raises:
        ValueError: as ``reshape_and_cache_quantized`` for the caches and scales; ``attention``
            raises its own errors for the other arguments.
    """
    check_layout(key_cache, value_cache, key_scales, value_scales)
    blocks, tables = gathered if gathered is not None else gather_plan(block_tables, seq_lens, key_cache.shape[1])
    keys = torch.empty((blocks.shape[0],) + key_cache.shape[1:], dtype=torch.float32, device=query.device)  # [U, block_size, Hkv, D]
    values = torch.empty_like(keys)
    dequantize_blocks(keys, key_cache, key_scales, blocks)
    dequantize_blocks(values, value_cache, value_scales, blocks)
    result = out if out.dtype == torch.float32 else torch.empty(out.shape, dtype=torch.float32, device=out.device)
    attention(result, query.float(), keys, values, tables, seq_lens, query_start_loc, scale, sliding_window)
    if result is not out:
        out.copy_(result)


def gather_plan(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks a step reads and its tables renumbered over them: (blocks [U] int64, each block
    of the tables' first ``ceil(seq_lens[s] / block_size)`` entries once, ascending; tables
    [num_seqs, max_blocks_per_seq] int32, ``blocks[tables[s, j]] == block_tables[s, j]`` for the
    entries read, 0 elsewhere). The same for every layer of a step."""
    num_seqs, width = block_tables.shape
    used = torch.arange(width, device=block_tables.device)[None, :] * block_size < seq_lens.long()[:, None]  # [S, width]
    blocks, inverse = torch.unique(block_tables[used].long(), return_inverse=True)
    if blocks.numel() == 0:  # nothing is read (sequences of seq_len 0): one block keeps the shapes valid
        blocks = torch.zeros(1, dtype=torch.int64, device=block_tables.device)
    tables = torch.zeros_like(block_tables)
    tables[used] = inverse.to(block_tables.dtype)
    return blocks, tables


def check_write(key_cache, value_cache, key_scales, value_scales, slot_mapping) -> None:
    """``check_layout``, and ValueError for a slot of ``slot_mapping`` past the cache."""
    check_layout(key_cache, value_cache, key_scales, value_scales)
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    if slot_mapping.numel() and int(slot_mapping.max()) >= num_slots:
        raise ValueError(f"reshape_and_cache_quantized: a slot of slot_mapping is past the cache's {num_slots} slots")


def check_layout(key_cache, value_cache, key_scales, value_scales) -> None:
    """ValueError unless key_cache / value_cache are int8 / float8 codes of one dtype and one shape
    [num_blocks, block_size, num_kv_heads, head_size] and key_scales / value_scales
    [num_blocks, block_size, num_kv_heads] bfloat16 (the message names the tensor)."""
    if key_cache.dtype not in _QMAX or value_cache.dtype != key_cache.dtype:
        raise ValueError(f"1-byte KV cache: key_cache and value_cache must be int8 or float8 of one dtype, got "
                         f"{key_cache.dtype} and {value_cache.dtype}")
    if key_cache.dim() != 4 or value_cache.shape != key_cache.shape:
        raise ValueError(f"1-byte KV cache: key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} "
                         "must both be [num_blocks, block_size, num_kv_heads, head_size]")
    for name, s in (("key_scales", key_scales), ("value_scales", value_scales)):
        if s.shape != key_cache.shape[:3] or s.dtype != SCALE_DTYPE:
            raise ValueError(f"1-byte KV cache: {name} must be [num_blocks, block_size, num_kv_heads] "
                             f"{tuple(key_cache.shape[:3])} {SCALE_DTYPE}, got {tuple(s.shape)} {s.dtype}")
