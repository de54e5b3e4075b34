// CPU kernel of pagedgen::reshape_and_cache_quantized (schema in csrc/ops.cpp, oracle
// pagedgen/ops/kv_quant.py's reshape_and_cache_quantized): the write of the 1-byte KV cache
// (kv_cache_dtype int8 / fp8, docs/kv_cache_dtype.md), one pass per token and KV head instead of the
// dozen PyTorch ops (and their temporaries) per layer and step of the reference.
//
//   key, value:               [num_tokens, num_kv_heads, head_size] float32 / bfloat16 / float16
//                             (any strides in the first two dimensions)
//   key_cache, value_cache:   [num_blocks, block_size, num_kv_heads, head_size] int8 / float8 codes
//   key_scales, value_scales: [num_blocks, block_size, num_kv_heads] bfloat16
//   slot_mapping:             [num_tokens] int64, < 0 = padding (skipped)
//
// Bitwise the reference's kv_quant.quantize, value by value: s = bf16(max|x| / qmax) (float32 division,
// c10's round to nearest even), q = clamp(x / s, -qmax, qmax) (0 where s is 0) as float32, then
// int8: rounded half to even (nearbyint in the default rounding mode) and cast; fp8: c10's
// conversion (torch's own). Slots are checked in a serial pass before anything is written.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "vec.h"

