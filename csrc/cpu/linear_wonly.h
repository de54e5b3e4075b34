// The weight-only (W-only) GEMM tile shared by int4_linear (csrc/cpu/linear_int4.cpp, W4A16) and
// fp8_linear (csrc/cpu/linear_fp8.cpp, W8A16): out [M, N] = input [M, K] @ W^T + bias with the weight
// stored in panels of 16 outputs, in a compressed form a dequantizer turns into float32 in registers.
//
// The tile (AVX2): per k, the dequantizer gives the panel's 16 weights as two vectors of 8 (outputs
// 0-7 and 8-15), then per row of the tile the input is broadcast and one fused multiply-add runs per 8
// outputs. Each output is a float32 sum over k in order, from 0, then + bias, rounded once to out's
// dtype. With more than kRows rows, a panel's weights are dequantized once into a float buffer [K, 16]
// (the same values) and every row tile, of up to kBufferRows rows (balanced) (12 accumulators, 2 weight vectors
// and a broadcast fill AVX2's 16 registers), reads it: the same operations in the same order, so a row's
// bits are the same whichever path runs, whatever M, the row's position, the tiling or the threads
// (batch-invariant by construction). Threads split the panels (each weight byte read by one thread).
//
// A dequantizer D is one panel's view of the weight:
//   int64_t group;                                     input features per group of constants (K: one)
//   D::Group at(int64_t g) const;                      group g's constants (scales, zero points) in registers
//   void row(const D::Group&, int64_t k, V8& w0, V8& w1) const;   the 16 float32 weights of input k
// run() builds one per panel with make(p), so the kernels differ only in their dequantizer.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "linear_panel.h"
#include "vec.h"

#if defined(__AVX2__)
namespace pagedgen::cpu::wonly {

constexpr int kPanel = 16;                      // output features per panel
constexpr int kRows = 4;                        // rows per tile when the weights are dequantized in registers
constexpr int kBufferRows = 6;                  // rows per tile reading a dequantized panel buffer
constexpr int64_t kMinMacsPerThread = 1 << 16;  // smaller GEMMs run on one thread

using V8 = Vec<8>;

PAGEDGEN_ALWAYS_INLINE V8 as_vec(__m256 v) { return reinterpret_cast<const V8&>(v); }

// Rows r < R (x rows ldx apart, float32), one panel: acc[r] += x[r, k] * W[:, k] over k in order, the
// weights dequantized in registers by d (kFromBuffer false) or read from the panel's float buffer wf [K, 16].
template <int R, bool kFromBuffer, typename D>
PAGEDGEN_ALWAYS_INLINE void tile(const float* x, int64_t ldx, int64_t K, const D& d, const float* wf, V8 (&acc)[kBufferRows][2]) {
  static_assert(R >= 1 && R <= (kFromBuffer ? kBufferRows : kRows));
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = V8{};
  const int64_t G = (K + d.group - 1) / d.group;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t k0 = g * d.group, k1 = std::min(K, k0 + d.group);
    typename D::Group c{};
    if constexpr (!kFromBuffer) c = d.at(g);
    for (int64_t k = k0; k < k1; ++k) {
      V8 w0, w1;
      if constexpr (kFromBuffer) {
        w0 = load<8>(wf + k * kPanel);
        w1 = load<8>(wf + k * kPanel + 8);
      } else {
        d.row(c, k, w0, w1);
      }
#define PAGEDGEN_WONLY_ROW(r)                                 \
  {                                                           \
    const V8 b = splat<8>(x[(r) * ldx + k]);                  \
    acc[r][0] = fmadd<8>(b, w0, acc[r][0]);                   \
    acc[r][1] = fmadd<8>(b, w1, acc[r][1]);                   \
  }
      PAGEDGEN_WONLY_ROW(0)
      if constexpr (R > 1) PAGEDGEN_WONLY_ROW(1)
      if constexpr (R > 2) PAGEDGEN_WONLY_ROW(2)
      if constexpr (R > 3) PAGEDGEN_WONLY_ROW(3)
      if constexpr (R > 4) PAGEDGEN_WONLY_ROW(4)
      if constexpr (R > 5) PAGEDGEN_WONLY_ROW(5)
#undef PAGEDGEN_WONLY_ROW
    }
  }
}

// The panel's weights once into wf [K, 16]: the values the register path computes.
template <typename D>
void dequantize_panel(const D& d, int64_t K, float* wf) {
  for (int64_t g = 0; g * d.group < K; ++g) {
    const typename D::Group c = d.at(g);
    for (int64_t k = g * d.group; k < std::min(K, (g + 1) * d.group); ++k) {
      V8 w0, w1;
      d.row(c, k, w0, w1);
      store<8>(wf + k * kPanel, w0);
      store<8>(wf + k * kPanel + 8, w1);
    }
  }
}

