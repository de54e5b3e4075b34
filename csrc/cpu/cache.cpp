// CPU kernels of the paged KV-cache ops (schemas in csrc/ops.cpp, oracles in
// pagedgen/ops/reference.py): reshape_and_cache, copy_blocks and swap_blocks.
//
// All three only move whole rows or blocks, so they copy bytes (memcpy) and need no per-dtype code;
// any dtype works, with both sides of a copy sharing it (reshape_and_cache converts key/value to the
// cache dtype first, as the reference does). Indices are validated in a serial pass before the
// parallel copy, so that no error has to be raised from inside a parallel region. Copies run in
// parallel with at::parallel_for (torch's OpenMP pool, honours torch.set_num_threads).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace pagedgen {
namespace {

void check_cpu(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), op, " (CPU kernel): ", name, " must be on the CPU, got ", t.device());
}

// block_mapping: [num_pairs, 2] int64 (src, dst); checks every index and returns a contiguous copy.
at::Tensor checked_mapping(const at::Tensor& block_mapping, int64_t num_src, int64_t num_dst, const char* op) {
  check_cpu(block_mapping, op, "block_mapping");
  TORCH_CHECK(block_mapping.scalar_type() == at::kLong && block_mapping.dim() == 2 && block_mapping.size(1) == 2,
              op, ": block_mapping must be int64 [num_pairs, 2], got ", block_mapping.scalar_type(), " ",
              block_mapping.sizes());
  at::Tensor mapping = block_mapping.contiguous();
  const int64_t* pairs = mapping.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < mapping.size(0); ++i) {
    TORCH_CHECK(pairs[2 * i] >= 0 && pairs[2 * i] < num_src, op, ": block_mapping[", i, "] source block ",
                pairs[2 * i], " is outside [0, ", num_src, ")");
    TORCH_CHECK(pairs[2 * i + 1] >= 0 && pairs[2 * i + 1] < num_dst, op, ": block_mapping[", i,
                "] destination block ", pairs[2 * i + 1], " is outside [0, ", num_dst, ")");
  }
  return mapping;
}

void reshape_and_cache_cpu(const at::Tensor& key,       // [num_tokens, num_kv_heads, head_size]
                           const at::Tensor& value,     // [num_tokens, num_kv_heads, head_size]
                           const at::Tensor& key_cache,       // [num_blocks, block_size, num_kv_heads, head_size]
                           const at::Tensor& value_cache,     // [num_blocks, block_size, num_kv_heads, head_size]
                           const at::Tensor& slot_mapping) {  // [num_tokens] int64, < 0 = padding
  const char* op = "reshape_and_cache";
  check_cpu(key, op, "key");
  check_cpu(value, op, "value");
  check_cpu(key_cache, op, "key_cache");
  check_cpu(value_cache, op, "value_cache");
  check_cpu(slot_mapping, op, "slot_mapping");
  TORCH_CHECK(key_cache.dim() == 4,
              "reshape_and_cache: key_cache must be [num_blocks, block_size, num_kv_heads, head_size], got ",
              key_cache.sizes());
  TORCH_CHECK(value_cache.sizes() == key_cache.sizes() && value_cache.scalar_type() == key_cache.scalar_type(),
              "reshape_and_cache: value_cache (", value_cache.scalar_type(), " ", value_cache.sizes(),
              ") must match key_cache (", key_cache.scalar_type(), " ", key_cache.sizes(), ")");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(),
              "reshape_and_cache: key_cache and value_cache must be contiguous");
  const int64_t num_blocks = key_cache.size(0), block_size = key_cache.size(1);
  const int64_t num_kv_heads = key_cache.size(2), head_size = key_cache.size(3);
  TORCH_CHECK(key.dim() == 3 && key.size(1) == num_kv_heads && key.size(2) == head_size,
              "reshape_and_cache: key must be [num_tokens, num_kv_heads=", num_kv_heads, ", head_size=", head_size,
              "], got ", key.sizes());
  TORCH_CHECK(value.sizes() == key.sizes(), "reshape_and_cache: value ", value.sizes(), " must match key ",
              key.sizes());
  const int64_t num_tokens = key.size(0);
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == num_tokens,
              "reshape_and_cache: slot_mapping must be int64 [num_tokens=", num_tokens, "], got ",
              slot_mapping.scalar_type(), " ", slot_mapping.sizes());
  if (num_tokens == 0) return;

  // key/value may be strided views (e.g. of a qkv projection); each head row must be contiguous, which
  // .contiguous() guarantees when it is not already (a copy only in that case). Same for the dtype.
  auto prepare = [&](const at::Tensor& t) {
    at::Tensor r = t.scalar_type() == key_cache.scalar_type() ? t : t.to(key_cache.scalar_type());
    return r.stride(2) == 1 ? r : r.contiguous();
  };
  const at::Tensor k = prepare(key), v = prepare(value);
  const at::Tensor slots_t = slot_mapping.contiguous();
  const int64_t* slots = slots_t.const_data_ptr<int64_t>();
  const int64_t num_slots = num_blocks * block_size;
  for (int64_t i = 0; i < num_tokens; ++i) {
    TORCH_CHECK(slots[i] < num_slots, "reshape_and_cache: slot_mapping[", i, "] = ", slots[i],
                " is outside the cache's ", num_slots, " slots");
  }

  const int64_t elem = key_cache.element_size();
  const int64_t row_bytes = head_size * elem;                   // one head of one token
  const int64_t slot_elems = num_kv_heads * head_size;         // one token in the cache
  const char* k_src = static_cast<const char*>(k.const_data_ptr());
  const char* v_src = static_cast<const char*>(v.const_data_ptr());
  char* k_dst = static_cast<char*>(key_cache.data_ptr());
  char* v_dst = static_cast<char*>(value_cache.data_ptr());
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
  const bool heads_contiguous = ks1 == head_size && vs1 == head_size;
  at::parallel_for(0, num_tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t slot = slots[i];
      if (slot < 0) continue;  // padding
      if (heads_contiguous) {  // the token's heads are one run in key and value: one copy each
        std::memcpy(k_dst + slot * slot_elems * elem, k_src + i * ks0 * elem, slot_elems * elem);
        std::memcpy(v_dst + slot * slot_elems * elem, v_src + i * vs0 * elem, slot_elems * elem);
        continue;
      }
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const int64_t dst = (slot * slot_elems + h * head_size) * elem;
        std::memcpy(k_dst + dst, k_src + (i * ks0 + h * ks1) * elem, row_bytes);
        std::memcpy(v_dst + dst, v_src + (i * vs0 + h * vs1) * elem, row_bytes);
      }
    }
  });
}

