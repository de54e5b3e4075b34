// CPU kernel of pagedgen::packed_linear_bf16 (schema in csrc/ops.cpp, oracle in pagedgen/ops/reference.py):
// out [M, N] (bf16) = input [M, K] (bf16) @ W^T (+ bias) with W [N, K] stored as bf16 pairs in panels
// of 16 output features, weight [P, Q, 16, 2] with P = ceil(N / 16), Q = ceil(K / 2) and
// weight[p, q, j, t] = W[16 p + j, 2 q + t] (zeros pad the last panel and, for odd K, the last pair;
// pagedgen.layers.linear.pack_pairs makes them once, after loading). One panel row [q] is one 512-bit
// register: the 16 outputs' weights of the input pair (2 q, 2 q + 1), the layout AVX512-BF16's
// vdpbf16ps (and AMX's tdpbf16ps, whose B tiles hold the same pairs) multiplies.
//
// Where it runs (pagedgen.layers.linear.choose_matmul): bf16 models on CPUs with AVX512-BF16 and no
// AMX (the AMD EPYC Zen 4 kind; measured there, benchmarks/results/history.md 2026-12-04). On a Xeon with AMX,
// oneDNN's AMX GEMM (in row blocks) stays the default: an AMX micro-kernel (tdpbf16ps) can read these
// same packed pairs (one B tile = 16 consecutive panel rows [q] of one panel: 16 pairs x 16 outputs)
// and sit beside tile<R, C> below, chosen by the build's __AMX_BF16__ and the CPU; it is to be
// chosen there only once measured faster and bitwise row-invariant (its bits need not be these).
//
// Batch invariance by construction: out[m, n] is always acc = 0; for q = 0 .. Q - 1: acc = vdpbf16ps(acc,
// (x[m, 2q], x[m, 2q + 1]), (W[n, 2q], W[n, 2q + 1])) (one instruction per pair, in q order), then +
// bias[n] in float32, rounded once to bf16, whatever M, the row's position, the tile or the thread count.
// (vdpbf16ps adds the two exact products into the float32 accumulator with round to nearest even and
// flushes denormals to zero; its bits can differ from two fused multiply-adds, so this op's results are
// not packed_linear's, but they are always the same for a row.) An odd K's last pair is (x[m, K - 1], 0).
//
// Layout of the work: a tile of R rows x C panels keeps R x C accumulators (R <= 12 with C = 2, R <= 6
// with C = 4: at most 24 of the 32 vector registers) and, per pair, loads C panel rows and broadcasts
// one input pair per row. Threads split the panels (each weight byte is read by one thread); within a
// thread, blocks of rows (sized so that their inputs stay in L2) sweep the thread's panels. From 7 rows on,
// where a tile's rows would crowd the L1 sets (rows 4 KiB apart: rows_crowd_l1), a block's inputs are
// first copied pair by pair into tile order (pack_rows: one stream per tile); other rows are read
// where they are (the copy cost up to 8% at K = 1,536). The copy moves bits, so the arithmetic is the same.
// Weights are cold (a model's layers do not fit the caches) and each tile reads its panels in one
// sequential pass, so every tile prefetches the next panels of its thread into L2 (the same pair's
// line of each, one per pair): the next tile's memory reads overlap this one's compute. Measured on
// the AMD EPYC Zen 4 (one thread, thread CPU time, random-135m shapes, weights cold), GFLOP/s without
// -> with: 8 rows 114-152 -> 149-207 (lm_head 111-137 -> 199-207), 4 rows 85-121 -> 91-155, 32 rows
// 179-208 -> 197-218, 1 and 256 rows unchanged; prefetches move no data the kernel computes with.
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__)

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "linear_bf16_checks.h"
#include "vec.h"

// Its own namespace: csrc/cpu_kernels.cpp compiles this file in one unit with linear.cpp, whose tile
// constants have the same names.
namespace pagedgen::cpu::bf16_pairs {
namespace {

constexpr int kPanel = 16;                      // outputs per panel: the float32 lanes of a 512-bit register
constexpr int kTileRows = 12;                   // rows of a full tile (C = 2 panels)
constexpr int kWideRows = 6;                    // at most this many rows: one tile of C = 4 panels
constexpr int64_t kRowBlockBytes = 512 << 10;   // bf16 input rows kept in L2 (1 MiB on Zen 4) while a thread sweeps its panels
constexpr int64_t kMinBlockRows = 96;           // rows per block at least
constexpr int64_t kMinMacsPerThread = 1 << 15;  // smaller GEMMs run on one thread

// The input pair (p[0], p[1]) in every 32-bit lane; with `half`, (p[0], 0): an odd K's last pair.
template <bool half>
PAGEDGEN_ALWAYS_INLINE __m512bh pair(const uint16_t* p) {
  uint32_t d;
  if constexpr (half) {
    d = p[0];
  } else {
    std::memcpy(&d, p, sizeof(d));
  }
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(d)));
}

