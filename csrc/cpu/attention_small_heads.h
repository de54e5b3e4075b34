// SIMD building blocks of the small-head path of the CPU paged attention kernel
// (csrc/cpu/attention_small.h, attend_small_rows), on AVX-512 (16-lane registers) and AVX2 + FMA
// (8-lane registers) builds: head sizes 8 and 16, where a K row of one head is at most one or two
// registers and per-(token, head) dot products with a horizontal sum would cost more than the
// multiply-adds themselves.
//
// The path works on the cache rows of several KV heads at once. In the cache layout
// [num_blocks, block_size, num_kv_heads, head_size] the heads of one token are contiguous, so a token
// row of an item's KV heads is C = heads * head_size consecutive floats, cut into column tiles of
// max(W, head_size) floats (W = kTokens lanes: 16 on AVX-512, a tile of one head of 16 or two of 8;
// 8 on AVX2, a tile of one head, of 8 or 16). For W tokens and one column tile, each W x W block of
// K is transposed in registers (vec.h's transpose<W>): register c then holds column c (one (head, d)
// pair) for the W tokens, and the scores of a query head are head_size vector multiply-adds with
// q[h, d] broadcast: W tokens per instruction, no horizontal sum. The arithmetic of a score does not
// depend on W (the same two chains of multiply-adds per lane), only how many tokens share it.
#pragma once

#include "vec.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define PAGEDGEN_SMALL_HEADS 1  // the build has the small-head path
#endif

#if defined(PAGEDGEN_SMALL_HEADS)
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#if defined(__AVX512F__)
// GCC 12 reports its own _mm512_undefined_* placeholders inside the intrinsics as maybe uninitialised.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace pagedgen::cpu::small_heads {

constexpr int kTokens = kLanes;  // tokens per transposed sub-tile (lanes of a register)
using Reg = Vec<kTokens>;

// Floats per column tile for heads of D floats: whole registers and whole heads.
template <int D>
constexpr int tile_columns() {
  return std::max(kTokens, D);
}
constexpr int kMaxColumns = tile_columns<16>();

// kTokens floats (or the first `width` of them, the rest zero) of a cache row, as float32.
template <typename scalar_t>
inline Reg load_row(const scalar_t* p, int width) {
#if defined(__AVX512F__)
  const __mmask16 mask = static_cast<__mmask16>((1u << width) - 1);
  __m512 r;
  if constexpr (std::is_same_v<scalar_t, float>) {
    r = _mm512_maskz_loadu_ps(mask, p);
  } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    // bf16 -> fp32 is the bf16 bits in the upper half of the fp32 word
    const __m256i h = _mm256_maskz_loadu_epi16(mask, p);
    r = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    r = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
  }
  return reinterpret_cast<const Reg&>(r);
#else
  return width == kTokens ? load<kTokens>(p) : load_partial<kTokens>(p, width);
#endif
}

// Scores of the `group` query heads of one KV head whose columns are cols[K0 .. K0 + D) (K0 a
// compile-time constant, so that the columns stay in registers): sc row g = sum_d q[g, d] * col[d],
// as two chains (even and odd d) added at the end.
template <int D, int K0>
inline void score_kv_head(const Reg* cols, const float* q, int group, float* sc, int64_t sc_stride) {
  for (int g = 0; g < group; ++g) {
    const float* qg = q + g * D;
    Reg s0 = splat<kTokens>(qg[0]) * cols[K0];
    Reg s1 = splat<kTokens>(qg[1]) * cols[K0 + 1];
#pragma GCC unroll 16
    for (int d = 2; d < D; d += 2) {  // two chains: half the latency of one
      s0 = fmadd<kTokens>(splat<kTokens>(qg[d]), cols[K0 + d], s0);
      s1 = fmadd<kTokens>(splat<kTokens>(qg[d + 1]), cols[K0 + d + 1], s1);
    }
    store<kTokens>(sc + g * sc_stride, s0 + s1);
  }
}

// The kTokens tokens x tile_columns<D>() columns block of one column tile of K, transposed: r[c]
// holds column c (one (head, d) pair) for the kTokens tokens.
//   row(j): token j's row at the tile's first column, for j in [0, kTokens) (rows of tokens the
//           caller does not attend to may be any readable row of kMaxColumns elements, e.g. a zero
//           row: its softmax masks their lanes);
//   width: valid columns (the whole tile, or 8 for a last lone head of size 8 on AVX-512).
template <int D, typename Row>
inline void load_column_tile(const Row& row, int width, Reg r[tile_columns<D>()]) {
  constexpr int kBlocks = tile_columns<D>() / kTokens;
#pragma GCC unroll 2
  for (int b = 0; b < kBlocks; ++b) {
    const int w = std::clamp(width - b * kTokens, 0, kTokens);
#pragma GCC unroll 16
    for (int j = 0; j < kTokens; ++j) r[b * kTokens + j] = load_row(row(j) + b * kTokens, w);
    transpose<kTokens>(r + b * kTokens);
  }
}

// Scores of the kTokens tokens of a transposed column tile r for the query heads whose KV heads lie
// in it (one head, or on AVX-512 one or two heads of 8: `width`).
//   q: [heads of the tile * group, D] scaled queries, head-major as in the model;
//   sc: row h gets the kTokens scores of query head h, rows sc_stride floats apart.
// Each lane (token) is computed on its own: the other lanes do not change its bits.
template <int D>
inline void score_column_heads(const Reg r[tile_columns<D>()], int width, const float* q, int group, float* sc,
                               int64_t sc_stride) {
  static_assert(D == 8 || D == 16, "small-head path: head size 8 or 16");
  score_kv_head<D, 0>(r, q, group, sc, sc_stride);
  if constexpr (tile_columns<D>() == 2 * D) {
    if (width == 2 * D) score_kv_head<D, D>(r, q + group * D, group, sc + group * sc_stride, sc_stride);
  }
}

}  // namespace pagedgen::cpu::small_heads
#endif  // PAGEDGEN_SMALL_HEADS
