// What every kernel of pagedgen::int8_linear's family shares (the AVX2 tiles, csrc/cpu/linear_int8.cpp;
// the AMX-INT8 tiles and their emulation, csrc/cpu/linear_int8_amx.h): the argument checks (run first,
// before any pointer is read), the prologue's quantization of a row, and the write-back of a panel row.
// Written once so that the paths give the same bits: integer sums are exact in any order, and the
// quantization and the write-back are these functions, the same float32 operations in the same order
// (-ffp-contract=off): out = float32(acc) * x_scale[m] * weight_scale[n] (+ bias[n]), rounded once.
#pragma once

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "linear_panel.h"
#include "vec.h"

namespace pagedgen::cpu::int8_gemm {  // its own namespace: the unity build (csrc/cpu_kernels.cpp) shares one with linear.cpp
namespace {

constexpr int kPanel = 16;         // output features per panel
constexpr int64_t kMaxK = 132104;  // 2^31 / (128 * 127): int32 sums cannot overflow below this

// A row's scale, in float32: the static one, else max |x| / 127 (1 for a row of zeros).
template <typename in_t>
inline float row_scale(const in_t* x, int64_t K, const float* static_scale) {
  if (static_scale != nullptr) return *static_scale;
  float amax = 0.0f;
  for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(static_cast<float>(x[k])));
  const float s = amax / 127.0f;
  return s > 0.0f ? s : 1.0f;
}

// One value quantized: clamp(rint(x / s), -128, 127), round half to even (the default mode).
template <typename in_t>
inline int quantize(in_t x, float s) {
  const float v = std::nearbyint(static_cast<float>(x) / s);
  return static_cast<int>(std::min(std::max(v, -128.0f), 127.0f));
}

// The sizes of a checked call, its bias as float32 [N] (undefined when none) and its static scale.
struct Call {
  int64_t M, K, N, P, Q;
  at::Tensor bias;
  bool has_static;
  float static_scale;
};

// out [M, N] (input's dtype, contiguous non-overlapping rows), input [M, K] float32 / bfloat16 /
// float16 with contiguous rows, K < kMaxK, weight [ceil(N / 16), ceil(K / 2), 16, 2] int8 contiguous,
// weight_scale [N] float32 contiguous, input_scale [1] float32 or None, bias [N] float or None; all on
// the CPU. `name` opens every message.
inline Call check(const char* name, const at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                  const at::Tensor& weight_scale, const c10::optional<at::Tensor>& input_scale,
                  const c10::optional<at::Tensor>& bias) {
  const auto is_float = [](c10::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; };
  TORCH_CHECK(out.device().is_cpu() && input.device().is_cpu() && weight.device().is_cpu() && weight_scale.device().is_cpu(),
              name, " (CPU kernel): tensors must be on the CPU");
  TORCH_CHECK(is_float(input.scalar_type()) && input.dim() == 2 && input.stride(1) == 1,
              name, ": input must be float32, bfloat16 or float16 [M, K] with contiguous rows, got ", input.scalar_type(), " ",
              input.sizes(), " strides ", input.strides());
  const int64_t M = input.size(0), K = input.size(1), Q = (K + 1) / 2;
  TORCH_CHECK(K < kMaxK, name, ": K = ", K, " input features would overflow the int32 sums (at most ", kMaxK - 1, ")");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.stride(1) == 1 && (M <= 1 || out.stride(0) >= out.size(1)) &&
                  out.scalar_type() == input.scalar_type(),
              name, ": out must be ", input.scalar_type(), " [", M, ", N] with contiguous, non-overlapping rows, got ",
              out.scalar_type(), " ", out.sizes(), " strides ", out.strides());
  const int64_t N = out.size(1), P = (N + kPanel - 1) / kPanel;
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 4 && weight.size(0) == P && weight.size(1) == Q &&
                  weight.size(2) == kPanel && weight.size(3) == 2 && weight.is_contiguous(),
              name, ": weight must be contiguous int8 pairs [", P, ", ", Q, ", 16, 2] for N = ", N, " outputs of K = ", K,
              " inputs, got ", weight.scalar_type(), " ", weight.sizes());
  TORCH_CHECK(weight_scale.scalar_type() == at::kFloat && weight_scale.dim() == 1 && weight_scale.size(0) == N,
              name, ": weight_scale must be float32 [", N, "], got ", weight_scale.scalar_type(), " ", weight_scale.sizes());
  const bool has_static = input_scale.has_value() && input_scale->defined();
  if (has_static)
    TORCH_CHECK(input_scale->scalar_type() == at::kFloat && input_scale->numel() == 1 && input_scale->device().is_cpu(),
                name, ": input_scale must be float32 [1] on the CPU, got ", input_scale->scalar_type(), " ", input_scale->sizes());
  at::assert_no_overlap(out, input);
  TORCH_CHECK(weight_scale.is_contiguous(), name, ": weight_scale must be contiguous");
  at::Tensor b;  // the bias as float32 (exact)
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->device().is_cpu() && is_float(bias->scalar_type()),
                name, ": bias must be float32, bfloat16 or float16 [", N, "] on the CPU, got ", bias->scalar_type(), " ",
                bias->sizes());
    b = bias->to(at::kFloat).contiguous();
  }
  const float static_scale = has_static ? input_scale->to(at::kFloat).item<float>() : 0.0f;
  return {M, K, N, P, Q, b, has_static, static_scale};
}

#if defined(__AVX2__)
// One row of a panel written back: int32 sums a0 (outputs 0-7), a1 (8-15) -> out[0, ncols) as
// float32 (acc * sx) * ws, + bias when `bias` (b0, b1), rounded once to out_t. Lanes past ncols of
// ws and the bias read as 0 and are never stored (load_panel_row).
template <typename out_t>
PAGEDGEN_ALWAYS_INLINE void write_row(__m256i a0, __m256i a1, float sx, const Vec<8>& ws0, const Vec<8>& ws1, bool bias,
                                      const Vec<8>& b0, const Vec<8>& b1, out_t* out, int ncols) {
  const Vec<8> s = splat<8>(sx);
  Vec<8> y0 = __builtin_convertvector((IVec<8>)a0, Vec<8>) * s * ws0;  // (acc * sx) * ws
  Vec<8> y1 = __builtin_convertvector((IVec<8>)a1, Vec<8>) * s * ws1;
  if (bias) {
    y0 = y0 + b0;
    y1 = y1 + b1;
  }
  store_panel_row(out, y0, y1, ncols);
}
#endif  // __AVX2__

}  // namespace
}  // namespace pagedgen::cpu::int8_gemm
