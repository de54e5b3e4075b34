// CPU kernel of pagedgen::int4_linear (schema in csrc/ops.cpp, checks in csrc/op_checks.cpp, oracle in
// pagedgen/ops/reference.py), the W4A16 GEMM of GPTQ / AWQ / compressed-tensors pack-quantized models
// (issue 46; pagedgen/layers/quant_int4.py):
//   out [M, N] = input [M, K] @ W^T + bias, W[n, k] = float32(q[n, k] - z[n, g]) * s[n, g], g = k / group_size,
// with the weight packed once at load as 4-bit codes in panels of 16 outputs, [P, K, 8] uint8 with
// weight[p, k, b] = q[16 p + b, k] | q[16 p + b + 8, k] << 4, and the scales and zero points as [P, G, 16].
//
// The tile (AVX2): per k, one 8-byte load of the panel's 16 codes, widened to 8 int32 lanes (vpmovzxbd),
// the low nibbles (vpand: outputs 0-7) and the high ones (vpsrld 4: outputs 8-15) converted to float
// (vcvtdq2ps), minus the group's zero point and times its scale (each exact / one float32 rounding, as the
// reference computes them), then per row of the tile the input broadcast and one fused multiply-add per
// 8 outputs. Each output is a float32 sum over k in order, then + bias, rounded once to out's dtype.
// With more than kRows rows, a panel's weights are dequantized once into a float buffer [K, 16] (the same
// values) and every row tile reads it: the same operations in the same order, so a row's bits are the
// same whichever path runs, whatever M, the row's position, the tiling or the threads (batch-invariant by
// construction). Threads split the panels (each weight byte read by one thread).
//
// Registered in the levels with AVX2 (all of x86-64's); the avx512_bf16 and amx levels run this code too.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../op_checks.h"
#include "vec.h"

namespace pagedgen::cpu {
namespace int4_gemm {  // its own namespace: the unity build (csrc/cpu_kernels.cpp) shares one with linear.cpp

constexpr int kPanel = 16;                      // output features per panel
constexpr int kRows = 4;                        // rows per tile
constexpr int64_t kMinMacsPerThread = 1 << 16;  // smaller GEMMs run on one thread

#if defined(__AVX2__)
using V8 = Vec<8>;

PAGEDGEN_ALWAYS_INLINE V8 as_vec(__m256 v) { return reinterpret_cast<const V8&>(v); }

// The 16 codes of one panel row (8 bytes) dequantized: outputs 0-7 in w0, 8-15 in w1.
PAGEDGEN_ALWAYS_INLINE void dequantize(const uint8_t* codes, const V8& z0, const V8& z1, const V8& s0, const V8& s1,
                                       V8& w0, V8& w1) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes)));
  const V8 lo = as_vec(_mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xF))));
  const V8 hi = as_vec(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)));
  w0 = (lo - z0) * s0;
  w1 = (hi - z1) * s1;
}

// A group's zero points (16 bytes) as two float vectors.
PAGEDGEN_ALWAYS_INLINE void zeros_of(const uint8_t* z, V8& z0, V8& z1) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(z));
  z0 = as_vec(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)));
  z1 = as_vec(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))));
}

