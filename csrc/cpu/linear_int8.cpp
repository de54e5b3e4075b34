// CPU kernel of pagedgen::int8_linear (schema in csrc/ops.cpp, oracle in pagedgen/ops/reference.py), the
// W8A8 GEMM of int8 models (issue 46; pagedgen/layers/quant.py):
//   out [M, N] = (int8 rows of input [M, K]) x (int8 weight [N, K])^T, exact int32 sums, then in float32
//   acc * x_scale[m] * weight_scale[n] + bias[n], rounded once to out's dtype.
// The weight is packed once at load (pagedgen.layers.quant.pack_int8) as int8 pairs in panels of 16
// outputs, [P, Q, 16, 2] with P = ceil(N / 16), Q = ceil(K / 2), weight[p, q, j, t] = W[16 p + j, 2 q + t]
// (zeros past N and K): bf16 pairs' layout (pack_pairs), in bytes.
//
// The prologue quantizes each input row once, as the reference does (float32: scale = max |x| / 127, 1 for
// a zero row, or the static input_scale; q = clamp(rint(x / scale), -128, 127)), into pairs of int16.
// The tile (AVX2): per pair q, one 32-byte load of the panel's 16 x 2 weights, sign-extended to int16
// (vpmovsxbw), and per row the pair broadcast (vpbroadcastd) and vpmaddwd: each int32 lane gets
// x[2q] * w[j, 2q] + x[2q + 1] * w[j, 2q + 1], exact (|.| <= 2 * 128 * 127), added exactly (vpaddd; no
// overflow while K < 2^31 / (128 * 127) = 132,104, checked). Not vpmaddubsw: its int16 pair sums saturate.
// Integer sums are exact in any order, and the write-back is the reference's float32 multiplies in its
// order (-ffp-contract=off), so every output equals the reference's bit for bit whatever M, the row's
// position, the tiling or the threads: batch-invariant by construction.
//
// Threads split the panels (each weight byte read by one thread); rows go in tiles of up to 4 (8 int32
// accumulators). Registered in the levels with AVX2 (all of x86-64's). The quantization, the checks and
// the write-back are in linear_int8_common.h, shared with the AMX-INT8 tiles (int8_linear_amx,
// linear_int8_amx.h), which give the same bits; the layers take those from 16 rows on the amx level
// (pagedgen/layers/matmul/int8_amx.py). The AVX-512 VNNI (vpdpwssd) variant is not written: the
// avx512_bf16 level runs this AVX2 code.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "linear_int8_common.h"
#include "linear_panel.h"
#include "vec.h"

namespace pagedgen::cpu {
namespace int8_gemm {

constexpr int kRows = 4;           // rows per tile
constexpr int64_t kMinMacsPerThread = 1 << 16;  // smaller GEMMs run on one thread

// One input row quantized (row_scale, quantize): pairs of int16 packed in int32 (q[i] = x[2i] | x[2i + 1] << 16); returns its scale.
template <typename in_t>
float quantize_row(const in_t* x, int64_t K, const float* static_scale, int32_t* q) {
  const float s = row_scale(x, K, static_scale);
  const auto quant = [&](int64_t k) -> uint32_t {
    return k < K ? static_cast<uint16_t>(static_cast<int16_t>(quantize(x[k], s))) : 0u;
  };
  for (int64_t i = 0; i < (K + 1) / 2; ++i) q[i] = static_cast<int32_t>(quant(2 * i) | (quant(2 * i + 1) << 16));
  return s;
}

#if defined(__AVX2__)
using V8 = Vec<8>;
using I8 = IVec<8>;

// Rows r < R of a tile: q rows (ldq int32 pairs apart), panel w [Q, 16, 2] int8, scales sx[r], the panel's
// ws[ncols] and bias[ncols] (float32) or nullptr; out rows ldo apart, ncols <= 16 valid outputs.
template <int R, typename out_t>
PAGEDGEN_ALWAYS_INLINE void tile(const int32_t* q, int64_t ldq, const int8_t* w, int64_t Q, const float* sx, const float* ws,
                                 const float* bias, out_t* out, int64_t ldo, int ncols) {
  static_assert(R >= 1 && R <= kRows);
  const int32_t* q0 = q;
  const int32_t* q1 = q + std::min(1, R - 1) * ldq;
  const int32_t* q2 = q + std::min(2, R - 1) * ldq;
  const int32_t* q3 = q + std::min(3, R - 1) * ldq;
  __m256i a00 = _mm256_setzero_si256(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
#define PAGEDGEN_INT8_ROW(r)                                              \
  {                                                                       \
    const __m256i b = _mm256_set1_epi32(q##r[i]);                         \
    a##r##0 = _mm256_add_epi32(a##r##0, _mm256_madd_epi16(b, w0));        \
    a##r##1 = _mm256_add_epi32(a##r##1, _mm256_madd_epi16(b, w1));        \
  }
  for (int64_t i = 0; i < Q; ++i) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i * 2 * kPanel));
    const __m256i w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(wv));       // outputs 0-7, pairs as int16
    const __m256i w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(wv, 1));  // outputs 8-15
    PAGEDGEN_INT8_ROW(0)
    if constexpr (R > 1) PAGEDGEN_INT8_ROW(1)
    if constexpr (R > 2) PAGEDGEN_INT8_ROW(2)
    if constexpr (R > 3) PAGEDGEN_INT8_ROW(3)
  }
