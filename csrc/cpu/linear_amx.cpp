// CPU kernels of pagedgen::packed_linear_bf16_amx and pagedgen::int8_linear_amx (schemas in csrc/ops.cpp):
// - packed_linear_bf16_amx: the product of packed_linear_bf16 (same arguments, same bf16-pair weight
//   layout, same checks) computed with AMX tiles (tdpbf16ps), batch-invariant by construction. Status:
//   measured on a Xeon with AMX (benchmarks/results/history.md); opt-in (PAGEDGEN_CPU_MATMUL=amx,
//   pagedgen/layers/matmul/choice.py; amx_check.py self-checks it first).
// - int8_linear_amx: int8_linear's W8A8 product (same arguments, checks and bits) with AMX-INT8 tiles
//   (tdpbssd; csrc/cpu/linear_int8_amx.h). Status: not yet run on AMX hardware; the int8 layers use it
//   from INT8_AMX_MIN_ROWS rows on a CPU with AMX-INT8, after a bitwise self-check against int8_linear
//   (pagedgen/layers/matmul/int8_amx.py).
// Both run the tile loop of csrc/cpu/linear_amx_loop.h, shared with the emulation tested on every CPU
// (linear_amx_emulated.cpp).
//
// Only this file holds AMX instructions, and only in the builds whose flags enable AMX (setup.py's amx
// level, or -march=native on a CPU with AMX): there the compiler defines __AMX_TILE__, __AMX_BF16__ and
// __AMX_INT8__. The ops are registered in every build of the CPU kernels (int8_linear_amx in those with
// AVX2); each checks its arguments, then raises (RuntimeError) on a CPU without AMX (AMX-INT8 for the
// int8 op), in a build without AMX (a lower level forced by PAGEDGEN_CPU_ISA) or where the OS refuses
// the tile state, before any tile instruction.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <mutex>

#include "linear_amx_loop.h"
#include "linear_bf16_checks.h"
#include "linear_int8_amx.h"

#if defined(__x86_64__) && defined(__linux__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PAGEDGEN_AMX_BUILD 1
#if defined(__AMX_INT8__)
#define PAGEDGEN_AMX_INT8_BUILD 1
#endif
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

// The 8 tiles of palette 1 as the loop uses them: tmm0-3 C [16 rows, 64 bytes], tmm4-5 A, tmm6-7 B;
// kInt8 picks the dot product: tdpbssd (signed int8 quads, int32 C) or tdpbf16ps (bf16 pairs, float32 C).
// The tile instructions take the register number as a literal, hence the switches (constants once
// inlined into the loop).
// GCC 12's _tile_loadd asm names neither the memory it reads nor a "memory" clobber, so the compiler
// may sink or drop the stores that fill the A and B buffers (the kinds' rows() and prepare_b()) past it; the
// loads here are the same instruction with a "memory" clobber, and ldtilecfg takes the whole config
// as its operand (GCC's passes 8 of its 64 bytes).
#define PAGEDGEN_TILELOADD(dst, base, stride) \
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #dst ::"r"(static_cast<const void*>(base)), "r"(static_cast<long>(stride)) : "memory")
#define PAGEDGEN_TILEDP(op, c, a, b) __asm__ volatile(#op " %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)
#define PAGEDGEN_TILEDP_CASES(op)                \
  switch (2 * i + j) {                           \
    case 0: PAGEDGEN_TILEDP(op, 0, 4, 6); break; \
    case 1: PAGEDGEN_TILEDP(op, 1, 4, 7); break; \
    case 2: PAGEDGEN_TILEDP(op, 2, 5, 6); break; \
    default: PAGEDGEN_TILEDP(op, 3, 5, 7); break; \
  }
