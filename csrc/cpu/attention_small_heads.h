// AVX-512 building blocks of the small-head path of the CPU paged attention kernel
// (csrc/cpu/attention_small.h, attend_small_rows): head sizes 8 and 16, where a K row of one head is
// at most one register and per-(token, head) dot products with a horizontal sum would cost more than
// the multiply-adds themselves.
//
// The path works on the cache rows of several KV heads at once. In the cache layout
// [num_blocks, block_size, num_kv_heads, head_size] the heads of one token are contiguous, so a token
// row of an item's KV heads is C = heads * head_size consecutive floats, cut into column tiles of 16.
// For 16 tokens and one column tile, the 16 x 16 block of K is transposed in registers: register c
// then holds column c (one (head, d) pair) for the 16 tokens, and the scores of a query head are
// head_size vector multiply-adds with q[h, d] broadcast: 16 tokens per instruction, no horizontal sum.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

// GCC 12 reports its own _mm512_undefined_* placeholders inside the intrinsics as maybe uninitialised.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace pagedgen::cpu::small_heads {

constexpr int kTokens = 16;   // tokens per transposed sub-tile (lanes of a register)
constexpr int kColumns = 16;  // floats per column tile

// 16 floats (or the first `width` of them, the rest zero) of a cache row, as float32.
inline __m512 load_row(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
inline __m512 load_row(const c10::BFloat16* p, __mmask16 mask) {
  // bf16 -> fp32 is the bf16 bits in the upper half of the fp32 word
  const __m256i h = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load_row(const c10::Half* p, __mmask16 mask) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
}

// In-register transpose of a 16 x 16 float block: r[i] lane j -> r[j] lane i.
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {  // interleave pairs of rows: 2 x 2 blocks
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {  // pairs of 2 x 2 blocks: 4 x 4 blocks within each 128-bit lane
    const __m512d a0 = _mm512_castps_pd(t[4 * i]), a1 = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d b0 = _mm512_castps_pd(t[4 * i + 2]), b1 = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a0, b0));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a0, b0));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(a1, b1));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(a1, b1));
  }
  // r[4i + k] now holds, in 128-bit lane L, column 4L + k of rows 4i..4i+3. Gather the four row
  // groups of each column into one register with two rounds of 128-bit lane shuffles.
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    t[k] = _mm512_shuffle_f32x4(r[k], r[4 + k], 0x88);          // lanes (0, 2) of rows 0-3 | 4-7
    t[4 + k] = _mm512_shuffle_f32x4(r[k], r[4 + k], 0xdd);      // lanes (1, 3)
    t[8 + k] = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0x88);
    t[12 + k] = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0xdd);
  }
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    r[k] = _mm512_shuffle_f32x4(t[k], t[8 + k], 0x88);        // column k      (lane 0 of each)
    r[8 + k] = _mm512_shuffle_f32x4(t[k], t[8 + k], 0xdd);    // column 8 + k  (lane 2)
    r[4 + k] = _mm512_shuffle_f32x4(t[4 + k], t[12 + k], 0x88);   // column 4 + k  (lane 1)
    r[12 + k] = _mm512_shuffle_f32x4(t[4 + k], t[12 + k], 0xdd);  // column 12 + k (lane 3)
  }
}

// Scores of the `group` query heads of one KV head whose columns are cols[K0 .. K0 + D) (K0 a
// compile-time constant, so that the columns stay in registers): sc row g = sum_d q[g, d] * col[d].
template <int D, int K0>
inline void score_kv_head(const __m512* cols, const float* q, int group, float* sc, int64_t sc_stride) {
  for (int g = 0; g < group; ++g) {
    const float* qg = q + g * D;
    __m512 s0 = _mm512_mul_ps(_mm512_set1_ps(qg[0]), cols[K0]);
    __m512 s1 = _mm512_mul_ps(_mm512_set1_ps(qg[1]), cols[K0 + 1]);
#pragma GCC unroll 16
    for (int d = 2; d < D; d += 2) {  // two chains: half the latency of one
      s0 = _mm512_fmadd_ps(_mm512_set1_ps(qg[d]), cols[K0 + d], s0);
      s1 = _mm512_fmadd_ps(_mm512_set1_ps(qg[d + 1]), cols[K0 + d + 1], s1);
    }
    _mm512_storeu_ps(sc + g * sc_stride, _mm512_add_ps(s0, s1));
  }
}

// The 16 tokens x 16 columns block of one column tile of K, transposed: r[c] holds column c (one
// (head, d) pair) for the 16 tokens.
//   row(j): token j's row at the tile's first column, for j in [0, 16) (rows of tokens the caller does
//           not attend to may be any readable row, e.g. a zero row: its softmax masks their lanes);
//   width: valid columns (16, or 8 for a last lone head of size 8).
template <typename Row>
inline void load_column_tile(const Row& row, int width, __m512 r[kTokens]) {
  const __mmask16 mask = static_cast<__mmask16>((1u << width) - 1);
#pragma GCC unroll 16
  for (int j = 0; j < kTokens; ++j) r[j] = load_row(row(j), mask);
  transpose16(r);
}

// Scores of the 16 tokens of a transposed column tile r for the query heads whose KV heads lie in it
// (one head of 16, or one or two heads of 8: `width`).
//   q: [heads of the tile * group, D] scaled queries, head-major as in the model;
//   sc: row h gets the 16 scores of query head h, rows sc_stride floats apart.
// Each lane (token) is computed on its own: the other lanes do not change its bits.
template <int D>
inline void score_column_heads(const __m512 r[kTokens], int width, const float* q, int group, float* sc,
                               int64_t sc_stride) {
  static_assert(D == 8 || D == 16, "small-head path: head size 8 or 16");
  score_kv_head<D, 0>(r, q, group, sc, sc_stride);
  if (D == 8 && width == 16) score_kv_head<D, D % 16>(r, q + group * D, group, sc + group * sc_stride, sc_stride);
}

}  // namespace pagedgen::cpu::small_heads
#endif  // __AVX512F__