// Rows r < R (x rows ldx apart, float32), one panel: acc[r] += x[r, k] * W[:, k] over k in order, the
// weights dequantized in registers (kFromBuffer false) or read from the panel's float buffer wf [K, 16].
template <int R, bool kFromBuffer>
PAGEDGEN_ALWAYS_INLINE void tile(const float* x, int64_t ldx, int64_t K, int64_t group, const uint8_t* w, const float* ws,
                                 const uint8_t* wz, const float* wf, V8 (&acc)[kRows][2]) {
  static_assert(R >= 1 && R <= kRows);
  for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = V8{};
  const int64_t G = (K + group - 1) / group;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t k0 = g * group, k1 = std::min(K, k0 + group);
    V8 z0{}, z1{}, s0{}, s1{};
    if constexpr (!kFromBuffer) {
      zeros_of(wz + g * kPanel, z0, z1);
      s0 = load<8>(ws + g * kPanel);
      s1 = load<8>(ws + g * kPanel + 8);
    }
    for (int64_t k = k0; k < k1; ++k) {
      V8 w0, w1;
      if constexpr (kFromBuffer) {
        w0 = load<8>(wf + k * kPanel);
        w1 = load<8>(wf + k * kPanel + 8);
      } else {
        dequantize(w + k * 8, z0, z1, s0, s1, w0, w1);
      }
#define PAGEDGEN_INT4_ROW(r)                                  \
  {                                                           \
    const V8 b = splat<8>(x[(r) * ldx + k]);                  \
    acc[r][0] = fmadd<8>(b, w0, acc[r][0]);                   \
    acc[r][1] = fmadd<8>(b, w1, acc[r][1]);                   \
  }
      PAGEDGEN_INT4_ROW(0)
      if constexpr (R > 1) PAGEDGEN_INT4_ROW(1)
      if constexpr (R > 2) PAGEDGEN_INT4_ROW(2)
      if constexpr (R > 3) PAGEDGEN_INT4_ROW(3)
#undef PAGEDGEN_INT4_ROW
    }
  }
}

// acc + bias rounded to out's dtype, the first ncols outputs of R rows (ldo apart).
template <int R, typename out_t>
PAGEDGEN_ALWAYS_INLINE void write_back(V8 (&acc)[kRows][2], const float* bias, out_t* out, int64_t ldo, int ncols) {
  const V8 b0 = bias == nullptr ? V8{} : ncols >= 8 ? load<8>(bias) : load_partial<8>(bias, ncols);
  const V8 b1 = bias == nullptr ? V8{} : ncols == kPanel ? load<8>(bias + 8) : ncols > 8 ? load_partial<8>(bias + 8, ncols - 8) : V8{};
  for (int r = 0; r < R; ++r) {
    V8 y0 = acc[r][0], y1 = acc[r][1];
    if (bias != nullptr) {
      y0 = y0 + b0;
      y1 = y1 + b1;
    }
    out_t* o = out + r * ldo;
    if (ncols == kPanel) {
      store<8>(o, y0);
      store<8>(o + 8, y1);
    } else if (ncols > 8) {
      store<8>(o, y0);
      store_partial<8>(o + 8, y1, ncols - 8);
    } else {
      store_partial<8>(o, y0, ncols);
    }
  }
}

template <bool kFromBuffer, typename out_t>
void row_tiles(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t group, const uint8_t* w, const float* ws,
               const uint8_t* wz, const float* wf, const float* bias, out_t* out, int64_t ldo, int ncols) {
  V8 acc[kRows][2];
  for (int64_t m = 0; m < M; m += kRows) {
    const float* xm = x + m * ldx;
    out_t* om = out + m * ldo;
    switch (std::min<int64_t>(kRows, M - m)) {
      case 4: tile<4, kFromBuffer>(xm, ldx, K, group, w, ws, wz, wf, acc); write_back<4>(acc, bias, om, ldo, ncols); break;
      case 3: tile<3, kFromBuffer>(xm, ldx, K, group, w, ws, wz, wf, acc); write_back<3>(acc, bias, om, ldo, ncols); break;
      case 2: tile<2, kFromBuffer>(xm, ldx, K, group, w, ws, wz, wf, acc); write_back<2>(acc, bias, om, ldo, ncols); break;
      default: tile<1, kFromBuffer>(xm, ldx, K, group, w, ws, wz, wf, acc); write_back<1>(acc, bias, om, ldo, ncols); break;
    }
  }
}

