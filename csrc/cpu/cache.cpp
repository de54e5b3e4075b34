// CPU kernels of the paged KV-cache ops (schemas in csrc/ops.cpp, oracles in
// pagedgen/ops/reference.py): reshape_and_cache, copy_blocks and swap_blocks.
//
// All three only move whole rows or blocks, so they copy bytes (memcpy) and need no per-dtype code:
// copy_blocks and swap_blocks take any dtype shared by both sides of a copy, reshape_and_cache the
// float dtypes of the CUDA kernel (it converts key/value to the cache dtype first, as the reference
// does). The arguments' metadata is checked by csrc/op_checks.h, the same checks as the CUDA kernels';
// the indices (slots, block ids) are then validated here in a serial pass before the parallel copy,
// so that no error has to be raised from inside a parallel region. Copies run in
// parallel with at::parallel_for (torch's OpenMP pool, honours torch.set_num_threads).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../op_checks.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace pagedgen {
namespace {

// block_mapping: [num_pairs, 2] int64 on the CPU (checked by the shared checks); checks every index and
// returns a contiguous copy.
at::Tensor checked_mapping(const at::Tensor& block_mapping, int64_t num_src, int64_t num_dst, const char* op) {
  at::Tensor mapping = block_mapping.contiguous();
  checks::block_mapping_values(op, mapping.const_data_ptr<int64_t>(), mapping.size(0), num_src, num_dst);
  return mapping;
}

void reshape_and_cache_cpu(const at::Tensor& key,       // [num_tokens, num_kv_heads, head_size]
                           const at::Tensor& value,     // [num_tokens, num_kv_heads, head_size]
                           const at::Tensor& key_cache,       // [num_blocks, block_size, num_kv_heads, head_size]
                           const at::Tensor& value_cache,     // [num_blocks, block_size, num_kv_heads, head_size]
                           const at::Tensor& slot_mapping) {  // [num_tokens] int64, < 0 = padding
  checks::reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, c10::DeviceType::CPU);
  const int64_t num_blocks = key_cache.size(0), block_size = key_cache.size(1);
  const int64_t num_kv_heads = key_cache.size(2), head_size = key_cache.size(3);
  const int64_t num_tokens = key.size(0);
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
  checks::copy_blocks(key_cache, value_cache, block_mapping, c10::DeviceType::CPU);
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
  checks::swap_blocks(src, dst, block_mapping, c10::DeviceType::CPU);
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
