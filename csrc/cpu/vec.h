// SIMD building blocks of the CPU kernels: float vectors of W lanes (GCC/Clang vector extensions),
// loads and stores that convert bfloat16 / float16 to and from float32, explicit fused multiply-add,
// and exp. Used by every kernel in csrc/cpu.
//
// Exactness rules, which the kernels' tests rely on (bitwise batch invariance, bitwise rotary):
//   * The extension is compiled with -ffp-contract=off (setup.py): `a * b + c` is a multiply and an
//     add, each rounded; a fused multiply-add is only ever the explicit fmadd() below. So the same
//     source gives the same roundings wherever it is inlined.
//   * Every operation is elementwise and IEEE-exact per lane (load, convert, round, +, *, fmadd, /,
//     compare, select, exp below): a lane's result does not depend on W or on the other lanes. Only
//     hsum/hmax combine lanes, in a fixed tree.
//   * Conversions round to nearest even exactly as c10::BFloat16 / c10::Half do (NaN -> 0x7FC0 for
//     bf16), so a vector kernel and torch's scalar conversion agree bitwise.
// W is 4, 8 or 16; the instruction set comes from the build's -march (AVX-512F, AVX2 + FMA + F16C,
// or any other target through plain vector code and per-lane conversions).
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

// Functions of the kernels' innermost loops that must be inlined: a call there clobbers every vector
// register (all are caller-saved), so the loop's accumulators would be stored and reloaded around it.
#define PAGEDGEN_ALWAYS_INLINE inline __attribute__((always_inline))

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

// Vectors wider than the build's registers (8 floats without AVX) are passed by value between inline
// functions only; GCC's note that such arguments change the ABI does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace pagedgen::cpu {

#if defined(__AVX512F__)
constexpr int kLanes = 16;  // floats per native SIMD register
#elif defined(__AVX__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif
constexpr int W = kLanes;  // the kernels' name for it (a template's own parameter W hides this one)

template <int W>
struct VecOf;
template <>
struct VecOf<4> {
  typedef float type __attribute__((vector_size(16)));
  typedef int32_t itype __attribute__((vector_size(16)));
  typedef uint32_t utype __attribute__((vector_size(16)));
  typedef uint16_t htype __attribute__((vector_size(8)));
};
template <>
struct VecOf<8> {
  typedef float type __attribute__((vector_size(32)));
  typedef int32_t itype __attribute__((vector_size(32)));
  typedef uint32_t utype __attribute__((vector_size(32)));
  typedef uint16_t htype __attribute__((vector_size(16)));
};
template <>
struct VecOf<16> {
  typedef float type __attribute__((vector_size(64)));
  typedef int32_t itype __attribute__((vector_size(64)));
  typedef uint32_t utype __attribute__((vector_size(64)));
  typedef uint16_t htype __attribute__((vector_size(32)));
};
template <int W>
using Vec = typename VecOf<W>::type;  // W floats
template <int W>
using IVec = typename VecOf<W>::itype;  // W int32
template <int W>
using UVec = typename VecOf<W>::utype;  // W uint32
template <int W>
using HVec = typename VecOf<W>::htype;  // W 16-bit words (bf16 / fp16 bits)

// x in every lane: one broadcast (`Vec<W>{} + x` would be an add of +0.0 first, which the compiler
// must keep without fast-math: it turns -0.0 into +0.0).
// Keeps v in a register: a value used by several multiply-adds is then loaded once, where the
// compiler would fold a load into each of them (a load-bound inner loop). No instruction.
template <int W>
inline void register_value(Vec<W>& v) {
#if defined(__AVX512F__)
  asm("" : "+v"(v));
#elif defined(__AVX__)
  asm("" : "+x"(v));
#else
  (void)v;
#endif
}

