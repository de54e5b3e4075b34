// float8_e4m3fn codes as float16 bits, in 16-bit vector lanes: the one placement shared by the FP8
// W8A16 GEMM's dequantizer (linear_fp8.cpp, weights) and the 1-byte KV cache's read (kv_codes.h).
//
// A code c (zero-extended to 16 bits) becomes h = sign << 15 | (c & 0x7f) << 7: e4m3's 4 exponent bits
// (bias 7) land in the low 4 of float16's 5 (bias 15) and its 3 mantissa bits on top of float16's 10,
// so h is exactly the code's value times 2^-8, normals and subnormals alike (an e4m3 subnormal
// m * 2^-9 is the float16 subnormal m * 2^-17); the caller folds the 2^8 into its scale. Three
// operations: t = c << 7 has the magnitude at bits 7-13 and the sign at bit 14, and t + (t & 0x4000)
// carries the sign to bit 15 (bit 15 of t is 0).
// e4m3fn's NaN codes 0x7f / 0xff would read as +-480 * 2^-8: e4m3_half_bits_nan maps them to float16
// NaNs (the KV cache's read, which must give NaN for them as torch does); the GEMM's loader refuses
// them instead (pagedgen.layers.quant_fp8.pack_fp8) and uses e4m3_half_bits.
// Then F16C's vcvtph2ps (every AVX2 CPU has it) converts the halves to float32, exactly.
#pragma once

#include <cstdint>

namespace pagedgen::cpu {

// 8 or 16 lanes of uint16: one __m128i / __m256i, converted by a vector cast (a bit copy).
typedef uint16_t U16x8 __attribute__((vector_size(16)));
typedef uint16_t U16x16 __attribute__((vector_size(32)));

// Codes (zero-extended, one per lane of V: U16x8 or U16x16) -> float16 bits of code * 2^-8; NaN codes
// not handled.
template <typename V>
inline __attribute__((always_inline)) V e4m3_half_bits(V c) {
  static_assert(sizeof(c[0]) == 2, "16-bit lanes");
  const V t = c << 7;
  return t + (t & 0x4000);
}

// The same, with the NaN codes 0x7f / 0xff as float16 NaNs (sign | 0x7f80 | 0x7e00: quiet NaN).
template <typename V>
inline __attribute__((always_inline)) V e4m3_half_bits_nan(V c) {
  const V nan = (V)((c & 0x7f) == 0x7f);  // all ones in the NaN lanes
  return e4m3_half_bits(c) | (nan & 0x7e00);
}

}  // namespace pagedgen::cpu