#undef PAGEDGEN_INT8_ROW
  const __m256i acc[kRows][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}};
  // the last panel's scales and bias are partial: lanes past N read as 0 and are never stored
  V8 ws0, ws1, b0{}, b1{};
  load_panel_row(ws, ncols, ws0, ws1);
  if (bias != nullptr) load_panel_row(bias, ncols, b0, b1);
  for (int r = 0; r < R; ++r) write_row(acc[r][0], acc[r][1], sx[r], ws0, ws1, bias != nullptr, b0, b1, out + r * ldo, ncols);
}

template <typename out_t>
void gemm(const int32_t* q, int64_t Q, const float* sx, int64_t M, const int8_t* weight, int64_t N, const float* ws,
          const float* bias, out_t* out, int64_t ldo) {
  const int64_t P = (N + kPanel - 1) / kPanel;
  const int64_t grain = std::max<int64_t>(1, kMinMacsPerThread / std::max<int64_t>(1, M * Q * 2 * kPanel));
  at::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int8_t* w = weight + p * Q * 2 * kPanel;
      const int ncols = static_cast<int>(std::min<int64_t>(kPanel, N - p * kPanel));
      const float* b = bias != nullptr ? bias + p * kPanel : nullptr;
      for (int64_t m = 0; m < M; m += kRows) {
        const int64_t rows = std::min<int64_t>(kRows, M - m);
        const int32_t* qm = q + m * Q;
        out_t* om = out + m * ldo + p * kPanel;
        switch (rows) {
          case 4: tile<4>(qm, Q, w, Q, sx + m, ws + p * kPanel, b, om, ldo, ncols); break;
          case 3: tile<3>(qm, Q, w, Q, sx + m, ws + p * kPanel, b, om, ldo, ncols); break;
          case 2: tile<2>(qm, Q, w, Q, sx + m, ws + p * kPanel, b, om, ldo, ncols); break;
          default: tile<1>(qm, Q, w, Q, sx + m, ws + p * kPanel, b, om, ldo, ncols); break;
        }
      }
    }
  });
}

void int8_linear_cpu(const at::Tensor& out,                          // [M, N], input's dtype
                     const at::Tensor& input,                        // [M, K] float32 / bfloat16 / float16, contiguous rows
                     const at::Tensor& weight,                       // [ceil(N / 16), ceil(K / 2), 16, 2] int8, contiguous
                     const at::Tensor& weight_scale,                 // [N] float32
                     const c10::optional<at::Tensor>& input_scale,   // [1] float32 or None (dynamic, per row)
                     const c10::optional<at::Tensor>& bias) {        // [N] float32 / bfloat16 / float16 or None
  const Call c = check("int8_linear", out, input, weight, weight_scale, input_scale, bias);
  const int64_t M = c.M, K = c.K, N = c.N, Q = c.Q;
  const at::Tensor& b = c.bias;
  const bool has_static = c.has_static;
  const float static_scale = c.static_scale;
  if (M == 0 || N == 0) return;
  std::vector<int32_t> q(static_cast<size_t>(M * Q));
  std::vector<float> sx(static_cast<size_t>(M));
  dispatch_float_types(input.scalar_type(), "int8_linear (input)", [&](auto z) {
    using in_t = decltype(z);
    const in_t* x = input.const_data_ptr<in_t>();
    at::parallel_for(0, M, std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(K, 1)), [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m) sx[m] = quantize_row(x + m * input.stride(0), K, has_static ? &static_scale : nullptr, q.data() + m * Q);
    });
    gemm<in_t>(q.data(), Q, sx.data(), M, weight.const_data_ptr<int8_t>(), N, weight_scale.const_data_ptr<float>(),
               b.defined() ? b.const_data_ptr<float>() : nullptr, out.data_ptr<in_t>(), out.stride(0));
  });
}
#endif  // __AVX2__

}  // namespace int8_gemm
}  // namespace pagedgen::cpu

#if defined(__AVX2__)
TORCH_LIBRARY_IMPL(pagedgen, CPU, m) { m.impl("int8_linear", &pagedgen::cpu::int8_gemm::int8_linear_cpu); }
#endif
