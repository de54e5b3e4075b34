// CPU kernel of pagedgen::add_lora_linear (schema in csrc/ops.cpp, oracle in pagedgen/ops/reference.py):
// every row's LoRA delta of one projection, whatever adapter slot each row has, in one call (punica's
// SGMV shrink and expand fused; vLLM's PunicaWrapper.add_lora_linear):
//
//   s = slots[m] (-1: no adapter, the row is left as it is)
//   h[j]  = sum_k x[m, k] * lora_a[s, k, j]                 j < P R   shrink, k in order from 0
//   d[n]  = sum_i h[p R + i] * lora_b[s, i, n]              i < R     expand, n in output slice p
//   out[m, n] = round(out[m, n] + d[n])                     one rounding to out's dtype
//
// Why (issue 48): the PyTorch version grouped the rows by slot and ran a shrink GEMM, an expand GEMM,
// an index_select and an index_add per group and projection: four adapters in a step made 16 Python-
// dispatched ops per projection, most of them on 4-16 rows, and the block-diagonal B of a packed
// projection (q/k/v) multiplied P times the zeros it needed. Here a call per projection reads each
// slot's A and B once per tile of rows and multiplies only the part of B a column needs.
//
// Batch invariance by construction: every h[j] and d[n] of a row is the same chain of float32 fused
// multiply-adds (k = 0, 1, ..., K - 1; i = 0, ..., R - 1) from 0, whatever the other rows, their slots,
// the tile a row lands in or the thread count; h stays float32 between the two. Rows are tiled by slot
// (up to kLoraRows rows of one slot share each weight load), and tiles are split among threads.
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "vec.h"

