// Per-row inner loops of the CPU paged attention kernel (csrc/cpu/attention.cpp), over one tile of
// kTile tokens of one KV head, all in float32:
//   scores:     s[h, j] = q[h] . k[j]           (q pre-scaled)
//   softmax:    one online-softmax step (Milakov & Gimelshein 2018, as in FlashAttention)
//   accumulate: acc[h] += sum_j w[h, j] * v[j]
//
// The canonical arithmetic of a row (what makes prefill and decode bitwise equal, issue 13):
// tiles are aligned to absolute positions (tile i holds the tokens [i * kTile, (i + 1) * kTile)), and
// token t of a tile sits in slot j = t - tile start of every per-tile buffer. A row uses the slots
// [ja, jb) of a tile: its causal limit (positions <= its own) and its sliding window cut the range,
// nothing else does. Every function below computes each (row, head, slot) value by a fixed sequence
// of IEEE operations that depends only on the slot and the range, never on how many rows, heads or
// tiles a caller processes at once; fused multiply-adds are explicit (vec.h). Slots outside [ja, jb)
// are never read from the cache (they may lie in blocks already returned to the pool).
//
// Head sizes known at compile time keep the loops in registers: heads of up to 16 floats compute
// scores vertically over tokens on a transposed K tile (kt), larger ones one dot product per
// (head, token) with a horizontal sum. Any other head size uses the `*_runtime` loops.
#pragma once

#include "kv_codes.h"  // load<W> of 1-byte codes (a 1-byte cache's rows read in place)
#include "vec.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace pagedgen::cpu {

constexpr int kTile = 32;  // tokens per online-softmax step of the general path
static_assert(kTile % kLanes == 0, "a tile must be whole registers");

// Lanes of the vectors used for a head of kD floats: a whole register, or the head if it is smaller.
template <int kD>
constexpr int head_lanes() {
  static_assert(kD % std::min(kLanes, kD) == 0, "compile-time head sizes must be whole registers");
  return std::min(kLanes, kD);
}

// src[0:n] -> dst[0:n] as float, kLanes at a time (the tail zero-padded).
template <typename scalar_t>
inline void to_float(const scalar_t* src, float* dst, int n) {
  int i = 0;
  for (; i + kLanes <= n; i += kLanes) store<kLanes>(dst + i, load<kLanes>(src + i));
  if (i < n) store_partial<kLanes>(dst + i, load_partial<kLanes>(src + i, n - i), n - i);
}

// The default `hook` of the loops below, called once per step of their token loops: nothing. (The
// decode path passes one that issues a few prefetches of the next tile per step, TilePrefetch in
// attention_common.h; a hook never touches the arithmetic.)
struct NoHook {
  void operator()() const {}
};

// Registers [first, end) of a tile that hold the slots [ja, jb).
inline int first_register(int ja) { return ja / kLanes; }
inline int end_register(int jb) { return (jb + kLanes - 1) / kLanes; }

// One online-softmax step for one head and the slots [ja, jb) of a tile: turns the scores s[ja:jb]
// into weights exp(s - m_new) (and the other slots of their registers into zeros), updates the
// running max m and the running sum l of the weights, and returns alpha = exp(m_old - m_new), the
// factor by which everything accumulated so far must be rescaled. s: [kTile] (or longer).
// When the running max does not change, alpha is exactly 1 (exp(0) = 1 through the polynomial), so
// the multiplications by it (and the rescale of the accumulator) are skipped: the same bits, less work.
inline float softmax_tile(float* s, int ja, int jb, float& m, float& l) {
  const int t0 = first_register(ja), t1 = end_register(jb);
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int j = t0 * kLanes; j < ja; ++j) s[j] = kNegInf;
  for (int j = jb; j < t1 * kLanes; ++j) s[j] = kNegInf;
  Vec<kLanes> mx = load<kLanes>(s + t0 * kLanes);
  for (int t = t0 + 1; t < t1; ++t) mx = vmax<kLanes>(mx, load<kLanes>(s + t * kLanes));
  const float m_new = std::max(m, hmax<kLanes>(mx));
  // 0 on the first tile (m = -inf)
  const float alpha = m_new == m ? 1.0f : exp_nonpositive<4>(splat<4>(m - m_new))[0];
  const Vec<kLanes> vm = splat<kLanes>(m_new);
  Vec<kLanes> sum = {};
  for (int t = t0; t < t1; ++t) {
    const Vec<kLanes> w = exp_nonpositive<kLanes>(load<kLanes>(s + t * kLanes) - vm);
    store<kLanes>(s + t * kLanes, w);
    sum += w;
  }
  l = (alpha == 1.0f ? l : l * alpha) + hsum<kLanes>(sum);
  m = m_new;
  return alpha;
}

