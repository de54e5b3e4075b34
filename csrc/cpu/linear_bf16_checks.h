// Argument checks of the bf16-pair GEMMs (pagedgen::packed_linear_bf16 and its AMX variants, schemas
// in csrc/ops.cpp), shared by csrc/cpu/linear_avx512.cpp and csrc/cpu/linear_amx*.cpp: run first, before
// any pointer is read. They check ranks and sizes, dtypes, the strides the kernels assume, the packed
// layout (the weight's shape is its tag: [ceil(N / 16), ceil(K / 2), 16, 2] contiguous) and overlap,
// then return the bias as float32 zero-padded to whole panels (undefined when there is none).
// Header-only, in an anonymous namespace: every translation unit gets its own copy (the AMX one
// includes it before its target pragma, so no code compiled for AMX is shared with the others).
#pragma once

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#include <cstdint>

namespace pagedgen::cpu {
namespace {

constexpr int64_t kPairPanel = 16;  // outputs per panel of the bf16-pair layout

// Checks out [M, N], input [M, K], weight [P, Q, 16, 2], bias [N] (float32 / bf16 / fp16) or None for
// op `name`; returns the float32 bias padded to P * 16 (or an undefined tensor).
inline at::Tensor check_packed_linear_bf16(const char* name, const at::Tensor& out, const at::Tensor& input,
                                           const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(out.device().is_cpu() && input.device().is_cpu() && weight.device().is_cpu(),
              name, " (CPU kernel): tensors must be on the CPU");
  TORCH_CHECK(input.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              name, ": input and weight must be bfloat16, got ", input.scalar_type(), " and ", weight.scalar_type());
  TORCH_CHECK(input.dim() == 2 && input.stride(1) == 1,
              name, ": input must be [M, K] with contiguous rows, got ", input.sizes(), " strides ", input.strides());
  const int64_t M = input.size(0), K = input.size(1);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.stride(1) == 1 && (M <= 1 || out.stride(0) >= out.size(1)) &&
                  out.scalar_type() == at::kBFloat16,
              name, ": out must be BFloat16 [", M, ", N] with contiguous, non-overlapping rows, got ",
              out.scalar_type(), " ", out.sizes(), " strides ", out.strides());
  const int64_t N = out.size(1), P = (N + kPairPanel - 1) / kPairPanel, Q = (K + 1) / 2;
  TORCH_CHECK(weight.dim() == 4 && weight.size(0) == P && weight.size(1) == Q && weight.size(2) == kPairPanel &&
                  weight.size(3) == 2 && weight.is_contiguous(),
              name, ": weight must be contiguous pairs [", P, ", ", Q, ", ", kPairPanel, ", 2] for N = ", N,
              " outputs of K = ", K, " inputs, got ", weight.sizes(), " strides ", weight.strides());
  at::assert_no_overlap(out, input);  // out is written while input is read
  at::assert_no_overlap(out, weight);
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    const auto t = bias->scalar_type();
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->device().is_cpu() &&
                    (t == at::kFloat || t == at::kBFloat16 || t == at::kHalf),
                name, ": bias must be float32, bfloat16 or float16 [", N, "] on the CPU, got ", t, " ",
                bias->sizes(), " on ", bias->device());
    b = at::zeros({P * kPairPanel}, input.options().dtype(at::kFloat));
    b.narrow(0, 0, N).copy_(*bias);
  }
  return b;
}

}  // namespace
}  // namespace pagedgen::cpu
