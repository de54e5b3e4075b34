// The module of one build of the CPU kernels, pagedgen._C_cpu_<level> (setup.py compiles csrc/cpu/*.cpp
// once per instruction-set level, each with its own flags and -DPAGEDGEN_CPU_LEVEL=<level>): a bare
// module init, so that importing it loads the library and runs the CPU kernels' registrations, and
// pagedgen::cpu_kernel_isa (schema in csrc/ops.cpp), which says what this build was compiled for.
// pagedgen/ops/isa.py imports exactly one such module per process, chosen from what the CPU supports
// (csrc/cpu_features.cpp) and PAGEDGEN_CPU_ISA.
#include <Python.h>
#include <torch/library.h>

#include <string>
#include <vector>

#ifndef PAGEDGEN_CPU_LEVEL
#error "PAGEDGEN_CPU_LEVEL (the level's name, e.g. avx2) is set by setup.py"
#endif
#define PAGEDGEN_CAT2(a, b) a##b
#define PAGEDGEN_CAT(a, b) PAGEDGEN_CAT2(a, b)
#define PAGEDGEN_STR2(x) #x
#define PAGEDGEN_STR(x) PAGEDGEN_STR2(x)
#define PAGEDGEN_CPU_MODULE PAGEDGEN_CAT(_C_cpu_, PAGEDGEN_CPU_LEVEL)

namespace pagedgen::cpu {
namespace {

// [level, instruction sets the compiler was allowed to use...], e.g. ["avx2", "avx2", "fma", "f16c"].
std::vector<std::string> cpu_kernel_isa() {
  std::vector<std::string> out{PAGEDGEN_STR(PAGEDGEN_CPU_LEVEL)};
#if defined(__AVX2__)
  out.emplace_back("avx2");
#endif
#if defined(__FMA__)
  out.emplace_back("fma");
#endif
#if defined(__F16C__)
  out.emplace_back("f16c");
#endif
#if defined(__AVX512F__)
  out.emplace_back("avx512f");
#endif
#if defined(__AVX512BF16__)
  out.emplace_back("avx512bf16");
#endif
#if defined(__AVX512VNNI__)
  out.emplace_back("avx512vnni");
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  out.emplace_back("amx_bf16");
#endif
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
  out.emplace_back("amx_int8");
#endif
  return out;
}

}  // namespace
}  // namespace pagedgen::cpu

TORCH_LIBRARY_IMPL(pagedgen, CompositeExplicitAutograd, m) { m.impl("cpu_kernel_isa", &pagedgen::cpu::cpu_kernel_isa); }

#define PAGEDGEN_INIT(name) PAGEDGEN_CAT(PyInit_, name)

extern "C" PyObject* PAGEDGEN_INIT(PAGEDGEN_CPU_MODULE)(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, PAGEDGEN_STR(PAGEDGEN_CPU_MODULE), nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
