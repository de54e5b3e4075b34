// CPU kernel of pagedgen::packed_linear (schema in csrc/ops.cpp, oracle in pagedgen/ops/reference.py):
// out [M, N] = input [M, K] @ W^T (+ bias) with the weight W [N, K] stored as panels of 16 output
// features, weight [P, K, 16] with P = ceil(N / 16) and weight[p, k, j] = W[16 p + j, k] (zero rows
// pad the last panel; pagedgen.layers.linear.pack_panels makes them once, after loading).
//
// Why a GEMM of our own (benchmarks/results/history.md, "Matmul choices"): on CPUs without fast bf16 matmuls
// (AVX2, no AVX-512 BF16 / AMX) torch's bf16 GEMM runs at ~10-20 GFLOP/s, so bf16 models were
// multiplied in float32 on float32 copies of the weights: twice the bytes to read, where a GEMM of a
// few rows is bound by reading its weight. Here the weights stay in the model dtype (bf16/fp16
// converted to float32 as they are loaded, exactly) and every product is accumulated in float32.
// Measured on the AVX2 AMD EPYC with the weights cold (2 threads), on bf16 weights against oneDNN's
// prepacked float32 inner product on float32 copies: 1.4-2.4x at 1-4 rows, 0.95-1.4x at 16-48 rows,
// 0.7-1.0x at 256 and more (prefill), where oneDNN's larger tiles win.
//
// Batch invariance by construction: out[m, n] is always the same sequence of float32 fused
// multiply-adds, k = 0, 1, ..., K - 1, from 0, then + bias[n], rounded once to the output dtype,
// whatever M, the row's position, the tiling or the thread count. No row blocks, no padding.
//
// Where it runs (pagedgen.layers.linear.choose_matmul): every model dtype on AVX2 CPUs (the AMD EPYC
// kind without AVX-512). Builds with AVX-512 register it too (AVX2 and FMA are implied), but there
// "auto" does not choose it: bf16 models on AVX-512 BF16 CPUs without AMX take packed_linear_bf16
// (csrc/cpu/linear_avx512.cpp), other dtypes and AMX CPUs oneDNN; PAGEDGEN_CPU_MATMUL=pagedgen
// chooses it for float32/fp16 there.
//
// Layout of the work: a micro-kernel keeps a tile of up to 6 rows x 16 outputs in 12 registers of 8
// floats; each k broadcasts one input element per row and loads one panel row of 16 weights (BLIS's
// 6x16 AVX2 kernel shape). Threads split the panels (each weight byte is read by one thread); within
// a thread, blocks of rows (sized so that their float32 inputs stay in L2) sweep the thread's panels.
// A block's rows go in tiles of balanced sizes (8 rows: 4 + 4), and from 3 rows on, the first tile of
// each panel prefetches the thread's next panel into L2 as it goes. Measured on the AMD EPYC Zen 4
// running this AVX2 code (2 threads, weights cold, random-135m shapes, GFLOP/s before -> after): bf16
// 8 rows 90-122 -> 128-161, 4 rows 76-109 -> 101-157, 32 rows 147-162 -> 165-190, fp32 8 rows 73-88
// -> 95-113, 1 row unchanged (benchmarks/results/history.md, "Matmul choices": "balanced tiles and next-panel
// prefetch"); not yet measured on the AVX2-only kind.
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "linear_panel.h"
#include "vec.h"