template <bool kInt8>
struct AmxTiles {
  struct alignas(64) Config {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  };
  void configure();
  void release();
  PAGEDGEN_AMX_INLINE void zero_c() { _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); }
  PAGEDGEN_AMX_INLINE void load_a(int i, const uint8_t* p, int64_t stride_bytes) {
    if (i == 0) PAGEDGEN_TILELOADD(4, p, stride_bytes); else PAGEDGEN_TILELOADD(5, p, stride_bytes);
  }
  PAGEDGEN_AMX_INLINE void load_b(int j, const uint8_t* p) {
    if (j == 0) PAGEDGEN_TILELOADD(6, p, 64); else PAGEDGEN_TILELOADD(7, p, 64);
  }
  PAGEDGEN_AMX_INLINE void dp(int i, int j) {
    if constexpr (kInt8) {
      PAGEDGEN_TILEDP_CASES(tdpbssd)
    } else {
      PAGEDGEN_TILEDP_CASES(tdpbf16ps)
    }
  }
  PAGEDGEN_AMX_INLINE void store(int i, int j, void* dst) {
    switch (2 * i + j) {
      case 0: _tile_stored(0, dst, 64); break;
      case 1: _tile_stored(1, dst, 64); break;
      case 2: _tile_stored(2, dst, 64); break;
      default: _tile_stored(3, dst, 64); break;
    }
  }
};

template <bool kInt8>
void AmxTiles<kInt8>::configure() {
  Config cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  __asm__ volatile("ldtilecfg %0" ::"m"(cfg) : "memory");  // the whole 64 bytes as the operand
}
template <bool kInt8>
void AmxTiles<kInt8>::release() { _tile_release(); }

}  // namespace
}  // namespace pagedgen::cpu
#endif  // PAGEDGEN_AMX_BUILD

namespace pagedgen::cpu {
namespace {

// The answer of pagedgen::<op>() -> bool (cpu_has_amx, cpu_has_amx_int8: csrc/cpu_features.cpp, in pagedgen._C).
bool ask_cpu(const char* op) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(op, "").typed<bool()>().call();
}
bool cpu_has_amx_here() {  // asked once per process
  static const bool has = ask_cpu("pagedgen::cpu_has_amx");
  return has;
}
bool cpu_has_amx_int8_here() {
  static const bool has = ask_cpu("pagedgen::cpu_has_amx_int8");
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
  const amx::Bf16Gemm g{reinterpret_cast<const uint16_t*>(input.const_data_ptr<at::BFloat16>()), input.stride(0), M, K,
                        reinterpret_cast<const uint16_t*>(weight.const_data_ptr<at::BFloat16>()), N, weight.size(0),
                        weight.size(1), b.defined() ? b.const_data_ptr<float>() : nullptr, out.data_ptr<at::BFloat16>(),
                        out.stride(0)};
  amx::run<amx::Bf16Gemm, AmxTiles<false>>(g);
#else
  TORCH_CHECK(false, "packed_linear_bf16_amx: the CPU kernels loaded were built without AMX (a lower level forced by "
              "PAGEDGEN_CPU_ISA, or a build without the amx level; pagedgen.ops.cpu_isa() names the level)");
#endif
}

#if defined(__AVX2__)
void int8_linear_amx_cpu(const at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, const at::Tensor& weight_scale,
                         const c10::optional<at::Tensor>& input_scale, const c10::optional<at::Tensor>& bias) {
  const auto ready = [] {  // after the argument checks, before any pointer is read
    TORCH_CHECK(cpu_has_amx_int8_here(), "int8_linear_amx: this CPU (or its OS) has no AMX-TILE and AMX-INT8 "
                "(pagedgen::cpu_has_amx_int8() is False)");
#ifdef PAGEDGEN_AMX_INT8_BUILD
    TORCH_CHECK(request_tile_permission(), "int8_linear_amx: Linux refused the AMX tile state "
                "(arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) failed)");
#else
    TORCH_CHECK(false, "int8_linear_amx: the CPU kernels loaded were built without AMX-INT8 (a lower level forced by "
                "PAGEDGEN_CPU_ISA, or a build without the amx level; pagedgen.ops.cpu_isa() names the level)");
#endif
  };
#ifdef PAGEDGEN_AMX_INT8_BUILD
  amx::int8_linear_tiles<AmxTiles<true>>("int8_linear_amx", out, input, weight, weight_scale, input_scale, bias, ready);
#else
  int8_gemm::check("int8_linear_amx", out, input, weight, weight_scale, input_scale, bias);
  ready();
#endif
}
#endif  // __AVX2__

}  // namespace
}  // namespace pagedgen::cpu

TORCH_LIBRARY_IMPL(pagedgen, CPU, m) {
  m.impl("packed_linear_bf16_amx", &pagedgen::cpu::packed_linear_bf16_amx_cpu);
#if defined(__AVX2__)
  m.impl("int8_linear_amx", &pagedgen::cpu::int8_linear_amx_cpu);
#endif
}