template <int W>
inline Vec<W> splat(float x) {
#if defined(__AVX__)
  if constexpr (W == 8) {
    const __m256 r = _mm256_set1_ps(x);
    return reinterpret_cast<const Vec<W>&>(r);
  }
#endif
#if defined(__AVX512F__)
  if constexpr (W == 16) {
    const __m512 r = _mm512_set1_ps(x);
    return reinterpret_cast<const Vec<W>&>(r);
  }
#endif
#if defined(__SSE__)
  if constexpr (W == 4) {
    const __m128 r = _mm_set1_ps(x);
    return reinterpret_cast<const Vec<W>&>(r);
  }
#endif
  Vec<W> v;
  for (int i = 0; i < W; ++i) v[i] = x;
  return v;
}

template <int W>
inline UVec<W> bits_of(const Vec<W>& v) {
  UVec<W> u;
  std::memcpy(&u, &v, sizeof(u));
  return u;
}
template <int W, typename Int>
inline Vec<W> float_of(const Int& u) {  // Int: IVec<W> or UVec<W>
  static_assert(sizeof(Int) == sizeof(Vec<W>));
  Vec<W> v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
}

// ---- fused multiply-add: a * b + c rounded once ----------------------------------------------------
template <int W>
inline Vec<W> fmadd(const Vec<W>& a, const Vec<W>& b, const Vec<W>& c) {
#if defined(__FMA__) || defined(__AVX512F__)
  if constexpr (W == 4) {
    const __m128 r = _mm_fmadd_ps(reinterpret_cast<const __m128&>(a), reinterpret_cast<const __m128&>(b),
                                  reinterpret_cast<const __m128&>(c));
    return reinterpret_cast<const Vec<W>&>(r);
  } else if constexpr (W == 8) {
    const __m256 r = _mm256_fmadd_ps(reinterpret_cast<const __m256&>(a), reinterpret_cast<const __m256&>(b),
                                     reinterpret_cast<const __m256&>(c));
    return reinterpret_cast<const Vec<W>&>(r);
  }
#endif
#if defined(__AVX512F__)
  if constexpr (W == 16) {
    const __m512 r = _mm512_fmadd_ps(reinterpret_cast<const __m512&>(a), reinterpret_cast<const __m512&>(b),
                                     reinterpret_cast<const __m512&>(c));
    return reinterpret_cast<const Vec<W>&>(r);
  }
#endif
  // No hardware FMA for this width: the same per-lane value through the libm fma.
  Vec<W> r;
  for (int i = 0; i < W; ++i) r[i] = __builtin_fmaf(a[i], b[i], c[i]);
  return r;
}

// ---- loads and stores, converting to / from float32 -----------------------------------------------
template <int W>
inline Vec<W> load(const float* p) {
  Vec<W> v;
  std::memcpy(&v, p, sizeof(v));  // unaligned
  return v;
}
template <int W>
inline void store(float* p, const Vec<W>& v) {
  std::memcpy(p, &v, sizeof(v));
}

// bf16 -> float: the 16 bits become the upper half of the float's 32.
template <int W>
inline Vec<W> load(const c10::BFloat16* p) {
  // the same bits as the generic code below, in two instructions (a zero-extending load and a shift)
#if defined(__AVX512F__)
  if constexpr (W == 16) {
    const __m512i r = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
    return reinterpret_cast<const Vec<W>&>(r);
  }
#endif
#if defined(__AVX2__)
  if constexpr (W == 8) {
    const __m256i r = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
    return reinterpret_cast<const Vec<W>&>(r);
  }
#endif
  HVec<W> h;
  std::memcpy(&h, p, sizeof(h));
  return float_of<W>(__builtin_convertvector(h, UVec<W>) << 16);
}

