// The read of the 1-byte KV cache (kv_cache_dtype int8 / fp8, pagedgen/ops/kv_quant.py,
// docs/kv_cache_dtype.md) in vector registers: codes -> floats. The paged attention kernel reads K
// and V rows as float(code) (load<kLanes>, codes_to_float) and applies each token's bf16 scale to its
// scores and weights (attention_general.h); kv_dequantize_blocks writes float(code) * float(scale)
// rounded to its output dtype (dequantize_row), exactly as the reference's
// `(codes.float() * scales.float()[..., None]).to(dtype)`.
//
//   codes: int8, float8_e4m3fn or float8_e5m2 (one byte each); scale: a row's bfloat16 scale
//
// The conversions, kLanes codes at a time (no table, no per-element scalar code):
//   int8:   sign-extended to int32 (vpmovsxbd), then to float (vcvtdq2ps): exact.
//   e5m2:   the code is the upper byte of an fp16 with the same value: `code << 8`, then F16C's
//           vcvtph2ps (present on every AVX2 CPU): exact, infinities and NaNs included.
//   e4m3fn: sign << 15 | (code & 0x7f) << 7 is an fp16 of value code * 2^-8 (fp8_bits.h, the
//           placement the FP8 GEMM shares); the codes 0x7f / 0xff (e4m3fn's only NaNs) become fp16
//           NaNs; then vcvtph2ps. The 2^8 goes into the scale (code_fold): (code * 2^-8) * (s * 2^8)
//           is the same real product as code * s, rounded once, so the same float (s * 2^8 is exact
//           for every finite bf16 scale below 2^120; larger scales do not occur, |x| / 448).
// tests/ops/test_kv_quant_attention.py checks all 256 codes of each dtype against torch's conversion.
#pragma once

#include "fp8_bits.h"
#include "vec.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace pagedgen::cpu {

// True for the 1-byte code dtypes (the caches read through kv_row_to_float's dequantization).
template <typename cache_t>
constexpr bool is_kv_code() {
  return std::is_same_v<cache_t, int8_t> || std::is_same_v<cache_t, c10::Float8_e4m3fn> ||
         std::is_same_v<cache_t, c10::Float8_e5m2>;
}

// The factor load_codes leaves out of a code's value (2^8 for e4m3fn, 1 otherwise).
template <typename code_t>
constexpr float code_fold() {
  return std::is_same_v<code_t, c10::Float8_e4m3fn> ? 256.0f : 1.0f;
}

// kLanes codes at p as float, each value / code_fold<code_t>() (exact).
template <typename code_t>
PAGEDGEN_ALWAYS_INLINE Vec<kLanes> load_codes(const code_t* p) {
  static_assert(is_kv_code<code_t>(), "load_codes: int8, float8_e4m3fn or float8_e5m2 codes");
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__))
#if defined(__AVX512F__)
  static_assert(kLanes == 16);
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i w = _mm256_cvtepu8_epi16(bytes);  // 16 words, the codes zero-extended
  const auto to_float = [](__m256i h) { return _mm512_cvtph_ps(h); };
#else
  static_assert(kLanes == 8);
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i w = _mm_cvtepu8_epi16(bytes);  // 8 words, the codes zero-extended
  const auto to_float = [](__m128i h) { return _mm256_cvtph_ps(h); };
#endif
  if constexpr (std::is_same_v<code_t, int8_t>) {
#if defined(__AVX512F__)
    const __m512 r = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
#else
    const __m256 r = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
#endif
    return reinterpret_cast<const Vec<kLanes>&>(r);
  } else {
#if defined(__AVX512F__)
    using U = U16x16;  // the 16 codes of w
    using W = __m256i;
#else
    using U = U16x8;
    using W = __m128i;
#endif
    const U c = (U)w;
    const U h = std::is_same_v<code_t, c10::Float8_e5m2> ? U(c << 8)  // e5m2: the upper byte of an fp16
                                                         : e4m3_half_bits_nan(c);
    const auto r = to_float((W)h);
    return reinterpret_cast<const Vec<kLanes>&>(r);
  }
#else
  Vec<kLanes> r;
  for (int i = 0; i < kLanes; ++i) r[i] = static_cast<float>(p[i]) / code_fold<code_t>();
  return r;
#endif
}

// dst[0:n] = float(src[d]) * scale rounded to scalar_t, as float (kLanes at a time, the tail through
// a zero-padded copy: lanes are independent).
template <typename scalar_t, typename code_t>
PAGEDGEN_ALWAYS_INLINE void dequantize_row(const code_t* src, float scale, float* dst, int n) {
  const Vec<kLanes> s = splat<kLanes>(scale * code_fold<code_t>());
  int i = 0;
  for (; i + kLanes <= n; i += kLanes) store<kLanes>(dst + i, round_to<scalar_t, kLanes>(load_codes(src + i) * s));
  if (i < n) {
    code_t tail[kLanes] = {};
    std::memcpy(tail, src + i, (n - i) * sizeof(code_t));
    store_partial<kLanes>(dst + i, round_to<scalar_t, kLanes>(load_codes(tail) * s), n - i);
  }
}

// The attention's reads of a 1-byte cache (attention_general.h, attention_math.h): K and V rows as
// float(code) / code_fold, the scales applied per token outside (q . k = s_k (q . code) on the
// scores, p v = (p s_v) code on the weights). load<kLanes>(codes) lets the inner loops read the codes
// in place, as they read bf16 rows; codes_to_float fills a tile buffer.
template <int W>
PAGEDGEN_ALWAYS_INLINE Vec<W> load(const int8_t* p) {
  static_assert(W == kLanes, "1-byte codes: whole registers");
  return load_codes(p);
}
template <int W>
PAGEDGEN_ALWAYS_INLINE Vec<W> load(const c10::Float8_e4m3fn* p) {
  static_assert(W == kLanes, "1-byte codes: whole registers");
  return load_codes(p);
}
template <int W>
PAGEDGEN_ALWAYS_INLINE Vec<W> load(const c10::Float8_e5m2* p) {
  static_assert(W == kLanes, "1-byte codes: whole registers");
  return load_codes(p);
}

// dst[0:n] = float(src[d]) / code_fold<code_t>() (the tail through a zero-padded copy).
template <typename code_t>
PAGEDGEN_ALWAYS_INLINE void codes_to_float(const code_t* src, float* dst, int n) {
  int i = 0;
  for (; i + kLanes <= n; i += kLanes) store<kLanes>(dst + i, load_codes(src + i));
  if (i < n) {
    code_t tail[kLanes] = {};
    std::memcpy(tail, src + i, (n - i) * sizeof(code_t));
    store_partial<kLanes>(dst + i, load_codes(tail), n - i);
  }
}

}  // namespace pagedgen::cpu