// acc[0:n] *= alpha (nothing to do for alpha = 1).
inline void rescale(float* acc, int n, float alpha) {
  if (alpha == 1.0f) return;
  const Vec<kLanes> a = splat<kLanes>(alpha);
  int i = 0;
  for (; i + kLanes <= n; i += kLanes) store<kLanes>(acc + i, load<kLanes>(acc + i) * a);
  for (; i < n; ++i) acc[i] *= alpha;
}

// ---- scores, heads of up to 16 floats: vertical over the tokens of a transposed tile --------------

// kt[d, j] = k[j][d] for the slots [ja, jb) of a tile, and 0 in the other slots of their registers.
// kt: [kD, kTile].
template <int kD>
inline void transpose_tile(const float* const* k, int ja, int jb, float* kt) {
  const int j0 = first_register(ja) * kLanes, j1 = end_register(jb) * kLanes;
  for (int j = j0; j < j1; ++j) {
    const bool in = j >= ja && j < jb;
    for (int d = 0; d < kD; ++d) kt[d * kTile + j] = in ? k[j][d] : 0.0f;
  }
}

// sc[h, j] for the registers holding the slots [ja, jb): s = sum over d = 0, 1, ... of q[h, d] * kt[d]
// as one chain of fused multiply-adds. q: [G, kD]; sc: [G, kTile].
template <int kD>
inline void score_transposed(const float* q, int G, const float* kt, int ja, int jb, float* sc) {
  const int t0 = first_register(ja), t1 = end_register(jb);
  for (int h = 0; h < G; ++h) {
    for (int t = t0; t < t1; ++t) {
      Vec<kLanes> s = {};
      for (int d = 0; d < kD; ++d) s = fmadd<kLanes>(splat<kLanes>(q[h * kD + d]), load<kLanes>(kt + d * kTile + t * kLanes), s);
      store<kLanes>(sc + h * kTile + t * kLanes, s);
    }
  }
}

// ---- scores, larger heads: one dot product per (head, token) ----------------------------------------

// The dot product of one (head, token) pair: q[0:W] * k[0:W], then fused multiply-adds of the next
// W-lane slices in order, then the fixed hsum tree. k: float, or the cache's bf16/fp16 read in place
// (converted to float exactly on load: the same bits), or the 1-byte cache's codes (kv_codes.h:
// float(code) on load, as in a converted tile). The loops below take rows of any of these kinds
// (Row: a pointer that load<W> accepts).
template <int kD, typename Row = const float*>
inline float dot_row(const float* q, Row k) {
  constexpr int W = head_lanes<kD>(), NV = kD / W;
  Vec<W> dot = load<W>(q) * load<W>(k);
  for (int v = 1; v < NV; ++v) dot = fmadd<W>(load<W>(q + v * W), load<W>(k + v * W), dot);
  return hsum<W>(dot);
}