// float -> bf16 bits (in the low 16 bits of each int32 lane): round to nearest even, NaN -> 0x7FC0,
// as c10::BFloat16's round_to_nearest_even, in integer arithmetic (every instruction set; with
// AVX512-BF16 the 16-lane store uses vcvtneps2bf16 for vectors where it is exact; round_to keeps the
// integer path, which measured faster than the check and the instruction there).
template <int W>
inline UVec<W> bf16_bits(const Vec<W>& v) {
  const UVec<W> u = bits_of<W>(v);
  const UVec<W> rounded = (u + (0x7FFFu + ((u >> 16) & 1u))) >> 16;
  return v != v ? UVec<W>{} + 0x7FC0u : rounded;  // v != v: the NaN lanes
}
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
// True when AVX512-BF16's vcvtneps2bf16 gives v's lanes exactly c10's bf16 bits: it rounds to nearest
// even as c10 does, but flushes denormal inputs to zero and keeps a NaN's sign and payload (c10:
// 0x7FC0), so it is exact for a vector with no denormal and no NaN lane (one vfpclassps). A normal
// float never rounds to a bf16 denormal (the two share the exponent range).
PAGEDGEN_ALWAYS_INLINE bool bf16_instruction_exact(const __m512 v) {
  return _mm512_fpclass_ps_mask(v, 0x01 | 0x20 | 0x80) == 0;  // quiet NaN, denormal, signalling NaN
}
#endif
template <int W>
inline void store(c10::BFloat16* p, const Vec<W>& v) {
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
  if constexpr (W == 16) {  // one conversion instruction where it gives the same bits (nearly always)
    const __m512 x = reinterpret_cast<const __m512&>(v);
    if (__builtin_expect(bf16_instruction_exact(x), 1)) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)));
      return;
    }
  }
#endif
  const HVec<W> h = __builtin_convertvector(bf16_bits<W>(v), HVec<W>);
  std::memcpy(p, &h, sizeof(h));
}

// float16 <-> float: F16C / AVX-512 conversions (round to nearest even, as c10::Half), else per lane.
template <int W>
inline Vec<W> load(const c10::Half* p) {
#if defined(__F16C__)
  if constexpr (W == 4) {
    const __m128 r = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return reinterpret_cast<const Vec<W>&>(r);
  } else if constexpr (W == 8) {
    const __m256 r = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return reinterpret_cast<const Vec<W>&>(r);
  }
#endif
#if defined(__AVX512F__)
  if constexpr (W == 16) {
    const __m512 r = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return reinterpret_cast<const Vec<W>&>(r);
  }
#endif
  Vec<W> r;
  for (int i = 0; i < W; ++i) r[i] = static_cast<float>(p[i]);
  return r;
}
template <int W>
inline void store(c10::Half* p, const Vec<W>& v) {
#if defined(__F16C__)
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  if constexpr (W == 4) {
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_cvtps_ph(reinterpret_cast<const __m128&>(v), kRound));
    return;
  } else if constexpr (W == 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(reinterpret_cast<const __m256&>(v), kRound));
    return;
  }
#endif
#if defined(__AVX512F__)
  if constexpr (W == 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(reinterpret_cast<const __m512&>(v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    return;
  }
#endif
  for (int i = 0; i < W; ++i) p[i] = c10::Half(v[i]);
}

// v rounded to scalar_t and back to float (the identity for float): torch's rounding point when an
// intermediate result is stored in the model dtype.
template <typename scalar_t, int W>
inline Vec<W> round_to(const Vec<W>& v) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return v;
  } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    return float_of<W>(bf16_bits<W>(v) << 16);
  } else {
    scalar_t tmp[W];
    store<W>(tmp, v);
    return load<W>(tmp);
  }
}

// The first n (< W) elements, the other lanes 0; and the matching partial store. Lanes are
// independent, so a row's tail gives the bits a full vector would.
template <int W, typename scalar_t>
inline Vec<W> load_partial(const scalar_t* p, int n) {
  scalar_t tmp[W] = {};
  std::memcpy(tmp, p, n * sizeof(scalar_t));
  return load<W>(tmp);
}
template <int W, typename scalar_t>
inline void store_partial(scalar_t* p, const Vec<W>& v, int n) {
  scalar_t tmp[W];
  store<W>(tmp, v);
  std::memcpy(p, tmp, n * sizeof(scalar_t));
}