// acc + bias rounded to out's dtype, the first ncols outputs of R rows (ldo apart).
template <int R, typename out_t>
PAGEDGEN_ALWAYS_INLINE void write_back(V8 (&acc)[kBufferRows][2], const float* bias, out_t* out, int64_t ldo, int ncols) {
  V8 b0{}, b1{};
  if (bias != nullptr) load_panel_row(bias, ncols, b0, b1);
  for (int r = 0; r < R; ++r) {
    V8 y0 = acc[r][0], y1 = acc[r][1];
    if (bias != nullptr) {
      y0 = y0 + b0;
      y1 = y1 + b1;
    }
    store_panel_row(out + r * ldo, y0, y1, ncols);
  }
}

template <bool kFromBuffer, typename D, typename out_t>
void row_tiles(const float* x, int64_t ldx, int64_t M, int64_t K, const D& d, const float* wf, const float* bias, out_t* out,
               int64_t ldo, int ncols) {
  // Balanced tiles (8 rows: 4 + 4, not 6 + 2); a row's operations are the same in any tile.
  constexpr int kMax = kFromBuffer ? kBufferRows : kRows;
  const int64_t tiles = (M + kMax - 1) / kMax, step = (M + tiles - 1) / tiles;
  V8 acc[kBufferRows][2];
  for (int64_t m = 0; m < M; m += step) {
    const float* xm = x + m * ldx;
    out_t* om = out + m * ldo;
    switch (std::min<int64_t>(step, M - m)) {
      case 6:
        if constexpr (kFromBuffer) {
          tile<6, true>(xm, ldx, K, d, wf, acc);
          write_back<6>(acc, bias, om, ldo, ncols);
        }
        break;
      case 5:
        if constexpr (kFromBuffer) {
          tile<5, true>(xm, ldx, K, d, wf, acc);
          write_back<5>(acc, bias, om, ldo, ncols);
        }
        break;
      case 4: tile<4, kFromBuffer>(xm, ldx, K, d, wf, acc); write_back<4>(acc, bias, om, ldo, ncols); break;
      case 3: tile<3, kFromBuffer>(xm, ldx, K, d, wf, acc); write_back<3>(acc, bias, om, ldo, ncols); break;
      case 2: tile<2, kFromBuffer>(xm, ldx, K, d, wf, acc); write_back<2>(acc, bias, om, ldo, ncols); break;
      default: tile<1, kFromBuffer>(xm, ldx, K, d, wf, acc); write_back<1>(acc, bias, om, ldo, ncols); break;
    }
  }
}

// x [M, K] float32 rows (ldx apart, K >= 1), N outputs in panels (make(p): panel p's dequantizer), bias
// [N] float32 or nullptr, out [M, N] (ldo apart).
template <typename out_t, typename Make>
void gemm(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t N, const Make& make, const float* bias, out_t* out,
          int64_t ldo) {
  const int64_t P = (N + kPanel - 1) / kPanel;
  const int64_t grain = std::max<int64_t>(1, kMinMacsPerThread / std::max<int64_t>(1, M * K * kPanel));
  at::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) {
    std::vector<float> wf(M > kRows ? static_cast<size_t>(K * kPanel) : 0);  // one panel dequantized [K, 16]
    for (int64_t p = p0; p < p1; ++p) {
      const auto d = make(p);
      const int ncols = static_cast<int>(std::min<int64_t>(kPanel, N - p * kPanel));
      const float* b = bias != nullptr ? bias + p * kPanel : nullptr;
      if (M <= kRows) {
        row_tiles<false>(x, ldx, M, K, d, static_cast<const float*>(nullptr), b, out + p * kPanel, ldo, ncols);
        continue;
      }
      dequantize_panel(d, K, wf.data());
      row_tiles<true>(x, ldx, M, K, d, static_cast<const float*>(wf.data()), b, out + p * kPanel, ldo, ncols);
    }
  });
}

// A W-only op's body once its arguments are checked (csrc/op_checks.h): out [M, N] (input's dtype),
// input [M, K] float32 / bfloat16 / float16 with contiguous rows, bias [N] or None; make(p) gives panel
// p's dequantizer. The bias is read as float32 (exact); K == 0 writes the bias (or zeros); a bf16 /
// fp16 input is converted to float32 rows first (exact).
template <typename Make>
void run(const char* op, const at::Tensor& out, const at::Tensor& input, const c10::optional<at::Tensor>& bias, int64_t M,
         int64_t N, int64_t K, const Make& make) {
  if (M == 0 || N == 0) return;
  at::Tensor b;
  if (bias.has_value() && bias->defined()) b = bias->to(at::kFloat).contiguous();
  const float* bp = b.defined() ? b.const_data_ptr<float>() : nullptr;
  if (K == 0) {  // no products: out = bias (or 0)
    out.copy_(b.defined() ? b.expand({M, N}) : at::zeros({M, N}, out.options().dtype(at::kFloat)));
    return;
  }
  at::Tensor x = input;  // [M, K] float32
  if (input.scalar_type() != at::kFloat) x = input.to(at::kFloat);
  dispatch_float_types(input.scalar_type(), op, [&](auto z) {
    using out_t = decltype(z);
    gemm<out_t>(x.const_data_ptr<float>(), x.stride(0), M, K, N, make, bp, out.data_ptr<out_t>(), out.stride(0));
  });
}

}  // namespace pagedgen::cpu::wonly
#endif  // __AVX2__
