// What this CPU and its OS let pagedgen's CPU kernels use: pagedgen::cpu_supported_isa and
// pagedgen::cpu_has_amx (schemas in csrc/ops.cpp). Compiled into the baseline module pagedgen._C
// with no -march, so it runs on every x86-64 CPU; pagedgen/ops/isa.py reads it at import to choose
// which build of the CPU kernels to load (pagedgen._C_cpu_<level>, setup.py).
//
// A level is usable when the CPU has every instruction set its compiler flags enable (cpuid) and the
// OS saves the register state those instructions use (XCR0, read with xgetbv):
//   avx2         -march=x86-64-v3: AVX, AVX2, FMA, F16C, BMI1, BMI2, LZCNT, MOVBE; XCR0 SSE + AVX (bits 1-2)
//   avx512_bf16  -march=x86-64-v4 -mavx512bf16 -mavx512vnni: avx2 + AVX512F/DQ/CD/BW/VL, AVX512-VNNI,
//                AVX512-BF16; XCR0 also opmask + ZMM (bits 5-7)
//   amx          avx512_bf16 + AMX-TILE, AMX-BF16, AMX-INT8; XCR0 also XTILECFG + XTILEDATA (bits 17-18).
//                Linux also wants each process to ask for the tile data (arch_prctl), which the AMX
//                kernel does at its first call (csrc/cpu/linear_amx.cpp).
// Sources: Intel SDM vol. 2A (CPUID leaves 1, 7 and 0x80000001), vol. 1 ch. 13 (XCR0); the x86-64
// micro-architecture levels of the System V ABI (x86-64-v3, -v4).
#include <torch/library.h>

#include <cstdint>
#include <string>
#include <vector>

namespace pagedgen {
namespace {

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
struct Regs {
  uint32_t a = 0, b = 0, c = 0, d = 0;
};

Regs cpuid(uint32_t leaf, uint32_t sub) {
  Regs r;
  __asm__ volatile("cpuid" : "=a"(r.a), "=b"(r.b), "=c"(r.c), "=d"(r.d) : "a"(leaf), "c"(sub));
  return r;
}

bool bit(uint32_t word, int i) { return (word >> i) & 1u; }

// The CPU's and the OS's answers, read once.
struct Features {
  bool avx2 = false, avx512_bf16 = false, amx = false;
  bool amx_tiles = false;  // AMX-TILE and AMX-BF16 with the tile state enabled, whatever the rest
  bool amx_int8 = false;   // AMX-TILE and AMX-INT8 with the tile state enabled, whatever the rest

  Features() {
    const uint32_t max_leaf = cpuid(0, 0).a;
    if (max_leaf < 7) return;
    const Regs l1 = cpuid(1, 0);
    if (!bit(l1.c, 27)) return;  // OSXSAVE: xgetbv is available, the OS manages the extended state
    uint32_t xcr0_lo, xcr0_hi;
    __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
    const Regs l7 = cpuid(7, 0);
    const Regs l7s1 = l7.a >= 1 ? cpuid(7, 1) : Regs{};
    const bool lzcnt = cpuid(0x80000000u, 0).a >= 0x80000001u && bit(cpuid(0x80000001u, 0).c, 5);
    const bool os_avx = (xcr0_lo & 0x6u) == 0x6u;                   // XMM and YMM state
    const bool os_avx512 = os_avx && (xcr0_lo & 0xE0u) == 0xE0u;    // opmask, ZMM_Hi256, Hi16_ZMM
    const bool os_tiles = (xcr0_lo & (3u << 17)) == (3u << 17);  // XTILECFG, XTILEDATA
    avx2 = os_avx && bit(l1.c, 28) /*AVX*/ && bit(l1.c, 12) /*FMA*/ && bit(l1.c, 29) /*F16C*/ &&
           bit(l1.c, 22) /*MOVBE*/ && bit(l7.b, 5) /*AVX2*/ && bit(l7.b, 3) /*BMI1*/ && bit(l7.b, 8) /*BMI2*/ && lzcnt;
    avx512_bf16 = avx2 && os_avx512 && bit(l7.b, 16) /*F*/ && bit(l7.b, 17) /*DQ*/ && bit(l7.b, 28) /*CD*/ &&
                  bit(l7.b, 30) /*BW*/ && bit(l7.b, 31) /*VL*/ && bit(l7.c, 11) /*VNNI*/ && bit(l7s1.a, 5) /*BF16*/;
    amx_tiles = os_tiles && bit(l7.d, 24) /*AMX-TILE*/ && bit(l7.d, 22) /*AMX-BF16*/;
    amx_int8 = os_tiles && bit(l7.d, 24) /*AMX-TILE*/ && bit(l7.d, 25) /*AMX-INT8*/;
    amx = avx512_bf16 && amx_tiles && amx_int8;
  }
};

const Features& features() {
  static const Features f;
  return f;
}
#endif

// The levels of CPU kernels this CPU and OS can run, lowest first: a prefix of
// ["avx2", "avx512_bf16", "amx"] (empty on other architectures and on x86-64 CPUs without AVX2).
std::vector<std::string> cpu_supported_isa() {
  std::vector<std::string> levels;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  const Features& f = features();
  if (f.avx2) levels.emplace_back("avx2");
  if (f.avx512_bf16) levels.emplace_back("avx512_bf16");
  if (f.amx) levels.emplace_back("amx");
#endif
  return levels;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define PAGEDGEN_FEATURE(name) features().name
#else
#define PAGEDGEN_FEATURE(name) false
#endif

// True when the CPU has AMX-TILE and AMX-BF16 and the OS enables the tile state (XCR0 bits 17-18).
bool cpu_has_amx() { return PAGEDGEN_FEATURE(amx_tiles); }

// True when the CPU has AMX-TILE and AMX-INT8 and the OS enables the tile state (XCR0 bits 17-18).
bool cpu_has_amx_int8() { return PAGEDGEN_FEATURE(amx_int8); }

}  // namespace
}  // namespace pagedgen

TORCH_LIBRARY_IMPL(pagedgen, CompositeExplicitAutograd, m) {
  m.impl("cpu_supported_isa", &pagedgen::cpu_supported_isa);
  m.impl("cpu_has_amx", &pagedgen::cpu_has_amx);
  m.impl("cpu_has_amx_int8", &pagedgen::cpu_has_amx_int8);
}
