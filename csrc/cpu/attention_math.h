// Inner loops of the CPU paged attention kernel (csrc/cpu/attention.cpp), over one tile of kTile
// tokens of one KV head, all in float32:
//   scores:     s[h, j] = q[h] . k[j]           (q pre-scaled)
//   accumulate: acc[h] += sum_j w[h, j] * v[j]
// For head sizes known at compile time the loops are written with GCC/Clang vector extensions
// (`vector_size`, one register of kLanes floats for the build's -march), which makes the register
// use explicit: accumulators stay in registers, and small head sizes (<= 16) compute scores
// vertically over tokens on a transposed K tile instead of one horizontal sum per (token, head).
// Any other head size uses plain loops (`Runtime*` below) that the compiler vectorises as it can.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pagedgen::cpu {

constexpr int kTile = 32;  // tokens per online-softmax step

#if defined(__AVX512F__)
constexpr int kLanes = 16;  // floats per SIMD register
#elif defined(__AVX__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif
static_assert(kTile % kLanes == 0, "a tile must be whole registers");

template <int W>
struct VecOf;
template <>
struct VecOf<4> {
  typedef float type __attribute__((vector_size(16)));
};
template <>
struct VecOf<8> {
  typedef float type __attribute__((vector_size(32)));
};
template <>
struct VecOf<16> {
  typedef float type __attribute__((vector_size(64)));
};
template <int W>
using Vec = typename VecOf<W>::type;  // W floats

template <int W>
inline Vec<W> load(const float* p) {
  Vec<W> v;
  std::memcpy(&v, p, sizeof(v));  // unaligned load
  return v;
}
template <int W>
inline void store(float* p, const Vec<W>& v) {
  std::memcpy(p, &v, sizeof(v));
}
template <int W>
inline float hsum(const Vec<W>& v) {  // sum of the lanes, as a tree of half-width adds
  if constexpr (W == 4) {
    return (v[0] + v[2]) + (v[1] + v[3]);
  } else {
    Vec<W / 2> lo, hi;
    std::memcpy(&lo, &v, sizeof(lo));
    std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(lo), sizeof(hi));
    return hsum<W / 2>(lo + hi);
  }
}

// Lanes of the vectors used for a head of kD floats: a whole register, or the head if it is smaller.
template <int kD>
constexpr int head_lanes() {
  static_assert(kD % std::min(kLanes, kD) == 0, "compile-time head sizes must be whole registers");
  return std::min(kLanes, kD);
}

// exp(x) = 2^n * e^r with n = round(x / ln 2), r = x - n ln 2 in [-ln2/2, ln2/2], e^r by its degree-7
// Taylor polynomial (truncation error < 6e-9 relative). Branch-free, so loops over it vectorise, unlike
// calls to std::exp. Below -87 (where exp underflows to denormals) it returns 0, so exp(-inf) = 0; the
// input is clamped to [-87, 88], where 2^n is a normal float. NaN stays NaN.
inline float exp_approx(float x_in) {
  const float x = std::min(std::max(x_in, -87.0f), 88.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = x - n * 0.693359375f;  // Cody-Waite split of ln 2: the high part times n is exact
  r = r + n * 2.12194440e-4f;
  float p = 1.0f / 5040;
  p = p * r + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return x_in < -87.0f ? 0.0f : p * two_n;
}

template <int W>
inline float hmax(const Vec<W>& v) {  // max of the lanes, as a tree like hsum
  if constexpr (W == 4) {
    return std::max(std::max(v[0], v[2]), std::max(v[1], v[3]));
  } else {
    Vec<W / 2> lo, hi;
    std::memcpy(&lo, &v, sizeof(lo));
    std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(lo), sizeof(hi));
    return hmax<W / 2>(lo > hi ? lo : hi);
  }
}