// out[i] = hsum<W>(a[i]) for the n vectors a[0:n], bitwise each (the same tree), several at a time:
// with AVX, two 8-lane vectors fold their halves in one add, and four share the adds of the last two
// levels of the tree (about 3 instructions per sum instead of 6).
template <int W>
PAGEDGEN_ALWAYS_INLINE void hsum_many(const Vec<W>* a, int n, float* out) {
#if defined(__AVX__)
  if constexpr (W == 8 || W == 16) {
    const auto halves = [&](int i) {  // the 8-lane vector whose hsum is hsum<W>(a[i])
      if constexpr (W == 8) {
        return reinterpret_cast<const __m256&>(a[i]);
      } else {
        const Vec<8> x = half_of<16, false>(a[i]) + half_of<16, true>(a[i]);
        return reinterpret_cast<const __m256&>(x);
      }
    };
    int i = 0;
    for (; i + 4 <= n; i += 4) {
      const __m256 v0 = halves(i), v1 = halves(i + 1), v2 = halves(i + 2), v3 = halves(i + 3);
      // x = lo + hi of each vector, two vectors per register: [x0 | x1], [x2 | x3]
      const __m256 c01 = _mm256_add_ps(_mm256_permute2f128_ps(v0, v1, 0x20), _mm256_permute2f128_ps(v0, v1, 0x31));
      const __m256 c23 = _mm256_add_ps(_mm256_permute2f128_ps(v2, v3, 0x20), _mm256_permute2f128_ps(v2, v3, 0x31));
      // (x[0] + x[2]), (x[1] + x[3]) of each
      const __m256 g = _mm256_add_ps(_mm256_shuffle_ps(c01, c23, _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm256_shuffle_ps(c01, c23, _MM_SHUFFLE(3, 2, 3, 2)));
      // (x[0] + x[2]) + (x[1] + x[3]): lanes [s0, s2, s0, s2 | s1, s3, s1, s3]
      const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(g, g, _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm256_shuffle_ps(g, g, _MM_SHUFFLE(3, 1, 3, 1)));
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, r);
      out[i] = lanes[0];
      out[i + 1] = lanes[4];
      out[i + 2] = lanes[1];
      out[i + 3] = lanes[5];
    }
    for (; i < n; ++i) out[i] = hsum<W>(a[i]);
    return;
  }
#endif
  for (int i = 0; i < n; ++i) out[i] = hsum<W>(a[i]);
}

// Heads per register block of score_rows and accumulate_heads: with 32 vector registers (AVX-512)
// up to four heads share each K/V slice they load (16 accumulators), with 16 (AVX2) two.
constexpr int kMaxHeadBlock = kLanes >= 16 ? 4 : 2;

// Calls f(std::integral_constant<int, HB>{}, h) for consecutive blocks [h, h + HB) that cover the
// heads [0, G): blocks of four and then one of three where kMaxBlock allows, then pairs, then single
// heads.
template <int kMaxBlock, typename F>
inline void for_head_blocks(int G, F&& f) {
  int h = 0;
  if constexpr (kMaxBlock >= 4) {
    for (; h + 4 <= G; h += 4) f(std::integral_constant<int, 4>{}, h);
    if (h + 3 <= G) {
      f(std::integral_constant<int, 3>{}, h);
      h += 3;
    }
  }
  if constexpr (kMaxBlock >= 2) {
    for (; h + 2 <= G; h += 2) f(std::integral_constant<int, 2>{}, h);
  }
  for (; h < G; ++h) f(std::integral_constant<int, 1>{}, h);
}

#if defined(__AVX512F__)
// The 16 sums hsum<16>(a[i]), i = 0 .. 15, in one register (lane i), each by hsum<16>'s tree (lanes
// i + 8, then i + 4, then (0 + 2) + (1 + 3)): the four levels of the tree run on all 16 vectors at
// once, two vectors per add, the shuffles gathering the halves each level adds (45 instructions for
// 16 sums instead of about 6 per sum). The adds are those of hsum<16>, so each lane is bitwise
// hsum<16>(a[i]).
PAGEDGEN_ALWAYS_INLINE __m512 hsum16x16(const __m512* a) {
  // level 1, 256-bit halves: t[p] = [lo8 + hi8 of x[2p] | of x[2p + 1]], with x[4m + k] = a[4k + m]
  // so that the last level leaves a[i] in lane i
  const auto x = [&](int i) { return a[(i % 4) * 4 + i / 4]; };
  __m512 t[8];
#pragma GCC unroll 8
  for (int p = 0; p < 8; ++p) {
    t[p] = _mm512_add_ps(_mm512_shuffle_f32x4(x(2 * p), x(2 * p + 1), 0x44), _mm512_shuffle_f32x4(x(2 * p), x(2 * p + 1), 0xEE));
  }
  // level 2, 128-bit quarters: r[q] = [lo4 + hi4 of x[4q], x[4q + 1], x[4q + 2], x[4q + 3]]
  __m512 r[4];
#pragma GCC unroll 4
  for (int q = 0; q < 4; ++q) {
    r[q] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * q], t[2 * q + 1], 0x88), _mm512_shuffle_f32x4(t[2 * q], t[2 * q + 1], 0xDD));
  }
  // level 3, within each quarter: (v0 + v2), (v1 + v3) of two vectors' quarters
  const __m512 s0 = _mm512_add_ps(_mm512_shuffle_ps(r[0], r[1], 0x44), _mm512_shuffle_ps(r[0], r[1], 0xEE));
  const __m512 s1 = _mm512_add_ps(_mm512_shuffle_ps(r[2], r[3], 0x44), _mm512_shuffle_ps(r[2], r[3], 0xEE));
  // level 4: (v0 + v2) + (v1 + v3); lane 4k + m holds x[4m + k] = a[4k + m]
  return _mm512_add_ps(_mm512_shuffle_ps(s0, s1, 0x88), _mm512_shuffle_ps(s0, s1, 0xDD));
}