namespace pagedgen::cpu {
namespace {

// One head vector x[0:D] -> codes dst[0:D] and its scale.
template <typename code_t, typename scalar_t>
inline void quantize_head(const scalar_t* x, int64_t D, float qmax, code_t* dst, c10::BFloat16* scale, float* xf) {
  float amax = 0.0f;
  for (int64_t d = 0; d < D; ++d) {
    xf[d] = static_cast<float>(x[d]);
    const float a = std::fabs(xf[d]);
    amax = a > amax || a != a ? a : amax;  // a NaN stays (torch's amax): scale NaN, codes 0
  }
  const c10::BFloat16 s16(amax / qmax);
  *scale = s16;
  const float s = static_cast<float>(s16);
  for (int64_t d = 0; d < D; ++d) {
    const float q = s > 0.0f ? std::clamp(xf[d] / s, -qmax, qmax) : 0.0f;
    if constexpr (std::is_same_v<code_t, int8_t>) {
      dst[d] = static_cast<int8_t>(std::nearbyint(q));
    } else {
      dst[d] = code_t(q);
    }
  }
}

template <typename code_t, typename scalar_t>
void write_codes(const at::Tensor& x, const at::Tensor& cache, const at::Tensor& scales, const int64_t* slots,
                 float qmax) {
  const int64_t num_tokens = x.size(0), H = x.size(1), D = x.size(2);
  const scalar_t* src = x.const_data_ptr<scalar_t>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  code_t* codes = static_cast<code_t*>(cache.data_ptr());
  c10::BFloat16* scl = scales.data_ptr<c10::BFloat16>();
  at::parallel_for(0, num_tokens, std::max<int64_t>(1, 4096 / std::max<int64_t>(1, H * D)), [&](int64_t begin, int64_t end) {
    std::vector<float> xf(D);
    for (int64_t i = begin; i < end; ++i) {
      if (slots[i] < 0) continue;  // padding
      for (int64_t h = 0; h < H; ++h) {
        const int64_t row = slots[i] * H + h;  // (slot, head) in the cache
        quantize_head<code_t>(src + i * s0 + h * s1, D, qmax, codes + row * D, scl + row, xf.data());
      }
    }
  });
}

void reshape_and_cache_quantized_cpu(const at::Tensor& key,           // [num_tokens, num_kv_heads, head_size]
                                     const at::Tensor& value,         // [num_tokens, num_kv_heads, head_size]
                                     const at::Tensor& key_cache,     // [num_blocks, block_size, Hkv, D] codes
                                     const at::Tensor& value_cache,   // the same
                                     const at::Tensor& key_scales,    // [num_blocks, block_size, Hkv] bf16
                                     const at::Tensor& value_scales,  // the same
                                     const at::Tensor& slot_mapping) {  // [num_tokens] int64
  const char* op = "reshape_and_cache_quantized";
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(), op,
              ": key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, head_size], got ",
              key_cache.sizes(), " and ", value_cache.sizes());
  const auto ct = key_cache.scalar_type();
  TORCH_CHECK((ct == at::kChar || ct == at::kFloat8_e4m3fn || ct == at::kFloat8_e5m2) && value_cache.scalar_type() == ct,
              op, ": key_cache and value_cache must be int8, float8_e4m3fn or float8_e5m2 codes of one dtype, got ", ct,
              " and ", value_cache.scalar_type());
  for (const at::Tensor* s : {&key_scales, &value_scales}) {
    TORCH_CHECK(s->sizes() == key_cache.sizes().slice(0, 3) && s->scalar_type() == at::kBFloat16 && s->is_contiguous(),
                op, ": key_scales and value_scales must be contiguous bfloat16 ", key_cache.sizes().slice(0, 3), ", got ",
                s->sizes(), " ", s->scalar_type());
  }
  TORCH_CHECK(key.dim() == 3 && key.size(1) == key_cache.size(2) && key.size(2) == key_cache.size(3) &&
                  value.sizes() == key.sizes(),
              op, ": key and value must be [num_tokens, num_kv_heads=", key_cache.size(2),
              ", head_size=", key_cache.size(3), "], got ", key.sizes(), " and ", value.sizes());
  TORCH_CHECK(key.scalar_type() == value.scalar_type(), op, ": key and value must share one dtype, got ",
              key.scalar_type(), " and ", value.scalar_type());
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0) && slot_mapping.scalar_type() == at::kLong,
              op, ": slot_mapping must be [num_tokens=", key.size(0), "] int64, got ", slot_mapping.sizes(), " ",
              slot_mapping.scalar_type());
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), op, ": the caches must be contiguous");
  for (const at::Tensor* t : {&key, &value, &value_cache, &key_scales, &value_scales, &slot_mapping}) {
    TORCH_CHECK(t->is_cpu() && key_cache.is_cpu(), op, ": all tensors must be on the CPU");
  }
  const at::Tensor slots_t = slot_mapping.contiguous();
  const int64_t* slots = slots_t.const_data_ptr<int64_t>();
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  for (int64_t i = 0; i < slots_t.size(0); ++i) {
    TORCH_CHECK(slots[i] < num_slots, op, ": slot_mapping[", i, "] = ", slots[i], " is outside the cache's ",
                num_slots, " slots");
  }
  if (key.size(0) == 0 || key.numel() == 0) return;
  const auto prepare = [](const at::Tensor& t) { return t.stride(2) == 1 ? t : t.contiguous(); };
  const at::Tensor k = prepare(key), v = prepare(value);
  dispatch_float_types(key.scalar_type(), op, [&](auto zero) {
    using scalar_t = decltype(zero);
    const auto both = [&](auto code_zero, float qmax) {
      using code_t = decltype(code_zero);
      write_codes<code_t, scalar_t>(k, key_cache, key_scales, slots, qmax);
      write_codes<code_t, scalar_t>(v, value_cache, value_scales, slots, qmax);
    };
    if (ct == at::kChar) return both(int8_t{}, 127.0f);
    if (ct == at::kFloat8_e4m3fn) return both(c10::Float8_e4m3fn{}, 448.0f);
    return both(c10::Float8_e5m2{}, 57344.0f);
  });
}

}  // namespace
}  // namespace pagedgen::cpu

TORCH_LIBRARY_IMPL(pagedgen, CPU, m) {
  m.impl("reshape_and_cache_quantized", &pagedgen::cpu::reshape_and_cache_quantized_cpu);
}