// exp_approx of each lane. With AVX-512 the same range reduction and polynomial, 2^n applied by
// vscalefps (no integer detour); inputs below -87 give exactly 0 as in exp_approx (never a denormal:
// arithmetic on denormals takes microcode assists, ~100x slower); NaN stays NaN.
inline Vec<kLanes> exp_lanes(Vec<kLanes> x) {
#if defined(__AVX512F__)
  const __m512 in = reinterpret_cast<__m512&>(x);
  const __mmask16 normal = _mm512_cmp_ps_mask(in, _mm512_set1_ps(-87.0f), _CMP_NLT_UQ);  // x >= -87 or NaN
  __m512 v = _mm512_max_ps(_mm512_set1_ps(-87.0f), in);  // NaN: the second operand, kept
  v = _mm512_min_ps(_mm512_set1_ps(88.0f), v);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), v);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  for (const float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) {
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  }
  const __m512 e = _mm512_maskz_scalef_ps(normal, p, n);
  return reinterpret_cast<const Vec<kLanes>&>(e);
#else
  for (int i = 0; i < kLanes; ++i) x[i] = exp_approx(x[i]);
  return x;
#endif
}

// Registers' worth of lanes that hold the n valid tokens of a tile.
inline int tile_registers(int n) { return (n + kLanes - 1) / kLanes; }

// One online-softmax step (Milakov & Gimelshein 2018) for one head and one tile: turns the scores
// s[0:n] into weights exp(s - m_new) (and the rest of their last register into zeros), updates the
// running max m and the running sum l of the weights, and returns alpha = exp(m_old - m_new), the
// factor by which everything accumulated so far must be rescaled. s: [kTile].
inline float softmax_tile(float* s, int n, float& m, float& l) {
  const int nv = tile_registers(n);
  for (int j = n; j < nv * kLanes; ++j) s[j] = -std::numeric_limits<float>::infinity();
  Vec<kLanes> vmax = load<kLanes>(s);
  for (int t = 1; t < nv; ++t) {
    const Vec<kLanes> x = load<kLanes>(s + t * kLanes);
    vmax = vmax > x ? vmax : x;
  }
  const float m_new = std::max(m, hmax<kLanes>(vmax));
  const float alpha = exp_approx(m - m_new);  // 0 on the first tile (m = -inf)
  Vec<kLanes> sum = {};
  for (int t = 0; t < nv; ++t) {
    const Vec<kLanes> w = exp_lanes(load<kLanes>(s + t * kLanes) - m_new);
    store<kLanes>(s + t * kLanes, w);
    sum += w;
  }
  l = l * alpha + hsum<kLanes>(sum);
  m = m_new;
  return alpha;
}