// hsum16x16 of the chains chain(j) (one __m512 per slot) of the slots j of [ja, jb) in the 16-slot
// register starting at slot g0; the register's other slots get 0 and chain is not called for them
// (their K rows are not read). hook() is called every four slots. Both loops are unrolled, so the
// 16 chains stay in registers.
template <typename Chain, typename Hook>
PAGEDGEN_ALWAYS_INLINE __m512 register_scores(const Chain& chain, int g0, int ja, int jb, Hook& hook) {
  __m512 d[16];
  if (ja <= g0 && g0 + 16 <= jb) {  // a whole register
#pragma GCC unroll 16
    for (int t = 0; t < 16; ++t) {
      if (t % 4 == 0) hook();
      d[t] = chain(g0 + t);
    }
  } else {  // unrolled too: d stays in registers
#pragma GCC unroll 16
    for (int t = 0; t < 16; ++t) {
      if (t % 4 == 0) hook();
      const int j = g0 + t;
      d[t] = ja <= j && j < jb ? chain(j) : _mm512_setzero_ps();
    }
  }
  return hsum16x16(d);
}

#endif

// sc[b, j] = dot_row(q[b], k[j]) for HB heads and the slots [ja, jb): register blocks of HB heads by
// four tokens (each K slice loaded, and converted, once for the HB heads; 4 * HB independent chains),
// each pair still dot_row's sequence of operations; then hsum_many. q: [HB, kD]; sc: [HB, kTile].
template <int kD, int HB, typename Hook, typename Row>
inline void score_block(const float* q, const Row* k, int ja, int jb, float* sc, Hook& hook) {
  constexpr int W = head_lanes<kD>(), NV = kD / W;
  int j = ja;
  for (; j + 4 <= jb; j += 4) {
    hook();
    Vec<W> d[4 * HB];  // d[4 * b + t]: head b, token j + t
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) {
      Vec<W> a[HB];
#pragma GCC unroll 16
      for (int b = 0; b < HB; ++b) a[b] = load<W>(q + b * kD + v * W);
#pragma GCC unroll 16
      for (int t = 0; t < 4; ++t) {
        Vec<W> kv = load<W>(k[j + t] + v * W);
        register_value<W>(kv);  // loaded once for all HB heads
#pragma GCC unroll 16
        for (int b = 0; b < HB; ++b) d[4 * b + t] = v == 0 ? a[b] * kv : fmadd<W>(a[b], kv, d[4 * b + t]);
      }
    }
    float r[4 * HB];
    hsum_many<W>(d, 4 * HB, r);
#pragma GCC unroll 16
    for (int b = 0; b < HB; ++b) {
#pragma GCC unroll 16
      for (int t = 0; t < 4; ++t) sc[b * kTile + j + t] = r[4 * b + t];
    }
  }
  for (; j < jb; ++j) {
#pragma GCC unroll 16
    for (int b = 0; b < HB; ++b) sc[b * kTile + j] = dot_row<kD>(q + b * kD, k[j]);
  }
}

#if defined(__AVX512F__)
// Heads of whole 16-float slices, at most this many (their query slices and 16 chains fit the 32
// registers), score one head's 16 slots at a time (score_register).
constexpr int kMaxRegisterHead = 128;

