// CPU kernels of pagedgen::rms_norm and pagedgen::fused_add_rms_norm (schemas in csrc/ops.cpp,
// oracles in pagedgen/ops/reference.py).
//
// Numerics are transformers' LlamaRMSNorm step by step: statistics in float32 (mean of squares as
// sum / hidden, rsqrt as 1 / sqrt), the normalised row rounded to the model dtype, then multiplied by
// the weight in the model dtype. Only the order of the sum of squares differs from torch's reduction
// (results agree to an ulp or so). One row per token; rows run in parallel only when there are enough
// of them to pay for waking threads (large prefill batches).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

namespace pagedgen::cpu {
namespace {

constexpr int64_t kRowsGrain = 1 << 16;  // elements per parallel chunk, at least (decode batches: one thread)

void check_norm_args(const at::Tensor& x, const at::Tensor& weight, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), op, " (CPU kernel): tensors must be on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, op, ": input must be [num_tokens, hidden] with contiguous rows, got ",
              x.sizes(), " strides ", x.strides());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(), op, ": weight must be [",
              x.size(1), "] contiguous, got ", weight.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf, op,
              ": dtype must be float32, bfloat16 or float16, got ", x.scalar_type());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), op, ": weight dtype ", weight.scalar_type(),
              " != input dtype ", x.scalar_type());
}

// out[0:n] = weight * to_dtype(x * rsqrt(mean(x^2) + eps)), x as float.
template <typename scalar_t>
inline void norm_row(const scalar_t* x, const scalar_t* weight, scalar_t* out, int64_t n, float eps) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    sum += v * v;
  }
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const scalar_t h = static_cast<scalar_t>(static_cast<float>(x[i]) * inv);
    out[i] = static_cast<scalar_t>(static_cast<float>(weight[i]) * static_cast<float>(h));
  }
}

// residual[0:n] += x[0:n], rounded to the model dtype.
template <typename scalar_t>
inline void add_row(scalar_t* residual, const scalar_t* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) residual[i] = static_cast<scalar_t>(static_cast<float>(residual[i]) + static_cast<float>(x[i]));
}

void rms_norm_cpu(const at::Tensor& out,     // [num_tokens, hidden]
                  const at::Tensor& input,   // [num_tokens, hidden]
                  const at::Tensor& weight,  // [hidden]
                  double epsilon) {
  check_norm_args(input, weight, "rms_norm");
  TORCH_CHECK(out.sizes() == input.sizes() && out.scalar_type() == input.scalar_type() && out.stride(1) == 1 &&
                  out.device().is_cpu(),
              "rms_norm: out must match input ", input.scalar_type(), " ", input.sizes(), ", got ", out.scalar_type(),
              " ", out.sizes());
  const int64_t rows = input.size(0), n = input.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "rms_norm_cpu", [&] {
    const scalar_t* x = input.const_data_ptr<scalar_t>();
    const scalar_t* w = weight.const_data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const int64_t xs = input.stride(0), os = out.stride(0);
    at::parallel_for(0, rows, std::max<int64_t>(1, kRowsGrain / std::max<int64_t>(n, 1)), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) norm_row(x + r * xs, w, o + r * os, n, static_cast<float>(epsilon));
    });
  });
}

void fused_add_rms_norm_cpu(const at::Tensor& input,     // [num_tokens, hidden], becomes the norm
                            const at::Tensor& residual,  // [num_tokens, hidden], becomes residual + input
                            const at::Tensor& weight,    // [hidden]
                            double epsilon) {
  check_norm_args(input, weight, "fused_add_rms_norm");
  TORCH_CHECK(residual.sizes() == input.sizes() && residual.scalar_type() == input.scalar_type() &&
                  residual.stride(1) == 1 && residual.device().is_cpu(),
              "fused_add_rms_norm: residual must match input ", input.scalar_type(), " ", input.sizes(), ", got ",
              residual.scalar_type(), " ", residual.sizes());
  const int64_t rows = input.size(0), n = input.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "fused_add_rms_norm_cpu", [&] {
    scalar_t* x = input.data_ptr<scalar_t>();
    scalar_t* res = residual.data_ptr<scalar_t>();
    const scalar_t* w = weight.const_data_ptr<scalar_t>();
    const int64_t xs = input.stride(0), rs = residual.stride(0);
    at::parallel_for(0, rows, std::max<int64_t>(1, kRowsGrain / std::max<int64_t>(n, 1)), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* xr = x + r * xs;
        scalar_t* rr = res + r * rs;
        add_row(rr, xr, n);
        norm_row(rr, w, xr, n, static_cast<float>(epsilon));
      }
    });
  });
}

}  // namespace
}  // namespace pagedgen::cpu

TORCH_LIBRARY_IMPL(pagedgen, CPU, m) {
  m.impl("rms_norm", &pagedgen::cpu::rms_norm_cpu);
  m.impl("fused_add_rms_norm", &pagedgen::cpu::fused_add_rms_norm_cpu);
}
