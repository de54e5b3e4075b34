// CPU kernel of pagedgen::kv_dequantize_blocks (schema in csrc/ops.cpp, oracle in
// pagedgen/ops/reference.py): the read of the 1-byte KV cache (kv_cache_dtype int8 / fp8,
// pagedgen/ops/kv_quant.py, docs/kv_cache_dtype.md). The blocks a step reads are copied out of the
// 1-byte cache into a compact cache of the model's dtype, each value float(code) * float(scale)
// rounded once, in one pass (torch's gather, convert, multiply and convert run four).
//
//   out:    [num_out, block_size, num_kv_heads, head_size] float32 / bfloat16 / float16, contiguous
//   codes:  [num_blocks, block_size, num_kv_heads, head_size] int8 / float8_e4m3fn / float8_e5m2, contiguous
//   scales: [num_blocks, block_size, num_kv_heads] bfloat16, contiguous
//   blocks: [num_out] int64, each in [0, num_blocks): out[u] is codes[blocks[u]] dequantized
//
// Each output element depends on its code and its row's scale only, with the rounding of torch's
// `(codes.float() * scales.float()[..., None]).to(dtype)` (a float32 product, rounded as c10 does):
// bitwise the reference, whatever the blocks or the threads. The conversion is the attention
// kernel's (kv_codes.h), so this op's tests over all 256 codes check the kernel's bit tricks too.
// The engine no longer calls it (paged_attention_quantized reads the codes itself); it serves the
// copy path of kv_quant.paged_attention_quantized where only the reference attention runs.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <torch/library.h>

#include <cstdint>

#include "kv_codes.h"
#include "vec.h"

namespace pagedgen::cpu {
namespace {

// One row (head_size values of one token and KV head): dst[d] = dtype(float(src[d]) * s), through
// the attention kernel's own conversion (kv_codes.h: tmp holds the values already rounded to
// scalar_t, so the store is exact).
template <typename code_t, typename scalar_t>
inline void dequantize_out_row(const code_t* src, float s, scalar_t* dst, int64_t D, float* tmp) {
  dequantize_row<scalar_t>(src, s, tmp, static_cast<int>(D));
  if constexpr (std::is_same_v<scalar_t, float>) {
    std::memcpy(dst, tmp, D * sizeof(float));
  } else {
    int64_t d = 0;
    for (; d + kLanes <= D; d += kLanes) store<kLanes>(dst + d, load<kLanes>(tmp + d));
    for (; d < D; ++d) dst[d] = static_cast<scalar_t>(tmp[d]);
  }
}

template <typename code_t, typename scalar_t>
void dequantize_blocks(const at::Tensor& out, const at::Tensor& codes, const at::Tensor& scales, const int64_t* blocks,
                       int64_t num_out) {
  const int64_t block_size = codes.size(1), num_kv_heads = codes.size(2), D = codes.size(3);
  const int64_t rows_per_block = block_size * num_kv_heads;
  const code_t* src = static_cast<const code_t*>(codes.const_data_ptr());
  const c10::BFloat16* scl = scales.const_data_ptr<c10::BFloat16>();
  scalar_t* dst = static_cast<scalar_t*>(out.data_ptr());
  const int64_t total = num_out * rows_per_block;
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, D));
  at::parallel_for(0, total, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(D);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t u = r / rows_per_block, within = r % rows_per_block;
      const int64_t row = blocks[u] * rows_per_block + within;  // the source row in codes / scales
      dequantize_out_row(src + row * D, static_cast<float>(scl[row]), dst + r * D, D, tmp.data());
    }
  });
}

void kv_dequantize_blocks_cpu(const at::Tensor& out,     // [num_out, block_size, num_kv_heads, head_size]
                              const at::Tensor& codes,   // [num_blocks, block_size, num_kv_heads, head_size]
                              const at::Tensor& scales,  // [num_blocks, block_size, num_kv_heads] bf16
                              const at::Tensor& blocks) {  // [num_out] int64
  const char* op = "kv_dequantize_blocks";
  TORCH_CHECK(codes.dim() == 4, op, ": codes must be [num_blocks, block_size, num_kv_heads, head_size], got ", codes.sizes());
  TORCH_CHECK(scales.sizes() == codes.sizes().slice(0, 3), op, ": scales ", scales.sizes(),
              " must be codes' [num_blocks, block_size, num_kv_heads] ", codes.sizes().slice(0, 3));
  TORCH_CHECK(blocks.dim() == 1, op, ": blocks must be [num_out], got ", blocks.sizes());
  TORCH_CHECK(out.dim() == 4 && out.size(0) == blocks.size(0) && out.sizes().slice(1) == codes.sizes().slice(1), op,
              ": out ", out.sizes(), " must be [num_out = ", blocks.size(0), ", ", codes.sizes().slice(1), "]");
  const auto ct = codes.scalar_type();
  TORCH_CHECK(ct == at::kChar || ct == at::kFloat8_e4m3fn || ct == at::kFloat8_e5m2, op,
              ": codes must be int8, float8_e4m3fn or float8_e5m2, got ", ct);
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16, op, ": scales must be bfloat16, got ", scales.scalar_type());
  TORCH_CHECK(blocks.scalar_type() == at::kLong, op, ": blocks must be int64, got ", blocks.scalar_type());
  TORCH_CHECK(out.is_contiguous() && codes.is_contiguous() && scales.is_contiguous(), op,
              ": out, codes and scales must be contiguous");
  TORCH_CHECK(out.is_cpu() && codes.is_cpu() && scales.is_cpu() && blocks.is_cpu(), op, ": all tensors must be on the CPU");
  const at::Tensor ids = blocks.contiguous();
  const int64_t* b = ids.const_data_ptr<int64_t>();
  const int64_t num_out = ids.size(0), num_blocks = codes.size(0);
  for (int64_t u = 0; u < num_out; ++u) {
    TORCH_CHECK(b[u] >= 0 && b[u] < num_blocks, op, ": blocks[", u, "] = ", b[u], " is outside [0, ", num_blocks, ")");
  }
  if (out.numel() == 0) return;
  dispatch_float_types(out.scalar_type(), op, [&](auto zero) {
    using scalar_t = decltype(zero);
    if (ct == at::kChar) return dequantize_blocks<int8_t, scalar_t>(out, codes, scales, b, num_out);
    if (ct == at::kFloat8_e4m3fn) return dequantize_blocks<c10::Float8_e4m3fn, scalar_t>(out, codes, scales, b, num_out);
    return dequantize_blocks<c10::Float8_e5m2, scalar_t>(out, codes, scales, b, num_out);
  });
}

}  // namespace
}  // namespace pagedgen::cpu

TORCH_LIBRARY_IMPL(pagedgen, CPU, m) { m.impl("kv_dequantize_blocks", &pagedgen::cpu::kv_dequantize_blocks_cpu); }