// sc[j] = dot_row(q, k[j]) for the slots j of [ja, jb) in the 16-slot register starting at slot g0 (the
// register's other slots get 0, and their K rows are not read): dot_row's chain per slot, then
// hsum16x16 (its tree). q: [kD]; k: rows as float, or in the cache's dtype; sc: [kTile].
template <int kD, typename Hook, typename Row>
PAGEDGEN_ALWAYS_INLINE void score_register(const float* q, const Row* k, int g0, int ja, int jb, float* sc,
                                           Hook& hook) {
  constexpr int NV = kD / 16;
  Vec<16> qv[NV];
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) qv[v] = load<16>(q + v * 16);
  const auto chain = [&](int j) {
    Vec<16> c = qv[0] * load<16>(k[j]);
#pragma GCC unroll 8
    for (int v = 1; v < NV; ++v) c = fmadd<16>(qv[v], load<16>(k[j] + v * 16), c);
    return reinterpret_cast<const __m512&>(c);
  };
  _mm512_storeu_ps(sc + g0, register_scores(chain, g0, ja, jb, hook));
}
#endif

// sc[h, j] = dot_row(q[h], k[j]) for the G heads and the slots [ja, jb): with AVX-512 and heads of
// whole 16-float slices up to kMaxRegisterHead, one head's 16-slot register at a time
// (score_register); otherwise in blocks of up to kMaxHeadBlock heads (score_block). The same bits
// either way. k: rows as float, or in the cache's dtype.
template <int kD, typename Hook = NoHook, typename Row = const float*>
inline void score_rows(const float* q, int G, const Row* k, int ja, int jb, float* sc, Hook hook = {}) {
#if defined(__AVX512F__)
  if constexpr (head_lanes<kD>() == 16 && kD <= kMaxRegisterHead) {
    static_assert(kTile % 16 == 0, "a tile must be whole 16-slot registers");
    const int r0 = ja / 16 * 16;
    for (int h = 0; h < G; ++h) {
      for (int g0 = r0; g0 < jb; g0 += 16) score_register<kD>(q + h * kD, k, g0, ja, jb, sc + h * kTile, hook);
    }
    return;
  }
#endif
  for_head_blocks<kMaxHeadBlock>(G, [&](auto hb, int h) {
    score_block<kD, decltype(hb)::value>(q + h * kD, k, ja, jb, sc + h * kTile, hook);
  });
}

// ---- scores from bf16 q and K with AVX512-BF16's dot-product instruction --------------------------
//
// vdpbf16ps adds to each float lane i the two products q[2i] k[2i] + q[2i + 1] k[2i + 1] of a
// 32-element bf16 slice (the products exact, as bf16 x bf16 fits a float; the sums rounded to float,
// denormal inputs and outputs flushed to zero). A score is then hsum<16> of one chain of those over
// the head's slices, times the scale: from the query as the model gave it (bf16; the float path's
// pre-scaled float copy rounds differently) and K as stored, with no conversion of K and half the
// instructions of the float path's fused multiply-adds. Every bf16 row (prefill and decode, any
// batch) takes this path when the build has the instruction and the head is whole slices, so a
// row's scores are still one function of its query and context.
#if defined(__AVX512BF16__)
template <int kD>
constexpr bool bf16_dot_head() {
  return kD >= 32 && kD % 32 == 0;
}

// sc[j] = scale * hsum<16>(dp(... dp(0, q[0:32], k[j][0:32]) ..., q[kD-32:], k[j][kD-32:])) for the
// slots j of [ja, jb) in the 16-slot register starting at slot g0 (the register's other slots get 0,
// and their K rows are not read): one chain per slot, then hsum16x16. q: [kD] bf16 bits; k: the
// tile's rows in the cache; sc: [kTile].
template <int kD, typename Hook>
PAGEDGEN_ALWAYS_INLINE void score_register_bf16(const uint16_t* q, const c10::BFloat16* const* k, int g0, int ja, int jb,
                                                float* sc, __m512 scale, Hook& hook) {
  constexpr int NV = kD / 32;
  const auto slice = [](const void* at) { return (__m512bh)_mm512_loadu_si512(at); };
  __m512bh qv[NV];
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) qv[v] = slice(q + v * 32);
  const auto chain = [&](int j) {
    __m512 c = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], slice(k[j]));
#pragma GCC unroll 8
    for (int v = 1; v < NV; ++v) c = _mm512_dpbf16_ps(c, qv[v], slice(k[j] + v * 32));
    return c;
  };
  _mm512_storeu_ps(sc + g0, _mm512_mul_ps(register_scores(chain, g0, ja, jb, hook), scale));
}