// Copies block_bytes-sized blocks src[pair[0]] -> dst[pair[1]] for every pair, in parallel.
void copy_block_pairs(const char* src, char* dst, int64_t block_bytes, const at::Tensor& mapping) {
  const int64_t* pairs = mapping.const_data_ptr<int64_t>();
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, block_bytes));
  at::parallel_for(0, mapping.size(0), grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      std::memcpy(dst + pairs[2 * i + 1] * block_bytes, src + pairs[2 * i] * block_bytes, block_bytes);
    }
  });
}

// Blocks must not overlap between pairs (a destination that is also a source, or twice a destination):
// pairs are copied in parallel. Copy-on-write guarantees this (each destination is a fresh block).
void copy_blocks_cpu(const at::Tensor& key_cache,     // [num_blocks, block_size, num_kv_heads, head_size]
                     const at::Tensor& value_cache,   // [num_blocks, block_size, num_kv_heads, head_size]
                     const at::Tensor& block_mapping) {  // [num_pairs, 2] int64 (src, dst)
  const char* op = "copy_blocks";
  check_cpu(key_cache, op, "key_cache");
  check_cpu(value_cache, op, "value_cache");
  TORCH_CHECK(key_cache.dim() >= 1 && value_cache.dim() >= 1 && key_cache.size(0) == value_cache.size(0),
              "copy_blocks: key_cache ", key_cache.sizes(), " and value_cache ", value_cache.sizes(),
              " must have the same number of blocks");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(),
              "copy_blocks: key_cache and value_cache must be contiguous");
  const int64_t num_blocks = key_cache.size(0);
  const at::Tensor mapping = checked_mapping(block_mapping, num_blocks, num_blocks, op);
  if (mapping.size(0) == 0 || num_blocks == 0) return;
  for (const at::Tensor* cache : {&key_cache, &value_cache}) {
    const int64_t block_bytes = cache->numel() / num_blocks * cache->element_size();
    char* base = static_cast<char*>(cache->data_ptr());
    copy_block_pairs(base, base, block_bytes, mapping);
  }
}

void swap_blocks_cpu(const at::Tensor& src,  // [num_blocks_src, ...] one layer's key or value cache
                     const at::Tensor& dst,        // [num_blocks_dst, ...] same trailing shape and dtype
                     const at::Tensor& block_mapping) {  // [num_pairs, 2] int64 (src block, dst block)
  const char* op = "swap_blocks";
  check_cpu(src, op, "src");
  check_cpu(dst, op, "dst");
  TORCH_CHECK(src.dim() >= 1 && src.dim() == dst.dim() && src.sizes().slice(1) == dst.sizes().slice(1),
              "swap_blocks: src ", src.sizes(), " and dst ", dst.sizes(), " must share their block shape");
  TORCH_CHECK(src.scalar_type() == dst.scalar_type(), "swap_blocks: src dtype ", src.scalar_type(),
              " != dst dtype ", dst.scalar_type());
  TORCH_CHECK(src.is_contiguous() && dst.is_contiguous(), "swap_blocks: src and dst must be contiguous");
  const at::Tensor mapping = checked_mapping(block_mapping, src.size(0), dst.size(0), op);
  if (mapping.size(0) == 0) return;
  const int64_t block_bytes = src.numel() / src.size(0) * src.element_size();
  copy_block_pairs(static_cast<const char*>(src.const_data_ptr()), static_cast<char*>(dst.data_ptr()),
                   block_bytes, mapping);
}

}  // namespace
}  // namespace pagedgen

TORCH_LIBRARY_IMPL(pagedgen, CPU, m) {
  m.impl("reshape_and_cache", &pagedgen::reshape_and_cache_cpu);
  m.impl("copy_blocks", &pagedgen::copy_blocks_cpu);
  m.impl("swap_blocks", &pagedgen::swap_blocks_cpu);
}
