// The CPU kernels of one instruction-set level, as one compilation unit: every csrc/cpu/*.cpp but
// attention.cpp (compiled as a second unit, in parallel: it is the largest) and the argument checks.
// setup.py compiles these two units once per level (CPU_LEVELS) into pagedgen._C_cpu_<level>.
//
// Why one unit: each file alone spends most of its compile time parsing the same torch headers
// (ATen.h), and a wheel compiles every file three times; one unit parses them once per level. The
// files keep their own anonymous namespaces, so names private to one file must differ from the
// others' (linear_avx512.cpp has its own namespace for that). tests/project/test_build_units.py
// checks that every kernel file is compiled exactly once.
#include "op_checks.cpp"

#include "cpu/activation.cpp"
#include "cpu/argmax.cpp"
#include "cpu/cache.cpp"
#include "cpu/kv_dequantize.cpp"
#include "cpu/kv_quantize.cpp"
#include "cpu/layer_norm.cpp"
#include "cpu/linear.cpp"
#include "cpu/linear_amx.cpp"
#include "cpu/linear_amx_emulated.cpp"
#include "cpu/linear_avx512.cpp"
#include "cpu/linear_fp8.cpp"
#include "cpu/linear_int4.cpp"
#include "cpu/linear_int8.cpp"
#include "cpu/logprobs.cpp"
#include "cpu/lora.cpp"
#include "cpu/module.cpp"
#include "cpu/norm.cpp"
#include "cpu/rotary.cpp"
#include "cpu/varlen_attention.cpp"
