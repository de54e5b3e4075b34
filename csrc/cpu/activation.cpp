// CPU kernel of pagedgen::silu_and_mul (schema in csrc/ops.cpp, oracle in
// pagedgen/ops/reference.py): the SwiGLU gate of Llama's MLP, out = silu(gate) * up for input rows
// [gate | up], as transformers computes act_fn(gate_proj(x)) * up_proj(x): silu(x) = x / (1 + exp(-x))
// in float32, rounded to the model dtype, then multiplied by up in the model dtype. exp is
// attention_math.h's vectorisable exp_approx (relative error < 1e-8, below float32's half ulp of
// 6e-8 in most cases), where torch uses SLEEF's: results agree to an ulp.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

#include "attention_math.h"  // exp_approx

namespace pagedgen::cpu {
namespace {

// out[0:d] = to_dtype(silu(gate[0:d])) * up[0:d], with up = gate + d.
template <typename scalar_t>
inline void silu_and_mul_row(const scalar_t* gate, scalar_t* out, int64_t d) {
  const scalar_t* up = gate + d;
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) {
    const float g = static_cast<float>(gate[i]);
    const scalar_t act = static_cast<scalar_t>(g / (1.0f + exp_approx(-g)));
    out[i] = static_cast<scalar_t>(static_cast<float>(act) * static_cast<float>(up[i]));
  }
}

void silu_and_mul_cpu(const at::Tensor& out,     // [num_tokens, d]
                      const at::Tensor& input) {  // [num_tokens, 2 * d]: gate, then up
  TORCH_CHECK(out.device().is_cpu() && input.device().is_cpu(), "silu_and_mul (CPU kernel): tensors must be on the CPU");
  TORCH_CHECK(input.dim() == 2 && input.size(1) % 2 == 0 && input.stride(1) == 1,
              "silu_and_mul: input must be [num_tokens, 2 * d] with contiguous rows, got ", input.sizes());
  TORCH_CHECK(input.scalar_type() == at::kFloat || input.scalar_type() == at::kBFloat16 || input.scalar_type() == at::kHalf,
              "silu_and_mul: dtype must be float32, bfloat16 or float16, got ", input.scalar_type());
  const int64_t T = input.size(0), d = input.size(1) / 2;
  TORCH_CHECK(out.dim() == 2 && out.size(0) == T && out.size(1) == d && out.stride(1) == 1 &&
                  out.scalar_type() == input.scalar_type(),
              "silu_and_mul: out must be ", input.scalar_type(), " [", T, ", ", d, "], got ", out.scalar_type(), " ",
              out.sizes());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "silu_and_mul_cpu", [&] {
    const scalar_t* x = input.const_data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const int64_t xs = input.stride(0), os = out.stride(0);
    at::parallel_for(0, T, std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(d, 1)), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        silu_and_mul_row(x + t * xs, o + t * os, d);
      }
    });
  });
}

}  // namespace
}  // namespace pagedgen::cpu

TORCH_LIBRARY_IMPL(pagedgen, CPU, m) { m.impl("silu_and_mul", &pagedgen::cpu::silu_and_mul_cpu); }
