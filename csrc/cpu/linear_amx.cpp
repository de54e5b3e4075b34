// CPU kernel of pagedgen::packed_linear_bf16_amx (schema in csrc/ops.cpp): the product of
// packed_linear_bf16 (same arguments, same bf16-pair weight layout, same checks) computed with AMX tiles
// (tdpbf16ps), batch-invariant by construction. The tile loop and its packing are in
// csrc/cpu/linear_amx_loop.h, shared with the emulation tested on every CPU (linear_amx_emulated.cpp).
//
// Only this file holds AMX instructions, and only in the builds whose flags enable AMX (setup.py's amx
// level, or -march=native on a CPU with AMX): there the compiler defines __AMX_TILE__ and __AMX_BF16__.
// The op is registered in every build of the CPU kernels; it checks its arguments, then raises
// (RuntimeError) on a CPU without AMX, in a build without AMX (a lower level forced by PAGEDGEN_CPU_ISA)
// or where the OS refuses the tile state, before any tile instruction. Status: measured on a Xeon with
// AMX (benchmarks/results/history.md); opt-in (PAGEDGEN_CPU_MATMUL=amx, pagedgen/layers/matmul/choice.py;
// amx_check.py self-checks it first).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <mutex>

#include "linear_amx_loop.h"
#include "linear_bf16_checks.h"

#if defined(__x86_64__) && defined(__linux__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PAGEDGEN_AMX_BUILD 1
#define PAGEDGEN_AMX_INLINE inline __attribute__((always_inline))
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace pagedgen::cpu {
namespace {

#ifdef PAGEDGEN_AMX_BUILD

// Linux: the process asks once for the tile data state (XFEATURE_XTILEDATA = 18) before the first tile
// instruction; true when granted.
bool request_tile_permission() {
  static std::once_flag once;
  static bool granted = false;
  std::call_once(once, [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    granted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  });
  return granted;
}
#endif

}  // namespace
}  // namespace pagedgen::cpu

#ifdef PAGEDGEN_AMX_BUILD
#include <immintrin.h>

namespace pagedgen::cpu {
namespace {

// The 8 tiles of palette 1 as the loop uses them: tmm0-3 C [16 rows, 64 bytes], tmm4-5 A, tmm6-7 B.
// The tile intrinsics take the register number as a literal, hence the switches (constants once
// inlined into the loop).
// GCC 12's _tile_loadd asm names neither the memory it reads nor a "memory" clobber, so the compiler
// may sink or drop the stores that fill the A and B buffers (pack_a, b_tile's tail) past it; the
// loads here are the same instruction with a "memory" clobber, and ldtilecfg takes the whole config
// as its operand (GCC's passes 8 of its 64 bytes).
#define PAGEDGEN_TILELOADD(dst, base, stride) \
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #dst ::"r"(static_cast<const void*>(base)), "r"(static_cast<long>(stride)) : "memory")
struct AmxTiles {
  struct alignas(64) Config {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  };
  void configure();
  void release();
  PAGEDGEN_AMX_INLINE void zero_c() { _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); }
  PAGEDGEN_AMX_INLINE void load_a(int i, const uint16_t* p, int64_t stride_bytes) {
    if (i == 0) PAGEDGEN_TILELOADD(4, p, stride_bytes); else PAGEDGEN_TILELOADD(5, p, stride_bytes);
  }
  PAGEDGEN_AMX_INLINE void load_b(int j, const uint16_t* p) {
    if (j == 0) PAGEDGEN_TILELOADD(6, p, 64); else PAGEDGEN_TILELOADD(7, p, 64);
  }
  PAGEDGEN_AMX_INLINE void dp(int i, int j) {
    switch (2 * i + j) {
      case 0: _tile_dpbf16ps(0, 4, 6); break;
      case 1: _tile_dpbf16ps(1, 4, 7); break;
      case 2: _tile_dpbf16ps(2, 5, 6); break;
      default: _tile_dpbf16ps(3, 5, 7); break;
    }
  }
  PAGEDGEN_AMX_INLINE void store(int i, int j, float* dst) {
    switch (2 * i + j) {
      case 0: _tile_stored(0, dst, 64); break;
      case 1: _tile_stored(1, dst, 64); break;
      case 2: _tile_stored(2, dst, 64); break;
      default: _tile_stored(3, dst, 64); break;
    }
  }
};

void AmxTiles::configure() {
  Config cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  __asm__ volatile("ldtilecfg %0" ::"m"(cfg) : "memory");  // the whole 64 bytes as the operand
}
void AmxTiles::release() { _tile_release(); }

void run_amx(const amx::Problem& g) { amx::run<AmxTiles>(g); }

}  // namespace
}  // namespace pagedgen::cpu
#endif  // PAGEDGEN_AMX_BUILD

namespace pagedgen::cpu {
namespace {

// The answer of pagedgen::cpu_has_amx (csrc/cpu_features.cpp, in pagedgen._C), asked once per process.
bool cpu_has_amx_here() {
  static const bool has = [] {
    const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("pagedgen::cpu_has_amx", "").typed<bool()>();
    return op.call();
  }();
  return has;
}

void packed_linear_bf16_amx_cpu(const at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                                const c10::optional<at::Tensor>& bias) {
  const at::Tensor b = check_packed_linear_bf16("packed_linear_bf16_amx", out, input, weight, bias);
  TORCH_CHECK(cpu_has_amx_here(), "packed_linear_bf16_amx: this CPU (or its OS) has no AMX-TILE and AMX-BF16 "
              "(pagedgen::cpu_has_amx() is False)");
#ifdef PAGEDGEN_AMX_BUILD
  TORCH_CHECK(request_tile_permission(), "packed_linear_bf16_amx: Linux refused the AMX tile state "
              "(arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) failed)");
  const int64_t M = input.size(0), K = input.size(1), N = out.size(1);
  const amx::Problem g{reinterpret_cast<const uint16_t*>(input.const_data_ptr<at::BFloat16>()), input.stride(0), M, K,
                       reinterpret_cast<const uint16_t*>(weight.const_data_ptr<at::BFloat16>()), N, weight.size(0),
                       weight.size(1), b.defined() ? b.const_data_ptr<float>() : nullptr, out.data_ptr<at::BFloat16>(),
                       out.stride(0)};
  run_amx(g);
#else
  TORCH_CHECK(false, "packed_linear_bf16_amx: the CPU kernels loaded were built without AMX (a lower level forced by "
              "PAGEDGEN_CPU_ISA, or a build without the amx level; pagedgen.ops.cpu_isa() names the level)");
#endif
}

}  // namespace
}  // namespace pagedgen::cpu

TORCH_LIBRARY_IMPL(pagedgen, CPU, m) { m.impl("packed_linear_bf16_amx", &pagedgen::cpu::packed_linear_bf16_amx_cpu); }
