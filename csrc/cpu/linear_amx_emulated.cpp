// pagedgen::packed_linear_bf16_amx_emulated and pagedgen::int8_linear_amx_emulated: the AMX GEMMs' tile
// loop (csrc/cpu/linear_amx_loop.h) run on a plain C++ emulation of the tiles, on any CPU (the runtime
// detection, pagedgen::cpu_has_amx / cpu_has_amx_int8, is in csrc/cpu_features.cpp).
// The emulation exists to test the packing and indexing the AMX kernels share with it on CPUs without
// AMX; it is slow (scalar) and is never chosen for a model.
// - tdpbf16ps follows Intel's pseudocode (per row m, pair k in order, column n: C += A[m, 2k + 1]
//   B[k, 2n + 1], then C += A[m, 2k] B[k, 2n], each a float32 add; products of bf16 are exact in
//   float32), but denormal flushing and the hardware's internal rounding are not modelled, so its bits
//   need not be the AMX kernel's.
// - tdpbssd is exact: C[m, n] += the 4 products A[m, 4k + i] B[k, 4n + i] of sign-extended bytes, in
//   int32 with wrap-around (as the hardware), so its bits are the AMX kernel's and int8_linear's.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#include "linear_amx_loop.h"
#include "linear_bf16_checks.h"
#include "linear_int8_amx.h"

namespace pagedgen::cpu {
namespace {

float bf16_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// tdpbf16ps on one C tile [16, 16] float32, A [16, 32] bf16, B [16 pairs, 16 outputs, 2] bf16. Not
// loop-vectorized: GCC 12.2 at -O3 (with or without -march) vectorizes this loop wrongly, adding
// A[m, 2k] B[k, 2n] twice (found by the tests; -O2 and -fno-tree-loop-vectorize give the right sums);
// the emulation's speed does not matter.
__attribute__((optimize("no-tree-loop-vectorize"))) void emulate_dpbf16ps(uint8_t* c_tile, const uint8_t* a_tile,
                                                                           const uint8_t* b_tile) {
  float c[amx::kTileRows][amx::kPanel];
  uint16_t a[amx::kTileRows][2 * amx::kPanel], b[amx::kTileRows][2 * amx::kPanel];
  std::memcpy(c, c_tile, sizeof(c));
  std::memcpy(a, a_tile, sizeof(a));
  std::memcpy(b, b_tile, sizeof(b));
  for (int m = 0; m < amx::kTileRows; ++m)
    for (int k = 0; k < amx::kTileRows; ++k)
      for (int n = 0; n < amx::kPanel; ++n) {
        float t = c[m][n];
        t += bf16_to_float(a[m][2 * k + 1]) * bf16_to_float(b[k][2 * n + 1]);
        t += bf16_to_float(a[m][2 * k]) * bf16_to_float(b[k][2 * n]);
        c[m][n] = t;
      }
  std::memcpy(c_tile, c, sizeof(c));
}

// tdpbssd on one C tile [16, 16] int32, A [16, 64] int8, B [16 quads, 16 outputs, 4] int8 (uint32 sums:
// the int32 wrap-around without undefined behaviour).
void emulate_dpbssd(uint8_t* c_tile, const uint8_t* a_tile, const uint8_t* b_tile) {
  uint32_t c[amx::kTileRows][amx::kPanel];
  int8_t a[amx::kTileRows][amx::kChunkBytes], b[amx::kTileRows][amx::kChunkBytes];
  std::memcpy(c, c_tile, sizeof(c));
  std::memcpy(a, a_tile, sizeof(a));
  std::memcpy(b, b_tile, sizeof(b));
  for (int m = 0; m < amx::kTileRows; ++m)
    for (int k = 0; k < amx::kTileRows; ++k)
      for (int n = 0; n < amx::kPanel; ++n)
        for (int i = 0; i < 4; ++i) c[m][n] += static_cast<uint32_t>(int32_t{a[m][4 * k + i]} * int32_t{b[k][4 * n + i]});
  std::memcpy(c_tile, c, sizeof(c));
}

// 8 tiles as palette 1 with the loop's configuration: C tiles 0-3 [16 rows, 64 bytes], A tiles 4-5,
// B tiles 6-7 (each 16 rows of 64 bytes); Dp(C, A, B) is the dot product.
template <void (*Dp)(uint8_t*, const uint8_t*, const uint8_t*)>
struct EmulatedTiles {
  uint8_t c[4][amx::kTileRows * amx::kChunkBytes];
  uint8_t a[2][amx::kTileRows * amx::kChunkBytes];
  uint8_t b[2][amx::kTileBytes];
  void configure() {}
  void release() {}
  void zero_c() { std::memset(c, 0, sizeof(c)); }
  void load_a(int i, const uint8_t* p, int64_t stride_bytes) {  // tileloadd: 16 rows of 64 bytes
    for (int r = 0; r < amx::kTileRows; ++r) std::memcpy(a[i] + r * amx::kChunkBytes, p + r * stride_bytes, amx::kChunkBytes);
  }
  void load_b(int j, const uint8_t* p) { std::memcpy(b[j], p, sizeof(b[j])); }
  void dp(int i, int j) { Dp(c[2 * i + j], a[i], b[j]); }
  void store(int i, int j, void* dst) { std::memcpy(dst, c[2 * i + j], sizeof(c[0])); }  // tilestored
};

void packed_linear_bf16_amx_emulated_cpu(const at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                                         const c10::optional<at::Tensor>& bias) {
  const at::Tensor b = check_packed_linear_bf16("packed_linear_bf16_amx_emulated", out, input, weight, bias);
  const int64_t M = input.size(0), K = input.size(1), N = out.size(1);
  const amx::Bf16Gemm g{reinterpret_cast<const uint16_t*>(input.const_data_ptr<at::BFloat16>()), input.stride(0), M, K,
                        reinterpret_cast<const uint16_t*>(weight.const_data_ptr<at::BFloat16>()), N, weight.size(0),
                        weight.size(1), b.defined() ? b.const_data_ptr<float>() : nullptr, out.data_ptr<at::BFloat16>(),
                        out.stride(0)};
  amx::run<amx::Bf16Gemm, EmulatedTiles<emulate_dpbf16ps>>(g);
}

#if defined(__AVX2__)
void int8_linear_amx_emulated_cpu(const at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                                  const at::Tensor& weight_scale, const c10::optional<at::Tensor>& input_scale,
                                  const c10::optional<at::Tensor>& bias) {
  amx::int8_linear_tiles<EmulatedTiles<emulate_dpbssd>>("int8_linear_amx_emulated", out, input, weight, weight_scale,
                                                        input_scale, bias, [] {});
}
#endif

}  // namespace
}  // namespace pagedgen::cpu

TORCH_LIBRARY_IMPL(pagedgen, CPU, m) {
  m.impl("packed_linear_bf16_amx_emulated", &pagedgen::cpu::packed_linear_bf16_amx_emulated_cpu);
#if defined(__AVX2__)
  m.impl("int8_linear_amx_emulated", &pagedgen::cpu::int8_linear_amx_emulated_cpu);
#endif
}