// ---- lane reductions (fixed trees) -----------------------------------------------------------------
// The lanes [0, W/2) (kHigh false) or [W/2, W) (kHigh true) of v, no arithmetic. With
// __builtin_shufflevector a half is a register extract; a memcpy through memory would make the
// compiler keep v, and any loop variable reduced by hsum/hmax after the loop (softmax_tile's
// running sum), on the stack.
template <int W, bool kHigh>
PAGEDGEN_ALWAYS_INLINE Vec<W / 2> half_of(const Vec<W>& v) {
#if defined(__clang__) || __GNUC__ >= 12
  if constexpr (W == 16) {
    return kHigh ? __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15)
                 : __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  } else if constexpr (W == 8) {
    return kHigh ? __builtin_shufflevector(v, v, 4, 5, 6, 7) : __builtin_shufflevector(v, v, 0, 1, 2, 3);
  } else
#endif
  {
    Vec<W / 2> h;
    std::memcpy(&h, reinterpret_cast<const char*>(&v) + (kHigh ? sizeof(h) : 0), sizeof(h));
    return h;
  }
}
template <int W>
inline float hsum(const Vec<W>& v) {  // sum of the lanes as a tree of half-width adds
  if constexpr (W == 4) {
    return (v[0] + v[2]) + (v[1] + v[3]);
  } else {
    return hsum<W / 2>(half_of<W, false>(v) + half_of<W, true>(v));
  }
}
template <int W>
inline float hmax(const Vec<W>& v) {  // max of the lanes (exact: any order gives the same value)
  if constexpr (W == 4) {
    return std::max(std::max(v[0], v[2]), std::max(v[1], v[3]));
  } else {
    const Vec<W / 2> lo = half_of<W, false>(v), hi = half_of<W, true>(v);
    return hmax<W / 2>(lo > hi ? lo : hi);
  }
}
template <int W>
inline Vec<W> vmax(const Vec<W>& a, const Vec<W>& b) {
  return a > b ? a : b;
}

