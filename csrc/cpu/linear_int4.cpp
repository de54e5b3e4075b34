// CPU kernel of pagedgen::int4_linear (schema in csrc/ops.cpp, checks in csrc/op_checks.cpp, oracle in
// pagedgen/ops/reference.py), the W4A16 GEMM of GPTQ / AWQ / compressed-tensors pack-quantized models
// (issue 46; pagedgen/layers/quant_int4.py):
//   out [M, N] = input [M, K] @ W^T + bias, W[n, k] = float32(q[n, k] - z[n, g]) * s[n, g], g = k / group_size,
// with the weight packed once at load as 4-bit codes in panels of 16 outputs, [P, K, 8] uint8 with
// weight[p, k, b] = q[16 p + b, k] | q[16 p + b + 8, k] << 4, and the scales and zero points as [P, G, 16].
//
// The dequantizer of the shared W-only tile (csrc/cpu/linear_wonly.h: the row tiles, the panel buffer
// from kRows rows on, the threads; batch-invariant by construction): per k, one 8-byte load of the
// panel's 16 codes, widened to 8 int32 lanes (vpmovzxbd), the low nibbles (vpand: outputs 0-7) and the
// high ones (vpsrld 4: outputs 8-15) converted to float (vcvtdq2ps), minus the group's zero point and
// times its scale (each exact / one float32 rounding, as the reference computes them).
//
// Registered in the levels with AVX2 (all of x86-64's); the avx512_bf16 and amx levels run this code too.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>

#include "../op_checks.h"
#include "linear_wonly.h"

#if defined(__AVX2__)
namespace pagedgen::cpu {
namespace int4_gemm {  // its own namespace: the unity build (csrc/cpu_kernels.cpp) shares one with linear.cpp

using wonly::as_vec;
using wonly::kPanel;
using wonly::V8;

// One panel: codes w [K, 8], scales ws and zero points wz [G, 16].
struct Int4Panel {
  const uint8_t* w;
  const float* ws;
  const uint8_t* wz;
  int64_t group;
  struct Group {
    V8 z0, z1, s0, s1;  // outputs 0-7 and 8-15
  };

  // Group g's zero points (16 bytes, as floats) and scales.
  PAGEDGEN_ALWAYS_INLINE Group at(int64_t g) const {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wz + g * kPanel));
    return {as_vec(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b))), as_vec(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)))),
            load<8>(ws + g * kPanel), load<8>(ws + g * kPanel + 8)};
  }

  // The 16 codes of input k (8 bytes) dequantized: outputs 0-7 in w0, 8-15 in w1.
  PAGEDGEN_ALWAYS_INLINE void row(const Group& c, int64_t k, V8& w0, V8& w1) const {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + k * 8)));
    const V8 lo = as_vec(_mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xF))));
    const V8 hi = as_vec(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)));
    w0 = (lo - c.z0) * c.s0;
    w1 = (hi - c.z1) * c.s1;
  }
};

void int4_linear_cpu(const at::Tensor& out,                    // [M, N], input's dtype
                     const at::Tensor& input,                  // [M, K] float32 / bfloat16 / float16, contiguous rows
                     const at::Tensor& weight,                 // [ceil(N / 16), K, 8] uint8
                     const at::Tensor& weight_scale,           // [ceil(N / 16), ceil(K / group_size), 16] float32
                     const at::Tensor& weight_zero,            // [ceil(N / 16), ceil(K / group_size), 16] uint8
                     int64_t group_size,                       // input features per group
                     const c10::optional<at::Tensor>& bias) {  // [N] float32 / bfloat16 / float16 or None
  const auto s = checks::int4_linear(out, input, weight, weight_scale, weight_zero, group_size, bias, c10::DeviceType::CPU);
  const uint8_t* w = weight.const_data_ptr<uint8_t>();
  const float* ws = weight_scale.const_data_ptr<float>();
  const uint8_t* wz = weight_zero.const_data_ptr<uint8_t>();
  wonly::run("int4_linear", out, input, bias, s.M, s.N, s.K, [&](int64_t p) {
    return Int4Panel{w + p * s.K * 8, ws + p * s.groups * kPanel, wz + p * s.groups * kPanel, group_size};
  });
}

}  // namespace int4_gemm
}  // namespace pagedgen::cpu

TORCH_LIBRARY_IMPL(pagedgen, CPU, m) { m.impl("int4_linear", &pagedgen::cpu::int4_gemm::int4_linear_cpu); }
#endif  // __AVX2__