// The bf16 scores of the G heads for the slots [ja, jb), a register of 16 slots of one head at a time
// (score_register_bf16). q: [G, kD] bf16 bits; sc: [G, kTile].
template <int kD, typename Hook = NoHook>
inline void score_rows_bf16(const uint16_t* q, int G, const c10::BFloat16* const* k, int ja, int jb, float* sc,
                            float scale, Hook hook = {}) {
  static_assert(kTile % 16 == 0, "a tile must be whole 16-slot registers");
  const __m512 vscale = _mm512_set1_ps(scale);
  const int r0 = ja / 16 * 16;
  for (int h = 0; h < G; ++h) {
    for (int g0 = r0; g0 < jb; g0 += 16) score_register_bf16<kD>(q + h * kD, k, g0, ja, jb, sc + h * kTile, vscale, hook);
  }
}
#else
template <int kD>
constexpr bool bf16_dot_head() {
  return false;
}
#endif

// ---- scores, larger heads, many (row, head) pairs: on a transposed tile, the same bits -------------
//
// dot_row's lane r (W = kLanes lanes) is the chain q[r] * k[r], then + q[v W + r] * k[v W + r] for
// v = 1 .. NV - 1, and the score is hsum<W> of the W lanes. With the tile transposed (kt[d, j]), the
// chain of lane r is a vertical one over the tokens of a register: part_r = q[h, r] * kt[r] then
// fmadd(q[h, v W + r], kt[v W + r], part_r), and hsum's tree becomes vertical adds of the part_r
// (hsum_tree). So every (pair, slot) value is bitwise dot_row's, with no horizontal sum: worth the
// transpose when many pairs share the tile (prefill blocks).

// kt[d, j] = k[j][d] for every slot of a tile, 0 for the slots outside [ua, ub) (their rows are not
// read). kt: [kD, kTile]; 8 x 8 register transposes with AVX.
template <int kD>
inline void transpose_full_tile(const float* const* k, int ua, int ub, float* kt) {
  static_assert(kD % 8 == 0 && kTile % 8 == 0, "transpose_full_tile: 8 x 8 blocks");
  alignas(64) static const float kZeros[kD] = {};
  const float* rows[kTile];
  for (int j = 0; j < kTile; ++j) rows[j] = j >= ua && j < ub ? k[j] : kZeros;
  for (int j0 = 0; j0 < kTile; j0 += 8) {
    for (int d0 = 0; d0 < kD; d0 += 8) {
      float* dst = kt + d0 * kTile + j0;
#if defined(__AVX__)
      __m256 r[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(rows[j0 + i] + d0);
      transpose8(r);
      for (int c = 0; c < 8; ++c) _mm256_storeu_ps(dst + c * kTile, r[c]);
#else
      for (int d = 0; d < 8; ++d) {
        for (int j = 0; j < 8; ++j) dst[d * kTile + j] = rows[j0 + j][d0 + d];
      }
#endif
    }
  }
}

// hsum<W>'s tree applied lane by lane to the W vectors p[0:W] (p[r]: lane r's chains).
template <int W>
inline Vec<kLanes> hsum_tree(const Vec<kLanes>* p) {
  if constexpr (W == 4) {
    return (p[0] + p[2]) + (p[1] + p[3]);
  } else {
    Vec<kLanes> u[W / 2];
    for (int i = 0; i < W / 2; ++i) u[i] = p[i] + p[i + W / 2];
    return hsum_tree<W / 2>(u);
  }
}

// sc[h, j] = dot_row<kD>(q[h], k[j]) for the P heads (pairs) and every slot of the tile (the slots
// outside the rows' ranges get values of the zero rows, which softmax_tile masks or never reads).
// q: [P, kD]; kt: the tile transposed (transpose_full_tile); sc: [P, kTile]; part: scratch of
// 2 * kLanes * kTile floats. Blocks of two heads by the whole tile (eight accumulators on AVX2).
template <int kD>
inline void score_transposed_rows(const float* q, int P, const float* kt, float* sc, float* part) {
  constexpr int W = head_lanes<kD>(), NV = kD / W, T = kTile / kLanes;
  static_assert(W == kLanes, "score_transposed_rows: heads of whole registers");
  const auto block = [&](auto heads, int h) {
    constexpr int HB = decltype(heads)::value;
    const float* qh = q + h * kD;
    for (int r = 0; r < W; ++r) {
      Vec<kLanes> acc[HB][T];
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) {
        Vec<kLanes> x = load<kLanes>(kt + r * kTile + t * kLanes);
        register_value<kLanes>(x);
#pragma GCC unroll 2
        for (int b = 0; b < HB; ++b) acc[b][t] = splat<kLanes>(qh[b * kD + r]) * x;
      }
#pragma GCC unroll 16
      for (int v = 1; v < NV; ++v) {
        const int d = v * W + r;
        Vec<kLanes> qb[HB];
#pragma GCC unroll 2
        for (int b = 0; b < HB; ++b) qb[b] = splat<kLanes>(qh[b * kD + d]);
#pragma GCC unroll 4
        for (int t = 0; t < T; ++t) {
          Vec<kLanes> x = load<kLanes>(kt + d * kTile + t * kLanes);
          register_value<kLanes>(x);
#pragma GCC unroll 2
          for (int b = 0; b < HB; ++b) acc[b][t] = fmadd<kLanes>(qb[b], x, acc[b][t]);
        }
      }
#pragma GCC unroll 2
      for (int b = 0; b < HB; ++b) {
#pragma GCC unroll 4
        for (int t = 0; t < T; ++t) store<kLanes>(part + ((b * T + t) * W + r) * kLanes, acc[b][t]);
      }
    }
    for (int b = 0; b < HB; ++b) {
      for (int t = 0; t < T; ++t) {
        Vec<kLanes> pv[W];
        for (int r = 0; r < W; ++r) pv[r] = load<kLanes>(part + ((b * T + t) * W + r) * kLanes);
        store<kLanes>(sc + (h + b) * kTile + t * kLanes, hsum_tree<W>(pv));
      }
    }
  };
  int h = 0;
  for (; h + 2 <= P; h += 2) block(std::integral_constant<int, 2>(), h);
  if (h < P) block(std::integral_constant<int, 1>(), h);
}