// ---- in-register transposes ------------------------------------------------------------------------
// transpose<W>(r): the W x W float block of the registers r[0:W] transposed in place (lane j of r[i]
// goes to lane i of r[j]), W = 8 with AVX, W = 16 with AVX-512. Exact (moves only).
#if defined(__AVX__)
inline void transpose8(__m256 r[8]) {
  __m256 t[8];
  for (int i = 0; i < 8; i += 2) {  // interleave pairs of rows: [r_i, r_i+1 of columns 0, 1 | 4, 5] and [2, 3 | 6, 7]
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {  // [rows i .. i + 3 of columns c | c + 4] for c = 0 .. 3
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int c = 0; c < 4; ++c) {  // the 128-bit halves of rows 0-3 and 4-7 of columns c and c + 4
    t[c] = _mm256_permute2f128_ps(r[c], r[c + 4], 0x20);
    t[c + 4] = _mm256_permute2f128_ps(r[c], r[c + 4], 0x31);
  }
  for (int c = 0; c < 8; ++c) r[c] = t[c];
}
#endif

#if defined(__AVX512F__)
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
#endif

template <int W>
inline void transpose(Vec<W>* r) {
#if defined(__AVX512F__)
  if constexpr (W == 16) {
    transpose16(reinterpret_cast<__m512*>(r));
    return;
  }
#endif
#if defined(__AVX__)
  if constexpr (W == 8) {
    transpose8(reinterpret_cast<__m256*>(r));
    return;
  }
#endif
  for (int i = 0; i < W; ++i) {
    for (int j = i + 1; j < W; ++j) {
      const float x = r[i][j];
      r[i][j] = r[j][i];
      r[j][i] = x;
    }
  }
}

// ---- exp -----------------------------------------------------------------------------------------
// exp(x) = 2^n * e^r with n = round(x / ln 2) (to nearest even, by the 1.5 * 2^23 trick), r = x - n ln 2
// (Cody-Waite split of ln 2, exact high part), e^r by its degree-7 Taylor polynomial in Horner form
// with fused multiply-adds (truncation error < 6e-9 relative; results within an ulp or two of the
// correctly rounded exp). Branch-free and elementwise, so the same in every lane and every W.
// Below -87 the result is exactly 0 (never a denormal: arithmetic on denormals can take microcode
// assists), above 88.72 it is +inf, NaN stays NaN.
template <int W>
inline Vec<W> exp(const Vec<W>& x) {
  const Vec<W> lo = splat<W>(-87.0f), hi = splat<W>(88.72283935546875f);  // hi: ln(FLT_MAX)
  Vec<W> xc = x > hi ? hi : x;  // NaN compares false and stays
  xc = xc < lo ? lo : xc;
  const Vec<W> shifter = splat<W>(12582912.0f);  // 1.5 * 2^23: (v + shifter) - shifter rounds v to an integer
  const Vec<W> n = (xc * splat<W>(1.44269504088896341f) + shifter) - shifter;  // in [-126, 128]
  Vec<W> r = fmadd<W>(n, splat<W>(-0.693359375f), xc);
  r = fmadd<W>(n, splat<W>(2.12194440e-4f), r);
  Vec<W> p = splat<W>(1.0f / 5040);
  for (const float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = fmadd<W>(p, r, splat<W>(c));
  const Vec<W> n127 = n > splat<W>(127.0f) ? splat<W>(127.0f) : n;
  const IVec<W> e = (__builtin_convertvector(n127, IVec<W>) + 127) << 23;  // 2^min(n, 127), a normal float
  Vec<W> y = p * float_of<W>(e);
  y = n > splat<W>(127.0f) ? y * 2.0f : y;  // n = 128 (x above 88.37): 2^128 would not be a float
  const Vec<W> zero = {}, inf = splat<W>(__builtin_inff());
  return x < lo ? zero : (x > hi ? inf : y);
}

// exp(x) for x <= 0 (attention's softmax weights exp(score - running max)): exp<W>'s range reduction
// and polynomial without the overflow branches (n = round(x / ln 2) is in [-126, 0]); below -87
// exactly 0; NaN stays NaN.
template <int W>
inline Vec<W> exp_nonpositive(const Vec<W>& x) {
  const Vec<W> lo = splat<W>(-87.0f);
  const Vec<W> xc = x < lo ? lo : x;
  const Vec<W> shifter = splat<W>(12582912.0f);
  const Vec<W> n = (xc * splat<W>(1.44269504088896341f) + shifter) - shifter;
  Vec<W> r = fmadd<W>(n, splat<W>(-0.693359375f), xc);
  r = fmadd<W>(n, splat<W>(2.12194440e-4f), r);
  Vec<W> p = splat<W>(1.0f / 5040);
  for (const float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = fmadd<W>(p, r, splat<W>(c));
  const Vec<W> y = p * float_of<W>((__builtin_convertvector(n, IVec<W>) + 127) << 23);
  return x < lo ? Vec<W>{} : y;
}

// exp of one float, bitwise the value of any lane of exp<W>.
inline float exp_scalar(float x) { return exp<4>(splat<4>(x))[0]; }

// Calls fn(scalar_t{}) for the kernels' three dtypes (float32, bfloat16, float16): like
// AT_DISPATCH_FLOATING_TYPES_AND2 without a float64 instantiation. `op` names the op in the error.
template <typename Fn>
inline void dispatch_float_types(c10::ScalarType dtype, const char* op, Fn&& fn) {
  switch (dtype) {
    case c10::ScalarType::Float: return fn(float{});
    case c10::ScalarType::BFloat16: return fn(c10::BFloat16{});
    case c10::ScalarType::Half: return fn(c10::Half{});
    default: TORCH_CHECK(false, op, ": dtype must be float32, bfloat16 or float16, got ", dtype);
  }
}

}  // namespace pagedgen::cpu