namespace pagedgen::cpu {
namespace {

constexpr int kPanel = 16;               // output features per panel (two vectors of 8)
constexpr int kTileRows = 6;             // rows per micro-kernel tile
constexpr int64_t kRowBlockBytes = 160 << 10;  // float32 input rows kept in L2 while a thread sweeps its panels
constexpr int64_t kMinMacsPerThread = 1 << 15;  // smaller GEMMs run on one thread
constexpr int64_t kPrefetchMinRows = 3;  // fewer rows are bound by the weights' reads: a second stream slowed 1 row
using V8 = Vec<8>;

// One tile: out[r, 0:ncols] for rows r < R of x (row stride ldx, float32), panel w [K, 16].
// Only rows r < R are computed (the `if constexpr`s; the row pointers past R are never read), and
// each row's arithmetic is the same for every R. Accumulators are named variables, not an array:
// GCC keeps an array of vectors on the stack and stores it back every iteration.
// next: a panel to prefetch into L2 as the tile goes (one line per 64 bytes of w read), or nullptr.
template <int R, typename w_t, typename out_t>
PAGEDGEN_ALWAYS_INLINE void tile(const float* x, int64_t ldx, const w_t* w, int64_t K, const float* bias, out_t* out,
                                 int64_t ldo, int ncols, const w_t* next = nullptr) {
  static_assert(R >= 1 && R <= kTileRows);
  const float* x0 = x;
  const float* x1 = x + std::min(1, R - 1) * ldx;
  const float* x2 = x + std::min(2, R - 1) * ldx;
  const float* x3 = x + std::min(3, R - 1) * ldx;
  const float* x4 = x + std::min(4, R - 1) * ldx;
  const float* x5 = x + std::min(5, R - 1) * ldx;
  V8 a00 = {}, a01 = {}, a10 = {}, a11 = {}, a20 = {}, a21 = {}, a30 = {}, a31 = {}, a40 = {}, a41 = {}, a50 = {}, a51 = {};
#define PAGEDGEN_TILE_ROW(r)                  \
  {                                           \
    const V8 b = splat<8>(x##r[k]);           \
    a##r##0 = fmadd<8>(b, w0, a##r##0);       \
    a##r##1 = fmadd<8>(b, w1, a##r##1);       \
  }
  constexpr int64_t kLineMask = 64 / (kPanel * sizeof(w_t)) - 1;  // a panel row is 64 bytes (float) or 32
  for (int64_t k = 0; k < K; ++k) {
    const V8 w0 = load<8>(w + k * kPanel), w1 = load<8>(w + k * kPanel + 8);
    if (next != nullptr && (k & kLineMask) == 0) __builtin_prefetch(next + k * kPanel, 0, 2);
    PAGEDGEN_TILE_ROW(0)
    if constexpr (R > 1) PAGEDGEN_TILE_ROW(1)
    if constexpr (R > 2) PAGEDGEN_TILE_ROW(2)
    if constexpr (R > 3) PAGEDGEN_TILE_ROW(3)
    if constexpr (R > 4) PAGEDGEN_TILE_ROW(4)
    if constexpr (R > 5) PAGEDGEN_TILE_ROW(5)
  }
#undef PAGEDGEN_TILE_ROW
  const V8 acc[kTileRows][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}, {a40, a41}, {a50, a51}};
  const V8 b0 = bias ? load<8>(bias) : V8{}, b1 = bias ? load<8>(bias + 8) : V8{};
  for (int r = 0; r < R; ++r) {
    const V8 y0 = bias ? acc[r][0] + b0 : acc[r][0], y1 = bias ? acc[r][1] + b1 : acc[r][1];
    store_panel_row(out + r * ldo, y0, y1, ncols);
  }
}

// Rows [m0, m1) of panel p (w: its [K, 16] weights, in w_t) in ceil(rows / 6) tiles of balanced sizes
// (8 rows: 4 + 4, not 6 + 2): a tile of 1-3 rows has too few accumulators to cover the multiply-adds'
// latency, so a small leftover tile ran at half speed. A row's arithmetic is the same in every tile
// size. The first tile prefetches `next` (the thread's next panel, or nullptr): the weights are cold
// (a model's layers do not fit the caches), and the next panel's reads then overlap this one's compute.
template <typename w_t, typename out_t>
inline void panel_tiles(const float* x, int64_t ldx, const w_t* w, int64_t K, int ncols, const float* bias, out_t* out,
                        int64_t ldo, int64_t m0, int64_t m1, const w_t* next) {
  const int64_t tiles = (m1 - m0 + kTileRows - 1) / kTileRows;
  const int64_t base = tiles ? (m1 - m0) / tiles : 0, longer = tiles ? (m1 - m0) % tiles : 0;
  int64_t m = m0;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t rows = base + (t < longer ? 1 : 0);
    const float* xm = x + m * ldx;
    out_t* om = out + m * ldo;
    const w_t* pf = t == 0 ? next : nullptr;
    switch (rows) {
      case 6: tile<6>(xm, ldx, w, K, bias, om, ldo, ncols, pf); break;
      case 5: tile<5>(xm, ldx, w, K, bias, om, ldo, ncols, pf); break;
      case 4: tile<4>(xm, ldx, w, K, bias, om, ldo, ncols, pf); break;
      case 3: tile<3>(xm, ldx, w, K, bias, om, ldo, ncols, pf); break;
      case 2: tile<2>(xm, ldx, w, K, bias, om, ldo, ncols, pf); break;
      case 1: tile<1>(xm, ldx, w, K, bias, om, ldo, ncols, pf); break;
      default: break;
    }
    m += rows;
  }
}

// Rows [m0, m1) of the panel p. From kConvertRows rows on, a bf16/fp16 panel is first converted to
// float32 into `wbuf` ([K, 16], per thread) and the tiles read that: the conversion (exact) then runs
// once per panel instead of once per tile, and the tiles' inner loop is multiply-adds and loads only.
// The products and sums are the same either way.
constexpr int64_t kConvertRows = 4 * kTileRows;
// last: the thread's last panel + 1 (the panel after p is prefetched while p is computed if p + 1 < last).
template <typename w_t, typename out_t>
inline void panel_rows(const float* x, int64_t ldx, const w_t* weight, int64_t K, int64_t N, const float* bias,
                       out_t* out, int64_t ldo, int64_t p, int64_t last, int64_t m0, int64_t m1, float* wbuf) {
  const w_t* w = weight + p * K * kPanel;
  const w_t* next = p + 1 < last && m1 - m0 >= kPrefetchMinRows ? w + K * kPanel : nullptr;
  const int ncols = static_cast<int>(std::min<int64_t>(kPanel, N - p * kPanel));
  const float* b = bias ? bias + p * kPanel : nullptr;
  if constexpr (!std::is_same_v<w_t, float>) {
    if (m1 - m0 >= kConvertRows) {
      constexpr int64_t kLine = 64 / sizeof(w_t);  // elements of w_t per cache line
      for (int64_t i = 0; i < K * kPanel; i += 8) {
        if (next != nullptr && i % kLine == 0) __builtin_prefetch(next + i, 0, 2);
        store<8>(wbuf + i, load<8>(w + i));
      }
      panel_tiles(x, ldx, static_cast<const float*>(wbuf), K, ncols, b, out + p * kPanel, ldo, m0, m1,
                  static_cast<const float*>(nullptr));
      return;
    }
  }
  panel_tiles(x, ldx, w, K, ncols, b, out + p * kPanel, ldo, m0, m1, next);
}

template <typename w_t, typename out_t>
void packed_linear_impl(const float* x, int64_t ldx, int64_t M, int64_t K, const w_t* weight, int64_t N,
                        const float* bias, out_t* out, int64_t ldo) {
  const int64_t P = (N + kPanel - 1) / kPanel;
  // rows per block: a multiple of the tile, its float32 inputs about kRowBlockBytes
  const int64_t block = std::max<int64_t>(kTileRows, kRowBlockBytes / (4 * std::max<int64_t>(K, 1)) / kTileRows * kTileRows);
  const int64_t macs_per_panel = M * std::max<int64_t>(K, 1) * kPanel;
  const int64_t grain = std::max<int64_t>(1, kMinMacsPerThread / macs_per_panel);
  if (P >= at::get_num_threads() || M <= block) {  // threads split the panels
    at::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) {
      std::vector<float> wbuf(std::is_same_v<w_t, float> || M < kConvertRows ? 0 : K * kPanel);
      for (int64_t m0 = 0; m0 < M; m0 += block) {
        const int64_t m1 = std::min(M, m0 + block);
        for (int64_t p = p0; p < p1; ++p) panel_rows(x, ldx, weight, K, N, bias, out, ldo, p, p1, m0, m1, wbuf.data());
      }
    });
  } else {  // fewer panels than threads: they split the row blocks
    const int64_t blocks = (M + block - 1) / block;
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      std::vector<float> wbuf(std::is_same_v<w_t, float> ? 0 : K * kPanel);
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t m0 = b * block, m1 = std::min(M, m0 + block);
        for (int64_t p = 0; p < P; ++p) panel_rows(x, ldx, weight, K, N, bias, out, ldo, p, P, m0, m1, wbuf.data());
      }
    });
  }
}

