// The AMX-INT8 W8A8 GEMM (pagedgen::int8_linear_amx and its emulated twin int8_linear_amx_emulated,
// schemas in csrc/ops.cpp): int8_linear's product (same arguments, checks, weight layout and bits) on
// AMX tiles (tdpbssd: C [16, 16] int32 += A [16 rows, 64 int8] . B [16 quad rows of 16 outputs x 4 k]),
// through the tile loop of the bf16 AMX GEMM (csrc/cpu/linear_amx_loop.h) as its kind Int8Gemm. The tile
// backend T is the AMX instructions (csrc/cpu/linear_amx.cpp) or their emulation
// (csrc/cpu/linear_amx_emulated.cpp).
//
// - Prologue: each input row quantized once into a zero-padded int8 buffer [ceil(M / 16) 16 rows, 64 Kt]
//   (Kt = ceil(K / 64) chunks), by int8_linear's own functions (row_scale, quantize in
//   linear_int8_common.h): the A tiles load from it in place.
// - B: the weight stays in int8_linear's pair layout [P, Q, 16, 2]. Once per panel per row block
//   (kRowBlock rows; a decode batch is one block) the panel's pair rows become quad rows in a per-thread
//   buffer: quad row r, output j = W[j, 4 r .. 4 r + 3] = the 2-byte units of pair rows 2 r and 2 r + 1
//   interleaved (one vpunpcklwd / vpunpckhwd / vperm2i128 per 64 bytes); pair rows past Q are zeros.
// - Write-back: the C tile's int32 rows through int8_linear's write_row, (acc * sx) * ws + bias rounded
//   once: the same bits as the AVX2 tiles' for every M (integer sums are exact in any order; int32
//   wrap-around, were K past the checked limit, is too).
// Needs AVX2 for the write-back: registered (and compiled) in the levels with AVX2, like int8_linear.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "linear_amx_loop.h"
#include "linear_int8_common.h"
#include "vec.h"

#if defined(__AVX2__)
namespace pagedgen::cpu::amx {
namespace {

// The int8 kind of the tile loop: out [M, N] (out_t) from the quantized rows q and the int8 pairs w.
template <typename out_t>
struct Int8Gemm {
  // Rows per block: the B tiles of a panel are made once per block. A decode batch (M <= 512) makes
  // them once per call; a prefill's A sweep per panel stays in L2 (512 x 64 Kt bytes: 1 MiB at K = 2,048).
  static constexpr int64_t kRowBlock = 512;
  static constexpr bool kPacksRows = false;  // rows() points into the prologue's buffer
  static int64_t scratch_bytes(int64_t kt) { return kt * kTileBytes; }  // per panel: all its quad rows
  const int8_t* q;   // [ceil(M / 16) 16, 64 Kt] int8 rows, zero-padded
  const float* sx;   // [M] the rows' scales
  int64_t M, K;
  const int8_t* w;   // [P, Q, 16, 2] int8 pairs
  int64_t N, P, Q;
  const float* ws;    // [N] float32
  const float* bias;  // [N] float32 or nullptr
  out_t* out;         // [M, N], row stride ldo
  int64_t ldo;

  int64_t chunks() const { return (Q + 31) / 32; }  // 32 pairs = 64 k per chunk
  const uint8_t* rows(int64_t m0, int64_t, int64_t lda, uint8_t*) const {
    return reinterpret_cast<const uint8_t*>(q) + m0 * lda;  // quantized in place by the prologue
  }
  // Panel p's pair rows -> quad rows in buf [16 Kt, 64] (zeros past Q).
  PanelB prepare_b(int64_t p, uint8_t* buf) const {
    typedef uint16_t u16x16 __attribute__((vector_size(32)));  // a pair row: 16 outputs x 2 int8
    const int8_t* src = w + p * Q * 2 * kPanel;
    const int64_t quads = chunks() * kTileRows;
    for (int64_t r = 0; r < quads; ++r) {
      u16x16 lo{}, hi{};
      if (2 * r < Q) std::memcpy(&lo, src + 2 * r * 2 * kPanel, sizeof(lo));
      if (2 * r + 1 < Q) std::memcpy(&hi, src + (2 * r + 1) * 2 * kPanel, sizeof(hi));
      const u16x16 q0 = __builtin_shufflevector(lo, hi, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
      const u16x16 q1 = __builtin_shufflevector(lo, hi, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
      std::memcpy(buf + r * kChunkBytes, &q0, sizeof(q0));
      std::memcpy(buf + r * kChunkBytes + sizeof(q0), &q1, sizeof(q1));
    }
    return {buf, buf, chunks()};
  }
  // C tile [16, 16] int32 -> rows [m0, m0 + R) of panel p (int8_linear's write-back).
  void store(const void* tile, int64_t m0, int64_t R, int64_t p) const {
    const int32_t* c = static_cast<const int32_t*>(tile);
    const int n = static_cast<int>(std::min<int64_t>(kPanel, N - p * kPanel));
    Vec<8> ws0, ws1, b0{}, b1{};
    load_panel_row(ws + p * kPanel, n, ws0, ws1);
    if (bias != nullptr) load_panel_row(bias + p * kPanel, n, b0, b1);
    for (int64_t r = 0; r < R; ++r) {
      const __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + r * kPanel));
      const __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + r * kPanel + 8));
      int8_gemm::write_row(a0, a1, sx[m0 + r], ws0, ws1, bias != nullptr, b0, b1, out + (m0 + r) * ldo + p * kPanel, n);
    }
  }
};

// int8_linear's product on the tile backend T (a tdpbssd one), for op `name`: checks, quantizes the
// rows, runs the tile loop. `ready` runs after the checks, before any pointer is read (the real op's
// CPU and OS checks).
template <class T, class Ready>
void int8_linear_tiles(const char* name, const at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                       const at::Tensor& weight_scale, const c10::optional<at::Tensor>& input_scale,
                       const c10::optional<at::Tensor>& bias, Ready&& ready) {
  const int8_gemm::Call c = int8_gemm::check(name, out, input, weight, weight_scale, input_scale, bias);
  ready();
  if (c.M == 0 || c.N == 0) return;
  const int64_t kt = (c.Q + 31) / 32, lda = kt * kChunkBytes;
  std::vector<int8_t> q(static_cast<size_t>((c.M + kTileRows - 1) / kTileRows * kTileRows * lda), 0);
  std::vector<float> sx(static_cast<size_t>(c.M));
  const float* static_scale = c.has_static ? &c.static_scale : nullptr;
  dispatch_float_types(input.scalar_type(), name, [&](auto z) {
    using in_t = decltype(z);
    const in_t* x = input.const_data_ptr<in_t>();
    at::parallel_for(0, c.M, std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(c.K, 1)), [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m) {
        const in_t* row = x + m * input.stride(0);
        const float s = sx[m] = int8_gemm::row_scale(row, c.K, static_scale);
        for (int64_t k = 0; k < c.K; ++k) q[m * lda + k] = static_cast<int8_t>(int8_gemm::quantize(row[k], s));
      }
    });
    const Int8Gemm<in_t> g{q.data(), sx.data(), c.M, c.K, weight.const_data_ptr<int8_t>(), c.N, c.P, c.Q,
                           weight_scale.const_data_ptr<float>(), c.bias.defined() ? c.bias.const_data_ptr<float>() : nullptr,
                           out.data_ptr<in_t>(), out.stride(0)};
    run<Int8Gemm<in_t>, T>(g);
  });
}

}  // namespace
}  // namespace pagedgen::cpu::amx
#endif  // __AVX2__