// One tile: out[r, 16 c + j] for rows r < R of x and the C panels at w (panel c at w + c * ldw, ldw =
// Q * 32). Row r's pair q is the 32 bits at x + r * rs + q * qs (bf16 units): the rows themselves (rs =
// the row stride, qs = 2; then an odd K's half pair is read as such) or a packed copy (rs = 2, qs = 2 R,
// the half pair already padded with a zero: K even as far as the tile is concerned). Only rows r < R
// are read; each row's instructions are the same for every R, C and x layout. ncols: outputs of the
// last panel that exist (16 but in the last panel of N).
template <int R, int C>
PAGEDGEN_ALWAYS_INLINE void tile(const uint16_t* x, int64_t rs, int64_t qs, const uint16_t* w, int64_t ldw, int64_t K,
                                 const float* bias, c10::BFloat16* out, int64_t ldo, int ncols,
                                 const uint16_t* next = nullptr) {
  static_assert(R >= 1 && R * C <= 24 && (C == 1 || C == 2 || C == 4));
  __m512 acc[R][C];
#pragma GCC unroll 24
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t pairs = K / 2;
  for (int64_t q = 0; q < pairs; ++q) {
    __m512bh wv[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) wv[c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + c * ldw + q * 2 * kPanel));
    if (next != nullptr) {  // the same pair's line of the next C panels, into L2 (its loads are ldw apart)
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) __builtin_prefetch(next + c * ldw + q * 2 * kPanel, 0, 2);
    }
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = pair<false>(x + r * rs + q * qs);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
    }
  }
  if (K % 2) {  // the last pair (x[K - 1], 0) against (W[n, K - 1], 0)
    __m512bh wv[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) wv[c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + c * ldw + pairs * 2 * kPanel));
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = pair<true>(x + r * rs + pairs * qs);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
    }
  }
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c) {
    const __m512 b = bias ? _mm512_loadu_ps(bias + c * kPanel) : _mm512_setzero_ps();
    const int n = c + 1 == C ? ncols : kPanel;
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512 y = bias ? _mm512_add_ps(acc[r][c], b) : acc[r][c];
      const Vec<16> v = reinterpret_cast<const Vec<16>&>(y);
      c10::BFloat16* o = out + r * ldo + c * kPanel;
      if (n == kPanel) {
        store<16>(o, v);
      } else {
        store_partial<16>(o, v, n);
      }
    }
  }
}

struct Gemm {
  const uint16_t* x;  // [M, K] bf16 bits, row stride ldx
  int64_t ldx, M, K;
  const uint16_t* w;  // [P, Q, 16, 2] bf16 bits
  int64_t N, P, ldw;  // ldw = Q * 32: elements per panel
  const float* bias;  // [P * 16] float32 (zero-padded) or nullptr
  c10::BFloat16* out;  // [M, N], row stride ldo
  int64_t ldo;
};

// Rows [m, m + R) (R = 1 .. kTileRows) of the C panels from p, their pairs read from x (layout as in
// tile: rs, qs; k: K, or K rounded up to even for a packed copy).
template <int C>
PAGEDGEN_ALWAYS_INLINE void rows_of_panels(const Gemm& g, int64_t p, int64_t m, int R, const uint16_t* x, int64_t rs, int64_t qs,
                                           int64_t k, const uint16_t* next = nullptr) {
  const uint16_t* w = g.w + p * g.ldw;
  const float* b = g.bias ? g.bias + p * kPanel : nullptr;
  c10::BFloat16* o = g.out + m * g.ldo + p * kPanel;
  const int ncols = static_cast<int>(std::min<int64_t>(kPanel, g.N - (p + C - 1) * kPanel));
  switch (R) {
#define PAGEDGEN_TILE_CASE(r) \
  case r: if constexpr (r * C <= 24) tile<r, C>(x, rs, qs, w, g.ldw, k, b, o, g.ldo, ncols, next); break;
    PAGEDGEN_TILE_CASE(1) PAGEDGEN_TILE_CASE(2) PAGEDGEN_TILE_CASE(3) PAGEDGEN_TILE_CASE(4) PAGEDGEN_TILE_CASE(5)
    PAGEDGEN_TILE_CASE(6) PAGEDGEN_TILE_CASE(7) PAGEDGEN_TILE_CASE(8) PAGEDGEN_TILE_CASE(9) PAGEDGEN_TILE_CASE(10)
    PAGEDGEN_TILE_CASE(11) PAGEDGEN_TILE_CASE(12)
#undef PAGEDGEN_TILE_CASE
    default: break;
  }
}

