// pagedgen::packed_linear_bf16_amx_emulated: the AMX GEMM's tile loop (csrc/cpu/linear_amx_loop.h) run
// on a plain C++ emulation of the tiles, on any CPU (the runtime detection, pagedgen::cpu_has_amx, is in
// csrc/cpu_features.cpp).
// The emulation exists to test the packing and indexing the AMX kernel shares with it on CPUs without
// AMX: its arithmetic follows Intel's pseudocode of TDPBF16PS (per row m, pair k in order, column n:
// C += A[m, 2k + 1] B[k, 2n + 1], then C += A[m, 2k] B[k, 2n], each a float32 add; products of bf16 are
// exact in float32), but denormal flushing and the hardware's internal rounding are not modelled, so
// its bits need not be the AMX kernel's. It is slow (scalar) and is never chosen for a model.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#include "linear_amx_loop.h"
#include "linear_bf16_checks.h"

namespace pagedgen::cpu {
namespace {

float bf16_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// 8 tiles as palette 1 with the loop's configuration: C tiles 0-3 [16, 16] float32, A tiles [16, 32] bf16,
// B tiles [16 pairs, 16 outputs, 2] bf16.
struct EmulatedTiles {
  float c[4][amx::kTileRows][amx::kPanel];
  uint16_t a[2][amx::kTileRows][amx::kChunk];
  uint16_t b[2][amx::kChunkPairs][2 * amx::kPanel];
  void configure() {}
  void release() {}
  void zero_c() { std::memset(c, 0, sizeof(c)); }
  void load_a(int i, const uint16_t* p, int64_t stride_bytes) {  // tileloadd: 16 rows of 64 bytes
    for (int r = 0; r < amx::kTileRows; ++r)
      std::memcpy(a[i][r], reinterpret_cast<const char*>(p) + r * stride_bytes, sizeof(a[i][r]));
  }
  void load_b(int j, const uint16_t* p) { std::memcpy(b[j], p, sizeof(b[j])); }
  // tdpbf16ps C[2 i + j] += A[i] B[j]. Not loop-vectorized: GCC 12.2 at -O3 (with or without -march)
  // vectorizes this loop wrongly, adding A[m, 2k] B[k, 2n] twice (found by this file's tests; -O2 and
  // -fno-tree-loop-vectorize give the right sums); the emulation's speed does not matter.
  __attribute__((optimize("no-tree-loop-vectorize"))) void dp(int i, int j) {
    float(*cc)[amx::kPanel] = c[2 * i + j];
    for (int m = 0; m < amx::kTileRows; ++m)
      for (int k = 0; k < amx::kChunkPairs; ++k)
        for (int n = 0; n < amx::kPanel; ++n) {
          float t = cc[m][n];
          t += bf16_to_float(a[i][m][2 * k + 1]) * bf16_to_float(b[j][k][2 * n + 1]);
          t += bf16_to_float(a[i][m][2 * k]) * bf16_to_float(b[j][k][2 * n]);
          cc[m][n] = t;
        }
  }
  void store(int i, int j, float* dst) { std::memcpy(dst, c[2 * i + j], sizeof(c[0])); }  // tilestored
};

void packed_linear_bf16_amx_emulated_cpu(const at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                                         const c10::optional<at::Tensor>& bias) {
  const at::Tensor b = check_packed_linear_bf16("packed_linear_bf16_amx_emulated", out, input, weight, bias);
  const int64_t M = input.size(0), K = input.size(1), N = out.size(1);
  const amx::Problem g{reinterpret_cast<const uint16_t*>(input.const_data_ptr<at::BFloat16>()), input.stride(0), M, K,
                       reinterpret_cast<const uint16_t*>(weight.const_data_ptr<at::BFloat16>()), N, weight.size(0),
                       weight.size(1), b.defined() ? b.const_data_ptr<float>() : nullptr, out.data_ptr<at::BFloat16>(),
                       out.stride(0)};
  amx::run<EmulatedTiles>(g);
}

}  // namespace
}  // namespace pagedgen::cpu

TORCH_LIBRARY_IMPL(pagedgen, CPU, m) {
  m.impl("packed_linear_bf16_amx_emulated", &pagedgen::cpu::packed_linear_bf16_amx_emulated_cpu);
}