// ---- V accumulation ---------------------------------------------------------------------------------

// Chains of the V accumulation of one head: U independent partial sums (token ja + i goes to chain
// i % U, a last incomplete round to chain 0), so that consecutive fused multiply-adds do not wait
// on each other; then acc += chain 0, += chain 1, ...
template <int kD>
constexpr int accumulate_chains() {
  constexpr int NV = kD / head_lanes<kD>();
  return NV >= 4 ? 1 : 4 / NV;
}

// acc[0:kD] += sum_j w[j] * v[j] over the slots [ja, jb) of a tile (v: rows as float, or in the
// cache's dtype).
template <int kD, typename Hook = NoHook, typename Row = const float*>
inline void accumulate_tile(float* acc, const float* w, const Row* v, int ja, int jb, Hook hook = {}) {
  constexpr int W = head_lanes<kD>(), NV = kD / W, U = accumulate_chains<kD>();
  Vec<W> a[U][NV] = {};
  int j = ja;
  for (; j + U <= jb; j += U) {
    hook();
    for (int u = 0; u < U; ++u) {
      const Vec<W> wj = splat<W>(w[j + u]);
      for (int i = 0; i < NV; ++i) a[u][i] = fmadd<W>(wj, load<W>(v[j + u] + i * W), a[u][i]);
    }
  }
  for (; j < jb; ++j) {
    const Vec<W> wj = splat<W>(w[j]);
    for (int i = 0; i < NV; ++i) a[0][i] = fmadd<W>(wj, load<W>(v[j] + i * W), a[0][i]);
  }
  for (int i = 0; i < NV; ++i) {
    Vec<W> sum = load<W>(acc + i * W);
    for (int u = 0; u < U; ++u) sum += a[u][i];
    store<W>(acc + i * W, sum);
  }
}

