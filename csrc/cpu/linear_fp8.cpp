// CPU kernel of pagedgen::fp8_linear (schema in csrc/ops.cpp, checks in csrc/op_checks.cpp, oracle in
// pagedgen/ops/reference.py), the FP8 W8A16 GEMM of FP8 checkpoints and online quantization="fp8"
// (issue 46; pagedgen/layers/quant_fp8.py):
//   out [M, N] = input [M, K] @ W^T + bias, W[n, k] = float32(code[n, k]) * scale[n] (per channel; a
//   per-tensor scale is the same repeated) or * scale[n, k / block_k] (block-wise checkpoints),
// with the float8_e4m3fn codes packed once at load in panels of 16 outputs, [P, K, 16] with
// weight[p, k, j] = code[16 p + j, k] (zeros past N), and the scales as the layer holds them.
//
// The dequantizer of the shared W-only tile (csrc/cpu/linear_wonly.h: the row tiles, the panel buffer
// from kRows rows on, the threads; batch-invariant by construction): per k, one 16-byte load of the
// panel's 16 codes widened to 16-bit lanes (vpmovzxbw), each e4m3 code's bits placed as float16 bits
// (fp8_bits.h, shared with the 1-byte KV cache's read: h = sign << 15 | (code & 0x7f) << 7 in three
// operations), h exactly the code's value times 2^-8. F16C's vcvtph2ps converts each half to
// float32 (exact) and one multiply by scale * 2^8 (exact: a power of two) gives float32(code) * scale
// rounded once, the reference's value. The NaN codes 0x7f / 0xff would read as +-480: the loaders
// refuse them (pagedgen.layers.quant_fp8.pack_fp8), and the scale must keep scale * 2^8 finite.
//
// Registered in the levels with AVX2 and F16C (all of x86-64's); avx512_bf16 and amx run this code too.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>

#include "../op_checks.h"
#include "fp8_bits.h"
#include "linear_wonly.h"

#if defined(__AVX2__) && defined(__F16C__)
namespace pagedgen::cpu {
namespace fp8_gemm {  // its own namespace: the unity build (csrc/cpu_kernels.cpp) shares one with linear.cpp

using wonly::as_vec;
using wonly::kPanel;
using wonly::V8;

constexpr float kTwoPow8 = 256.0f;  // float16(h) = e4m3 value * 2^-8

// One panel: codes w [K, 16], and its rows' scales, row j's group g at scale[j * G + g].
struct Fp8Panel {
  const uint8_t* w;
  const float* scale;
  int64_t G;      // scale columns: 1 per channel, ceil(K / block_k) block-wise
  int64_t group;  // input features per scale column (K per channel)
  int ncols;      // outputs of this panel below N
  struct Group {
    V8 s0, s1;  // scale * 2^8 of outputs 0-7 and 8-15 (0 past N)
  };

  // Group g's scales of the panel's rows, times 2^8 (once per group, not per k).
  PAGEDGEN_ALWAYS_INLINE Group at(int64_t g) const {
    alignas(32) float s[kPanel] = {};
    for (int j = 0; j < ncols; ++j) s[j] = scale[j * G + g] * kTwoPow8;
    return {load<8>(s), load<8>(s + 8)};
  }

  // The 16 codes of input k (16 bytes) dequantized: outputs 0-7 in w0, 8-15 in w1.
  PAGEDGEN_ALWAYS_INLINE void row(const Group& c, int64_t k, V8& w0, V8& w1) const {
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * kPanel)));
    const __m256i h = (__m256i)e4m3_half_bits((U16x16)v);  // fp8_bits.h
    w0 = as_vec(_mm256_cvtph_ps(_mm256_castsi256_si128(h))) * c.s0;
    w1 = as_vec(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1))) * c.s1;
  }
};

void fp8_linear_cpu(const at::Tensor& out,                    // [M, N], input's dtype
                    const at::Tensor& input,                  // [M, K] float32 / bfloat16 / float16, contiguous rows
                    const at::Tensor& weight,                 // [ceil(N / 16), K, 16] float8_e4m3fn
                    const at::Tensor& weight_scale,           // [N] (block_k 0) or [N, ceil(K / block_k)] float32
                    int64_t block_k,                          // input features per scale block; 0: per channel
                    const c10::optional<at::Tensor>& bias) {  // [N] float32 / bfloat16 / float16 or None
  const auto s = checks::fp8_linear(out, input, weight, weight_scale, block_k, bias, c10::DeviceType::CPU);
  const uint8_t* w = static_cast<const uint8_t*>(weight.const_data_ptr());
  const float* scale = weight_scale.const_data_ptr<float>();
  const int64_t group = block_k > 0 ? block_k : s.K;
  wonly::run("fp8_linear", out, input, bias, s.M, s.N, s.K, [&](int64_t p) {
    const int ncols = static_cast<int>(std::min<int64_t>(kPanel, s.N - p * kPanel));
    return Fp8Panel{w + p * s.K * kPanel, scale + p * kPanel * s.blocks, s.blocks, group, ncols};
  });
}

}  // namespace fp8_gemm
}  // namespace pagedgen::cpu

TORCH_LIBRARY_IMPL(pagedgen, CPU, m) { m.impl("fp8_linear", &pagedgen::cpu::fp8_gemm::fp8_linear_cpu); }
#endif  // __AVX2__ && __F16C__