// src[0:n] -> dst[0:n] as float.
template <typename scalar_t>
inline void to_float(const scalar_t* src, float* dst, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

#ifdef __F16C__
// c10::Half converts one value at a time (_cvtsh_ss); convert eight at a time instead.
template <>
inline void to_float<c10::Half>(const c10::Half* src, float* dst, int n) {
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
#endif

// A cache row as float: fp32 rows are used in place, others are converted into buf.
template <typename scalar_t>
inline const float* row_as_float(const scalar_t* src, float* buf, int n) {
  to_float(src, buf, n);
  return buf;
}
inline const float* row_as_float(const float* src, float* /*buf*/, int /*n*/) { return src; }

// sc[h, j] = q[h] . k[j] for G heads and the n rows of a tile.
//   q: [G, kD]; k: n row pointers, [kD] each; sc: [G, kTile]; kt: scratch [kD, kTile].
template <int kD>
inline void score_tile(const float* q, int G, const float* const* k, int n, float* kt, float* sc) {
  if constexpr (kD <= 16) {
    // Small heads: transpose the tile (kt[d, j] = k[j][d]) and sum over d vertically, kLanes tokens
    // at a time. Lanes j >= n hold stale values, which softmax_tile replaces.
    for (int j = 0; j < n; ++j) {
      for (int d = 0; d < kD; ++d) kt[d * kTile + j] = k[j][d];
    }
    const int nv = tile_registers(n);
    for (int h = 0; h < G; ++h) {
      for (int t = 0; t < nv; ++t) {
        Vec<kLanes> s = {};
        for (int d = 0; d < kD; ++d) s += q[h * kD + d] * load<kLanes>(kt + d * kTile + t * kLanes);
        store<kLanes>(sc + h * kTile + t * kLanes, s);
      }
    }
  } else {
    // Larger heads: one dot product per (head, token), kD / W vector FMAs and one horizontal sum.
    constexpr int W = head_lanes<kD>(), NV = kD / W;
    for (int h = 0; h < G; ++h) {
      Vec<W> qv[NV];
      for (int v = 0; v < NV; ++v) qv[v] = load<W>(q + h * kD + v * W);
      for (int j = 0; j < n; ++j) {
        Vec<W> dot = qv[0] * load<W>(k[j]);
        for (int v = 1; v < NV; ++v) dot += qv[v] * load<W>(k[j] + v * W);
        sc[h * kTile + j] = hsum<W>(dot);
      }
    }
  }
}

// acc[0:kD] += sum_j w[j] * v[j] over the n rows of a tile. Partial sums in registers: U independent
// chains of NV registers each, so that consecutive FMAs do not wait on each other.
template <int kD>
inline void accumulate_tile(float* acc, const float* w, const float* const* v, int n) {
  constexpr int W = head_lanes<kD>(), NV = kD / W;
  constexpr int U = NV >= 4 ? 1 : 4 / NV;
  Vec<W> a[U][NV] = {};
  int j = 0;
  for (; j + U <= n; j += U) {
    for (int u = 0; u < U; ++u) {
      for (int i = 0; i < NV; ++i) a[u][i] += w[j + u] * load<W>(v[j + u] + i * W);
    }
  }
  for (; j < n; ++j) {
    for (int i = 0; i < NV; ++i) a[0][i] += w[j] * load<W>(v[j] + i * W);
  }
  for (int i = 0; i < NV; ++i) {
    Vec<W> sum = load<W>(acc + i * W);
    for (int u = 0; u < U; ++u) sum += a[u][i];
    store<W>(acc + i * W, sum);
  }
}

// acc[g, 0:kD] += sum_j w[g, j] * row(j)[0:kD] for the kG query heads of one KV head (rows of w are
// w_stride floats apart; row(j) is token j's V row of that head, as float): each V row is loaded once
// for the whole group. U tokens in flight, so that the kG * NV * U accumulator registers form
// independent chains.
template <int kD, int kG, typename Row>
inline void accumulate_group(float* acc, const float* w, int64_t w_stride, const Row& row, int n) {
  constexpr int W = head_lanes<kD>(), NV = kD / W;
  constexpr int U = kG * NV >= 8 ? 1 : 8 / (kG * NV);
  Vec<W> a[U][kG][NV] = {};
  int j = 0;
  for (; j + U <= n; j += U) {
    for (int u = 0; u < U; ++u) {
      const float* vj = row(j + u);
      for (int i = 0; i < NV; ++i) {
        const Vec<W> x = load<W>(vj + i * W);
        for (int g = 0; g < kG; ++g) a[u][g][i] += w[g * w_stride + j + u] * x;
      }
    }
  }
  for (; j < n; ++j) {
    const float* vj = row(j);
    for (int i = 0; i < NV; ++i) {
      const Vec<W> x = load<W>(vj + i * W);
      for (int g = 0; g < kG; ++g) a[0][g][i] += w[g * w_stride + j] * x;
    }
  }
  for (int g = 0; g < kG; ++g) {
    for (int i = 0; i < NV; ++i) {
      Vec<W> sum = load<W>(acc + g * kD + i * W);
      for (int u = 0; u < U; ++u) sum += a[u][g][i];
      store<W>(acc + g * kD + i * W, sum);
    }
  }
}

// The same two steps for a head size known only at run time: plain loops.
inline void score_tile_runtime(const float* q, int G, int D, const float* const* k, int n, float* sc) {
  for (int h = 0; h < G; ++h) {
    for (int j = 0; j < n; ++j) {
      const float* qh = q + h * D;
      const float* kj = k[j];
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int d = 0; d < D; ++d) dot += qh[d] * kj[d];
      sc[h * kTile + j] = dot;
    }
  }
}

inline void accumulate_tile_runtime(float* acc, int D, const float* w, const float* const* v, int n) {
  for (int j = 0; j < n; ++j) {
    const float* vj = v[j];
    const float wj = w[j];
#pragma omp simd
    for (int d = 0; d < D; ++d) acc[d] += wj * vj[d];
  }
}

}  // namespace pagedgen::cpu