void packed_linear_cpu(const at::Tensor& out,      // [M, N], input's dtype
                       const at::Tensor& input,    // [M, K] float32 / bfloat16 / float16, contiguous rows
                       const at::Tensor& weight,   // [ceil(N / 16), K, 16] float32 / bfloat16 / float16, contiguous
                       const c10::optional<at::Tensor>& bias) {  // [N], any of those dtypes, or None
  TORCH_CHECK(out.device().is_cpu() && input.device().is_cpu() && weight.device().is_cpu(),
              "packed_linear (CPU kernel): tensors must be on the CPU");
  const auto is_float = [](c10::ScalarType t) {
    return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
  };
  TORCH_CHECK(is_float(input.scalar_type()) && is_float(weight.scalar_type()),
              "packed_linear: input and weight must be float32, bfloat16 or float16, got ", input.scalar_type(), " and ",
              weight.scalar_type());
  TORCH_CHECK(input.dim() == 2 && input.stride(1) == 1, "packed_linear: input must be [M, K] with contiguous rows, got ",
              input.sizes(), " strides ", input.strides());
  const int64_t M = input.size(0), K = input.size(1);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.stride(1) == 1 && (M <= 1 || out.stride(0) >= out.size(1)) &&
                  out.scalar_type() == input.scalar_type(),
              "packed_linear: out must be ", input.scalar_type(), " [", M, ", N] with contiguous, non-overlapping rows, got ",
              out.scalar_type(), " ", out.sizes(), " strides ", out.strides());
  const int64_t N = out.size(1), P = (N + kPanel - 1) / kPanel;
  TORCH_CHECK(weight.dim() == 3 && weight.size(0) == P && weight.size(1) == K && weight.size(2) == kPanel && weight.is_contiguous(),
              "packed_linear: weight must be contiguous panels [", P, ", ", K, ", ", kPanel, "] for N = ", N, " outputs of K = ",
              K, " inputs, got ", weight.sizes(), " strides ", weight.strides());
  at::assert_no_overlap(out, input);  // out is written while input is read
  at::assert_no_overlap(out, weight);
  at::Tensor b;  // the bias as float32 (exact), zero-padded to whole panels
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->device().is_cpu() && is_float(bias->scalar_type()),
                "packed_linear: bias must be float32, bfloat16 or float16 [", N, "] on the CPU, got ", bias->scalar_type(), " ",
                bias->sizes(), " on ", bias->device());
    b = at::zeros({P * kPanel}, input.options().dtype(at::kFloat));
    b.narrow(0, 0, N).copy_(*bias);
  }
  if (M == 0 || N == 0) return;
  const at::Tensor x = input.scalar_type() == at::kFloat ? input : input.to(at::kFloat);  // [M, K] float32
  dispatch_float_types(weight.scalar_type(), "packed_linear (weight)", [&](auto wz) {
    using w_t = decltype(wz);
    dispatch_float_types(out.scalar_type(), "packed_linear (input)", [&](auto oz) {
      using out_t = decltype(oz);
      packed_linear_impl<w_t, out_t>(x.const_data_ptr<float>(), x.stride(0), M, K, weight.const_data_ptr<w_t>(), N,
                                     b.defined() ? b.const_data_ptr<float>() : nullptr, out.data_ptr<out_t>(), out.stride(0));
    });
  });
}

}  // namespace
}  // namespace pagedgen::cpu

// Registered only where the build has AVX2 and FMA (-march of setup.py): elsewhere the tile's vectors
// would run lane by lane, and pagedgen.layers.linear does not choose this path (no CPU kernel).
#if defined(__AVX2__) && defined(__FMA__)
TORCH_LIBRARY_IMPL(pagedgen, CPU, m) { m.impl("packed_linear", &pagedgen::cpu::packed_linear_cpu); }
#endif