// Rows [m0, m1) of x copied into `packed` tile by tile (tiles of kTileRows rows from m0, the last one
// shorter): tile t's pair q of row r is packed[t * kTileRows * Q + q * R_t + r] (R_t: its rows), an odd
// K's last pair as (x[K - 1], 0). The tile then reads one sequential stream instead of R rows, which
// for rows of 4 KiB (K = 2,048) would all fall in the same L1 sets.
void pack_rows(const Gemm& g, int64_t m0, int64_t m1, uint32_t* packed) {
  const int64_t Q = (g.K + 1) / 2, full = g.K / 2;
  for (int64_t mt = m0; mt < m1; mt += kTileRows) {
    const int R = static_cast<int>(std::min<int64_t>(kTileRows, m1 - mt));
    uint32_t* dst = packed + (mt - m0) * Q;
    for (int r = 0; r < R; ++r) {
      const uint16_t* xr = g.x + (mt + r) * g.ldx;
      for (int64_t q = 0; q < full; ++q) std::memcpy(dst + q * R + r, xr + 2 * q, sizeof(uint32_t));
      if (g.K % 2) dst[full * R + r] = xr[2 * full];
    }
  }
}

// Whether a tile's kTileRows input rows, ldx elements apart, would crowd the L1 sets (32 KiB, 8 ways,
// 64 sets of 64-byte lines): more than 3 rows in one set, with the weights' streams beside them, evict
// each other (rows 4 KiB apart all share one set). Such rows are packed first (pack_rows); others are
// read where they are, which saves the copy. Either way the tile computes the same bits.
bool rows_crowd_l1(int64_t ldx) {
  int count[64] = {0};
  int most = 0;
  for (int r = 0; r < kTileRows; ++r) most = std::max(most, ++count[(r * ldx * 2 / 64) % 64]);
  return most > 3;
}

// The weights of the next 2 panels (p + 2, p + 3) of this thread (panels [.., p1)), which each row
// tile of panels (p, p + 1) prefetches into L2 as it goes (one line per panel per pair: the next
// pair's memory reads hide behind this pair's compute), or nullptr past the thread's last pair.
PAGEDGEN_ALWAYS_INLINE const uint16_t* next_panels(const Gemm& g, int64_t p, int64_t p1) {
  return p + 4 <= p1 ? g.w + (p + 2) * g.ldw : nullptr;
}

// Rows [m0, m1) of panels [p0, p1) in tiles of 2 panels and up to kTileRows rows read from x as it is
// (its own function: inlined into block, its tiles' code made the packed path's slower).
__attribute__((noinline)) void block_in_place(const Gemm& g, int64_t p0, int64_t p1, int64_t m0, int64_t m1) {
  for (int64_t p = p0; p < p1; p += 2) {
    for (int64_t m = m0; m < m1; m += kTileRows) {
      const int R = static_cast<int>(std::min<int64_t>(kTileRows, m1 - m));
      const uint16_t* x = g.x + m * g.ldx;
      if (p + 2 <= p1) {
        rows_of_panels<2>(g, p, m, R, x, g.ldx, 2, g.K, next_panels(g, p, p1));
      } else {
        rows_of_panels<1>(g, p, m, R, x, g.ldx, 2, g.K);
      }
    }
  }
}