namespace pagedgen::cpu::lora {  // its own namespace: one compilation unit with linear.cpp (cpu_kernels.cpp)
namespace {

constexpr int kCols = 16;      // output columns per micro-kernel (two vectors of 8)
constexpr int kLoraRows = 6;   // rows per tile (12 accumulators)
using V8 = Vec<8>;

template <bool kFull, typename w_t>
PAGEDGEN_ALWAYS_INLINE void load_cols(const w_t* w, int ncols, V8& w0, V8& w1) {
  if constexpr (kFull) {
    w0 = load<8>(w);
    w1 = load<8>(w + 8);
  } else {  // the last columns of a matrix: no read past them
    w0 = ncols >= 8 ? load<8>(w) : load_partial<8>(w, ncols);
    w1 = ncols > 8 ? load_partial<8>(w + 8, ncols - 8) : V8{};
  }
}

// acc[r][0:16] = sum_k x_r[k] * w[k * ldw + 0:16] for rows r < R (x_r = x + r * ldx, float32), k in
// order from 0; columns >= ncols are not read (kFull false) and their lanes are garbage. The same chain
// per row whatever R: rows past R are neither read nor computed (the `if constexpr`s).
template <int R, bool kFull, typename w_t>
PAGEDGEN_ALWAYS_INLINE void fma_tile(const float* x, int64_t ldx, const w_t* w, int64_t ldw, int64_t K, int ncols,
                                     V8 (&acc)[kLoraRows][2]) {
  static_assert(R >= 1 && R <= kLoraRows);
  const float* x0 = x;
  const float* x1 = x + std::min(1, R - 1) * ldx;
  const float* x2 = x + std::min(2, R - 1) * ldx;
  const float* x3 = x + std::min(3, R - 1) * ldx;
  const float* x4 = x + std::min(4, R - 1) * ldx;
  const float* x5 = x + std::min(5, R - 1) * ldx;
  V8 a00 = {}, a01 = {}, a10 = {}, a11 = {}, a20 = {}, a21 = {}, a30 = {}, a31 = {}, a40 = {}, a41 = {}, a50 = {}, a51 = {};
#define PAGEDGEN_LORA_ROW(r)            \
  {                                     \
    const V8 b = splat<8>(x##r[k]);     \
    a##r##0 = fmadd<8>(b, w0, a##r##0); \
    a##r##1 = fmadd<8>(b, w1, a##r##1); \
  }
  for (int64_t k = 0; k < K; ++k) {
    V8 w0, w1;
    load_cols<kFull>(w + k * ldw, ncols, w0, w1);
    PAGEDGEN_LORA_ROW(0)
    if constexpr (R > 1) PAGEDGEN_LORA_ROW(1)
    if constexpr (R > 2) PAGEDGEN_LORA_ROW(2)
    if constexpr (R > 3) PAGEDGEN_LORA_ROW(3)
    if constexpr (R > 4) PAGEDGEN_LORA_ROW(4)
    if constexpr (R > 5) PAGEDGEN_LORA_ROW(5)
  }
#undef PAGEDGEN_LORA_ROW
  acc[0][0] = a00, acc[0][1] = a01, acc[1][0] = a10, acc[1][1] = a11, acc[2][0] = a20, acc[2][1] = a21;
  acc[3][0] = a30, acc[3][1] = a31, acc[4][0] = a40, acc[4][1] = a41, acc[5][0] = a50, acc[5][1] = a51;
}

template <bool kFull, typename w_t>
inline void fma_rows(int rows, const float* x, int64_t ldx, const w_t* w, int64_t ldw, int64_t K, int ncols,
                     V8 (&acc)[kLoraRows][2]) {
  switch (rows) {
    case 6: fma_tile<6, kFull>(x, ldx, w, ldw, K, ncols, acc); break;
    case 5: fma_tile<5, kFull>(x, ldx, w, ldw, K, ncols, acc); break;
    case 4: fma_tile<4, kFull>(x, ldx, w, ldw, K, ncols, acc); break;
    case 3: fma_tile<3, kFull>(x, ldx, w, ldw, K, ncols, acc); break;
    case 2: fma_tile<2, kFull>(x, ldx, w, ldw, K, ncols, acc); break;
    default: fma_tile<1, kFull>(x, ldx, w, ldw, K, ncols, acc); break;
  }
}

// The columns [c, c + ncols) of `rows` rows: acc = x @ w[:, c:], each row of x K floats at stride ldx.
template <typename w_t>
inline void columns(int rows, const float* x, int64_t ldx, const w_t* w, int64_t ldw, int64_t K, int ncols,
                    V8 (&acc)[kLoraRows][2]) {
  if (ncols == kCols) {
    fma_rows<true>(rows, x, ldx, w, ldw, K, ncols, acc);
  } else {
    fma_rows<false>(rows, x, ldx, w, ldw, K, ncols, acc);
  }
}

struct Tile {
  int64_t slot;
  int64_t first;  // index of its first row in the rows-by-slot order
  int rows;
};

template <typename x_t, typename a_t>
void add_lora_linear_impl(x_t* out, int64_t ldo, const x_t* x, int64_t ldx, int64_t K, int64_t N, const a_t* lora_a,
                          const a_t* lora_b, int64_t J, int64_t R, const std::vector<int64_t>& slice_sizes,
                          const std::vector<int64_t>& order, const std::vector<Tile>& tiles) {
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> xf(kLoraRows * K), h(kLoraRows * J);  // a tile's rows in float32, their shrink
    V8 acc[kLoraRows][2];
    for (int64_t t = t0; t < t1; ++t) {
      const Tile& tile = tiles[t];
      const int rows = tile.rows;
      for (int r = 0; r < rows; ++r) {  // the rows in float32 (exact)
        const x_t* src = x + order[tile.first + r] * ldx;
        float* dst = xf.data() + r * K;
        int64_t k = 0;
        for (; k + 8 <= K; k += 8) store<8>(dst + k, load<8>(src + k));
        if (k < K) store_partial<8>(dst + k, load_partial<8>(src + k, static_cast<int>(K - k)), static_cast<int>(K - k));
      }
      const a_t* a = lora_a + tile.slot * K * J;  // [K, J]
      for (int64_t c = 0; c < J; c += kCols) {  // shrink: h [rows, J] float32
        const int ncols = static_cast<int>(std::min<int64_t>(kCols, J - c));
        columns(rows, xf.data(), K, a + c, J, K, ncols, acc);
        for (int r = 0; r < rows; ++r) {
          float* hr = h.data() + r * J + c;
          if (ncols == kCols) {
            store<8>(hr, acc[r][0]);
            store<8>(hr + 8, acc[r][1]);
          } else if (ncols > 8) {
            store<8>(hr, acc[r][0]);
            store_partial<8>(hr + 8, acc[r][1], ncols - 8);
          } else {
            store_partial<8>(hr, acc[r][0], ncols);
          }
        }
      }
      const a_t* b = lora_b + tile.slot * R * N;  // [R, N]
      int64_t n0 = 0;
      for (size_t p = 0; p < slice_sizes.size(); ++p) {  // expand: slice p's columns from h[:, p R : (p + 1) R]
        const int64_t n1 = n0 + slice_sizes[p];
        for (int64_t c = n0; c < n1; c += kCols) {
          const int ncols = static_cast<int>(std::min<int64_t>(kCols, n1 - c));
          columns(rows, h.data() + p * R, J, b + c, N, R, ncols, acc);
          for (int r = 0; r < rows; ++r) {
            x_t* o = out + order[tile.first + r] * ldo + c;
            if (ncols == kCols) {
              store<8>(o, load<8>(o) + acc[r][0]);
              store<8>(o + 8, load<8>(o + 8) + acc[r][1]);
            } else if (ncols > 8) {
              store<8>(o, load<8>(o) + acc[r][0]);
              store_partial<8>(o + 8, load_partial<8>(o + 8, ncols - 8) + acc[r][1], ncols - 8);
            } else {
              store_partial<8>(o, load_partial<8>(o, ncols) + acc[r][0], ncols);
            }
          }
        }
        n0 = n1;
      }
    }
  });
}

void add_lora_linear_cpu(const at::Tensor& out,      // [M, N], input's dtype, contiguous rows; += the deltas
                         const at::Tensor& input,    // [M, K] float32 / bfloat16 / float16, contiguous rows
                         const at::Tensor& lora_a,   // [S, K, P R]: A^T of each slot, parts side by side
                         const at::Tensor& lora_b,   // [S, R, N]: (scale B)^T of each slot, lora_a's dtype
                         const at::Tensor& slots,    // [M] int32, -1 or a slot < S
                         c10::IntArrayRef output_slices) {  // P sizes summing to N
  TORCH_CHECK(input.dim() == 2 && input.stride(1) == 1, "add_lora_linear: input must be [M, K] with contiguous rows, got ",
              input.sizes(), " strides ", input.strides());
  const int64_t M = input.size(0), K = input.size(1);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.stride(1) == 1 && (M <= 1 || out.stride(0) >= out.size(1)),
              "add_lora_linear: out must be [", M, ", N] with contiguous, non-overlapping rows, got ", out.sizes(), " strides ",
              out.strides());
  const int64_t N = out.size(1);
  TORCH_CHECK(lora_a.dim() == 3 && lora_a.size(1) == K && lora_a.is_contiguous(), "add_lora_linear: lora_a must be contiguous [S, ",
              K, ", P * R], got ", lora_a.sizes(), " strides ", lora_a.strides());
  const int64_t S = lora_a.size(0), J = lora_a.size(2);
  TORCH_CHECK(lora_b.dim() == 3 && lora_b.size(0) == S && lora_b.size(2) == N && lora_b.is_contiguous(),
              "add_lora_linear: lora_b must be contiguous [", S, ", R, ", N, "], got ", lora_b.sizes(), " strides ", lora_b.strides());
  const int64_t R = lora_b.size(1), P = static_cast<int64_t>(output_slices.size());
  TORCH_CHECK(P >= 1 && R * P == J, "add_lora_linear: lora_a's last dimension (", J, ") must be len(output_slices) (", P,
              ") * lora_b's rank R (", R, ")");
  int64_t total = 0;
  for (const int64_t size : output_slices) {
    TORCH_CHECK(size >= 0, "add_lora_linear: output_slices must be >= 0, got ", output_slices);
    total += size;
  }
  TORCH_CHECK(total == N, "add_lora_linear: output_slices ", output_slices, " must sum to out's columns ", N);
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == M && slots.scalar_type() == at::kInt,
              "add_lora_linear: slots must be int32 [", M, "], got ", slots.scalar_type(), " ", slots.sizes());
  const auto is_float = [](c10::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; };
  TORCH_CHECK(is_float(input.scalar_type()) && out.scalar_type() == input.scalar_type(),
              "add_lora_linear: input and out must be one dtype of float32, bfloat16, float16, got ", input.scalar_type(), " and ",
              out.scalar_type());
  TORCH_CHECK(is_float(lora_a.scalar_type()) && lora_b.scalar_type() == lora_a.scalar_type(),
              "add_lora_linear: lora_a and lora_b must be one dtype of float32, bfloat16, float16, got ", lora_a.scalar_type(),
              " and ", lora_b.scalar_type());
  for (const at::Tensor* t : {&out, &input, &lora_a, &lora_b, &slots})
    TORCH_CHECK(t->device().is_cpu(), "add_lora_linear (CPU kernel): tensors must be on the CPU, got one on ", t->device());
  at::assert_no_overlap(out, input);  // out is written while the others are read
  at::assert_no_overlap(out, lora_a);
  at::assert_no_overlap(out, lora_b);
  // The rows of each slot, in row order (a counting sort), then tiles of balanced sizes per slot.
  const at::Tensor slot_values = slots.contiguous();
  const int32_t* sv = slot_values.const_data_ptr<int32_t>();
  std::vector<int64_t> count(S + 1, 0);
  for (int64_t m = 0; m < M; ++m) {
    TORCH_CHECK(sv[m] >= -1 && sv[m] < S, "add_lora_linear: slots[", m, "] = ", sv[m], " must be -1 or in [0, ", S, ")");
    if (sv[m] >= 0) ++count[sv[m] + 1];
  }
  for (int64_t s = 0; s < S; ++s) count[s + 1] += count[s];
  std::vector<int64_t> order(count[S]), next(count.begin(), count.end() - 1);
  for (int64_t m = 0; m < M; ++m)
    if (sv[m] >= 0) order[next[sv[m]]++] = m;
  std::vector<Tile> tiles;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = count[s + 1] - count[s], num = (n + kLoraRows - 1) / kLoraRows;
    for (int64_t t = 0, first = count[s]; t < num; ++t) {
      const int rows = static_cast<int>(n / num + (t < n % num ? 1 : 0));
      tiles.push_back({s, first, rows});
      first += rows;
    }
  }
  if (tiles.empty() || N == 0) return;
  const std::vector<int64_t> slice_sizes(output_slices.begin(), output_slices.end());
  dispatch_float_types(input.scalar_type(), "add_lora_linear (input)", [&](auto xz) {
    using x_t = decltype(xz);
    dispatch_float_types(lora_a.scalar_type(), "add_lora_linear (lora_a)", [&](auto az) {
      using a_t = decltype(az);
      add_lora_linear_impl<x_t, a_t>(out.data_ptr<x_t>(), out.stride(0), input.const_data_ptr<x_t>(), input.stride(0), K, N,
                                     lora_a.const_data_ptr<a_t>(), lora_b.const_data_ptr<a_t>(), J, R, slice_sizes, order, tiles);
    });
  });
}

}  // namespace
}  // namespace pagedgen::cpu::lora

// Registered where the build has AVX2 and FMA, as packed_linear: elsewhere the reference runs.
#if defined(__AVX2__) && defined(__FMA__)
TORCH_LIBRARY_IMPL(pagedgen, CPU, m) { m.impl("add_lora_linear", &pagedgen::cpu::lora::add_lora_linear_cpu); }
#endif