// accumulate_tile for HB heads with the same slots (U = 1 only: one chain per element), each V
// slice loaded (and converted) once for all of them: acc[b] += sum_j w[b, j] * v[j], in chunks of
// four vectors (4 * HB accumulator registers), every element still one chain over the tokens, then
// added to acc: accumulate_tile's bits. acc: [HB, kD]; w: [HB, kTile].
template <int kD, int HB, typename Hook, typename Row>
inline void accumulate_block(float* acc, const float* w, const Row* v, int ja, int jb, Hook& hook) {
  constexpr int W = head_lanes<kD>(), NV = kD / W;
  static_assert(accumulate_chains<kD>() == 1 && NV % 4 == 0, "accumulate_block: heads of whole 4-register chunks");
  for (int c = 0; c < NV; c += 4) {
    Vec<W> a[HB][4] = {};
    for (int j = ja; j < jb; ++j) {
      hook();
      Vec<W> x[HB];
#pragma GCC unroll 16
      for (int b = 0; b < HB; ++b) x[b] = splat<W>(w[b * kTile + j]);
#pragma GCC unroll 16
      for (int i = 0; i < 4; ++i) {
        Vec<W> y = load<W>(v[j] + (c + i) * W);
        register_value<W>(y);  // loaded once for all HB heads
#pragma GCC unroll 16
        for (int b = 0; b < HB; ++b) a[b][i] = fmadd<W>(x[b], y, a[b][i]);
      }
    }
#pragma GCC unroll 16
    for (int b = 0; b < HB; ++b) {
#pragma GCC unroll 16
      for (int i = 0; i < 4; ++i) {
        float* o = acc + b * kD + (c + i) * W;
        store<W>(o, load<W>(o) + a[b][i]);
      }
    }
  }
}

// acc[h] += sum_j w[h, j] * v[j] for the G heads and the slots [ja, jb): blocks of up to
// kMaxHeadBlock heads that share each V slice (accumulate_block) where the head is whole 4-register
// chunks, else accumulate_tile head by head; the same bits either way. acc: [G, kD]; w: [G, kTile].
template <int kD, typename Hook = NoHook, typename Row = const float*>
inline void accumulate_heads(float* acc, int G, const float* w, const Row* v, int ja, int jb, Hook hook = {}) {
  constexpr bool kBlocks = accumulate_chains<kD>() == 1 && (kD / head_lanes<kD>()) % 4 == 0;
  for_head_blocks<kBlocks ? kMaxHeadBlock : 1>(G, [&](auto hb, int h) {
    constexpr int HB = decltype(hb)::value;
    if constexpr (HB == 1) {
      accumulate_tile<kD>(acc + h * kD, w + h * kTile, v, ja, jb, hook);
    } else {
      accumulate_block<kD, HB>(acc + h * kD, w + h * kTile, v, ja, jb, hook);
    }
  });
}

// ---- any other head size: run-time bounds, the same structure ---------------------------------------

// sc[h, j] for the slots [ja, jb): a chain of fused multiply-adds over the head's kLanes-wide slices
// (the last one zero-padded), then the hsum tree.
template <typename Hook = NoHook>
inline void score_rows_runtime(const float* q, int G, int D, const float* const* k, int ja, int jb, float* sc,
                               Hook hook = {}) {
  for (int h = 0; h < G; ++h) {
    const float* qh = q + h * D;
    for (int j = ja; j < jb; ++j) {
      hook();
      Vec<kLanes> dot = {};
      int d = 0;
      for (; d + kLanes <= D; d += kLanes) dot = fmadd<kLanes>(load<kLanes>(qh + d), load<kLanes>(k[j] + d), dot);
      if (d < D) dot = fmadd<kLanes>(load_partial<kLanes>(qh + d, D - d), load_partial<kLanes>(k[j] + d, D - d), dot);
      sc[h * kTile + j] = hsum<kLanes>(dot);
    }
  }
}

// acc[0:D] += sum_j w[j] * v[j] over the slots [ja, jb): one chain per element, token after token.
template <typename Hook = NoHook>
inline void accumulate_tile_runtime(float* acc, int D, const float* w, const float* const* v, int ja, int jb,
                                    Hook hook = {}) {
  for (int j = ja; j < jb; ++j) {
    hook();
    const Vec<kLanes> wj = splat<kLanes>(w[j]);
    int d = 0;
    for (; d + kLanes <= D; d += kLanes) store<kLanes>(acc + d, fmadd<kLanes>(wj, load<kLanes>(v[j] + d), load<kLanes>(acc + d)));
    if (d < D) {
      const int n = D - d;
      store_partial<kLanes>(acc + d, fmadd<kLanes>(wj, load_partial<kLanes>(v[j] + d, n), load_partial<kLanes>(acc + d, n)), n);
    }
  }
}

}  // namespace pagedgen::cpu