// Rows [m0, m1) of panels [p0, p1): a few rows (<= kWideRows) take tiles of 4 panels, read from x as it
// is; more rows take tiles of 2 panels and up to kTileRows rows, read from x as it is or, where its
// rows would crowd L1 (rows_crowd_l1), packed first (pack_rows, into `packed`); a leftover panel gets
// a tile of its own.
void block(const Gemm& g, int64_t p0, int64_t p1, int64_t m0, int64_t m1, uint32_t* packed) {
  if (m1 - m0 <= kWideRows) {
    const int R = static_cast<int>(m1 - m0);
    const uint16_t* x = g.x + m0 * g.ldx;
    int64_t p = p0;
    for (; p + 4 <= p1; p += 4) {
      rows_of_panels<4>(g, p, m0, R, x, g.ldx, 2, g.K, p + 8 <= p1 ? g.w + (p + 4) * g.ldw : nullptr);
    }
    for (; p + 2 <= p1; p += 2) rows_of_panels<2>(g, p, m0, R, x, g.ldx, 2, g.K);
    if (p < p1) rows_of_panels<1>(g, p, m0, R, x, g.ldx, 2, g.K);
    return;
  }
  if (!rows_crowd_l1(g.ldx)) {
    block_in_place(g, p0, p1, m0, m1);
    return;
  }
  const int64_t Q = (g.K + 1) / 2;
  pack_rows(g, m0, m1, packed);
  for (int64_t p = p0; p < p1; p += 2) {
    for (int64_t m = m0; m < m1; m += kTileRows) {
      const int R = static_cast<int>(std::min<int64_t>(kTileRows, m1 - m));
      const uint16_t* x = reinterpret_cast<const uint16_t*>(packed + (m - m0) * Q);
      if (p + 2 <= p1) {
        rows_of_panels<2>(g, p, m, R, x, 2, 2 * R, 2 * Q, next_panels(g, p, p1));
      } else {
        rows_of_panels<1>(g, p, m, R, x, 2, 2 * R, 2 * Q);
      }
    }
  }
}

void run(const Gemm& g) {
  // rows per block: a multiple of the tile, its bf16 inputs about kRowBlockBytes but at least
  // kMinBlockRows (a long K would otherwise make blocks so short that the weights, read again for
  // each block, come from memory for a few rows each time)
  const int64_t rows = std::max<int64_t>(kMinBlockRows, kRowBlockBytes / (2 * std::max<int64_t>(g.K, 1)) / kTileRows * kTileRows);
  const int64_t Q = (g.K + 1) / 2;
  const int64_t width = g.M <= kWideRows ? 4 : 2;  // the threads split groups of whole tiles' panels
  const int64_t groups = (g.P + width - 1) / width;
  const int64_t macs_per_group = g.M * std::max<int64_t>(g.K, 1) * width * kPanel;
  const int64_t grain = std::max<int64_t>(1, kMinMacsPerThread / macs_per_group);
  if (groups >= at::get_num_threads() || g.M <= rows) {  // threads split the panels
    at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
      std::vector<uint32_t> packed(g.M > kWideRows && rows_crowd_l1(g.ldx) ? std::min(g.M, rows) * Q : 0);
      const int64_t p0 = width * g0, p1 = std::min(g.P, width * g1);
      for (int64_t m0 = 0; m0 < g.M; m0 += rows) block(g, p0, p1, m0, std::min(g.M, m0 + rows), packed.data());
    });
  } else {  // fewer panel groups than threads: they split the row blocks
    const int64_t blocks = (g.M + rows - 1) / rows;
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      std::vector<uint32_t> packed(rows_crowd_l1(g.ldx) ? rows * Q : 0);
      for (int64_t b = b0; b < b1; ++b) block(g, 0, g.P, b * rows, std::min(g.M, (b + 1) * rows), packed.data());
    });
  }
}

void packed_linear_bf16_cpu(const at::Tensor& out,      // [M, N] bfloat16
                            const at::Tensor& input,    // [M, K] bfloat16, contiguous rows
                            const at::Tensor& weight,   // [ceil(N / 16), ceil(K / 2), 16, 2] bfloat16, contiguous
                            const c10::optional<at::Tensor>& bias) {  // [N] float32 / bfloat16 / float16, or None
  const at::Tensor b = check_packed_linear_bf16("packed_linear_bf16", out, input, weight, bias);
  const int64_t M = input.size(0), K = input.size(1), N = out.size(1), P = (N + kPanel - 1) / kPanel, Q = (K + 1) / 2;
  if (M == 0 || N == 0) return;
  const Gemm g{reinterpret_cast<const uint16_t*>(input.const_data_ptr<at::BFloat16>()), input.stride(0), M, K,
               reinterpret_cast<const uint16_t*>(weight.const_data_ptr<at::BFloat16>()), N, P, Q * 2 * kPanel,
               b.defined() ? b.const_data_ptr<float>() : nullptr, out.data_ptr<at::BFloat16>(), out.stride(0)};
  run(g);
}

}  // namespace
}  // namespace pagedgen::cpu::bf16_pairs

// Registered only where the build has AVX512-BF16 (-march of setup.py); elsewhere the op has no CPU
// kernel and pagedgen.layers.linear does not choose it (ops.has_kernel("packed_linear_bf16")).
TORCH_LIBRARY_IMPL(pagedgen, CPU, m) { m.impl("packed_linear_bf16", &pagedgen::cpu::bf16_pairs::packed_linear_bf16_cpu); }

#endif  // __AVX512F__ && __AVX512BF16__