template <typename out_t>
void gemm(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t group, const uint8_t* weight, const float* scale,
          const uint8_t* zero, int64_t N, const float* bias, out_t* out, int64_t ldo) {
  const int64_t P = (N + kPanel - 1) / kPanel, G = (K + group - 1) / group;
  const int64_t grain = std::max<int64_t>(1, kMinMacsPerThread / std::max<int64_t>(1, M * K * kPanel));
  at::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) {
    std::vector<float> wf(M > kRows ? static_cast<size_t>(K * kPanel) : 0);  // one panel dequantized [K, 16]
    for (int64_t p = p0; p < p1; ++p) {
      const uint8_t* w = weight + p * K * 8;
      const float* ws = scale + p * G * kPanel;
      const uint8_t* wz = zero + p * G * kPanel;
      const int ncols = static_cast<int>(std::min<int64_t>(kPanel, N - p * kPanel));
      const float* b = bias != nullptr ? bias + p * kPanel : nullptr;
      if (M <= kRows) {
        row_tiles<false>(x, ldx, M, K, group, w, ws, wz, nullptr, b, out + p * kPanel, ldo, ncols);
        continue;
      }
      for (int64_t g = 0; g < G; ++g) {  // the panel's weights once, the values the register path computes
        V8 z0, z1;
        zeros_of(wz + g * kPanel, z0, z1);
        const V8 s0 = load<8>(ws + g * kPanel), s1 = load<8>(ws + g * kPanel + 8);
        for (int64_t k = g * group; k < std::min(K, (g + 1) * group); ++k) {
          V8 w0, w1;
          dequantize(w + k * 8, z0, z1, s0, s1, w0, w1);
          store<8>(wf.data() + k * kPanel, w0);
          store<8>(wf.data() + k * kPanel + 8, w1);
        }
      }
      row_tiles<true>(x, ldx, M, K, group, w, ws, wz, wf.data(), b, out + p * kPanel, ldo, ncols);
    }
  });
}

void int4_linear_cpu(const at::Tensor& out,                    // [M, N], input's dtype
                     const at::Tensor& input,                  // [M, K] float32 / bfloat16 / float16, contiguous rows
                     const at::Tensor& weight,                 // [ceil(N / 16), K, 8] uint8
                     const at::Tensor& weight_scale,           // [ceil(N / 16), ceil(K / group_size), 16] float32
                     const at::Tensor& weight_zero,            // [ceil(N / 16), ceil(K / group_size), 16] uint8
                     int64_t group_size,                       // input features per group
                     const c10::optional<at::Tensor>& bias) {  // [N] float32 / bfloat16 / float16 or None
  const auto s = checks::int4_linear(out, input, weight, weight_scale, weight_zero, group_size, bias, c10::DeviceType::CPU);
  if (s.M == 0 || s.N == 0) return;
  at::Tensor b;  // the bias as float32 (exact)
  if (bias.has_value() && bias->defined()) b = bias->to(at::kFloat).contiguous();
  const float* bp = b.defined() ? b.const_data_ptr<float>() : nullptr;
  if (s.K == 0) {  // no products: out = bias (or 0)
    out.copy_(b.defined() ? b.expand({s.M, s.N}) : at::zeros({s.M, s.N}, out.options().dtype(at::kFloat)));
    return;
  }
  at::Tensor x = input;  // float32 rows (the conversion from bf16 / fp16 is exact)
  if (input.scalar_type() != at::kFloat) x = input.to(at::kFloat);
  dispatch_float_types(input.scalar_type(), "int4_linear (input)", [&](auto z) {
    using out_t = decltype(z);
    gemm<out_t>(x.const_data_ptr<float>(), x.stride(0), s.M, s.K, group_size, weight.const_data_ptr<uint8_t>(),
                weight_scale.const_data_ptr<float>(), weight_zero.const_data_ptr<uint8_t>(), s.N, bp, out.data_ptr<out_t>(),
                out.stride(0));
  });
}
#endif  // __AVX2__

}  // namespace int4_gemm
}  // namespace pagedgen::cpu

#if defined(__AVX2__)
TORCH_LIBRARY_IMPL(pagedgen, CPU, m) { m.impl("int4_linear", &pagedgen::cpu::int4_gemm::int4_linear_cpu); }
#endif
