// CPU kernel of pagedgen::silu_and_mul (schema in csrc/ops.cpp, oracle in
// pagedgen/ops/reference.py): the SwiGLU gate of Llama's MLP, out = silu(gate) * up for input rows
// [gate | up], as transformers computes act_fn(gate_proj(x)) * up_proj(x): silu(x) = x / (1 + exp(-x))
// in float32, rounded to the model dtype, then multiplied by up in the model dtype. exp is vec.h's
// (within an ulp or two of the correctly rounded value) where torch uses SLEEF's: results agree to an
// ulp of the output dtype.
//
// Every dtype runs the same vector code (csrc/cpu/vec.h): kLanes elements at a time, bf16/fp16
// converted on the load and rounded on the store; a row's tail is a zero-padded vector. Each row's
// result depends only on that row (batch invariance).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

#include "../op_checks.h"
#include "vec.h"

namespace pagedgen::cpu {
namespace {

// Elements per parallel chunk, at least. An element costs an exp and a division (~4 cycles here,
// about four times a norm's), so a second thread pays from ~8K elements: on the AVX2 EPYC a
// [256, 2 x 172] input (stories260K's decode batch) took 59-73 us on one thread and 35-47 us on two,
// [64, 2 x 172] 19-23 -> 13-17 us (the norms, at 1 << 16, gained nothing from a lower grain).
constexpr int64_t kGrain = int64_t{1} << 13;

template <typename scalar_t>
inline Vec<W> silu_mul(const Vec<W>& g, const Vec<W>& up) {
  const Vec<W> act = round_to<scalar_t, W>(g / (1.0f + exp<W>(-g)));
  return act * up;
}

// out[0:d] = to_dtype(silu(gate[0:d])) * up[0:d], with up = gate + d.
template <typename scalar_t>
inline void silu_and_mul_row(const scalar_t* gate, scalar_t* out, int64_t d) {
  const scalar_t* up = gate + d;
  int64_t i = 0;
  // two vectors per step: their dependency chains (exp's polynomial, the division) interleave
  for (; i + 2 * W <= d; i += 2 * W) {
    const Vec<W> a = silu_mul<scalar_t>(load<W>(gate + i), load<W>(up + i));
    const Vec<W> b = silu_mul<scalar_t>(load<W>(gate + i + W), load<W>(up + i + W));
    store<W>(out + i, a);
    store<W>(out + i + W, b);
  }
  for (; i + W <= d; i += W) store<W>(out + i, silu_mul<scalar_t>(load<W>(gate + i), load<W>(up + i)));
  if (i < d) {
    const int m = static_cast<int>(d - i);
    store_partial<W>(out + i, silu_mul<scalar_t>(load_partial<W>(gate + i, m), load_partial<W>(up + i, m)), m);
  }
}

void silu_and_mul_cpu(const at::Tensor& out,     // [num_tokens, d]
                      const at::Tensor& input) {  // [num_tokens, 2 * d]: gate, then up
  TORCH_CHECK(out.device().is_cpu() && input.device().is_cpu(), "silu_and_mul (CPU kernel): tensors must be on the CPU");
  TORCH_CHECK(input.dim() == 2 && input.size(1) % 2 == 0 && input.stride(1) == 1,
              "silu_and_mul: input must be [num_tokens, 2 * d] with contiguous rows, got ", input.sizes());
  const int64_t T = input.size(0), d = input.size(1) / 2;
  TORCH_CHECK(out.dim() == 2 && out.size(0) == T && out.size(1) == d && out.stride(1) == 1 &&
                  out.scalar_type() == input.scalar_type(),
              "silu_and_mul: out must be ", input.scalar_type(), " [", T, ", ", d, "], got ", out.scalar_type(), " ",
              out.sizes());
  checks::writable_output("silu_and_mul", "out", out, {{"input", &input}});
  if (T == 0 || d == 0) return;
  dispatch_float_types(input.scalar_type(), "silu_and_mul", [&](auto zero) {
    using scalar_t = decltype(zero);
    const scalar_t* x = input.const_data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const int64_t xs = input.stride(0), os = out.stride(0);
    at::parallel_for(0, T, std::max<int64_t>(1, kGrain / d), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) silu_and_mul_row(x + t * xs, o + t * os, d);
    });
  });
}

}  // namespace
}  // namespace pagedgen::cpu

TORCH_LIBRARY_IMPL(pagedgen, CPU, m) { m.impl("silu_and_mul", &pagedgen::cpu::silu_and_mul_cpu); }
