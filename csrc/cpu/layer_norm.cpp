// CPU kernel of pagedgen::fused_add_layer_norm (schema in csrc/ops.cpp, oracle in
// pagedgen/ops/reference.py): the residual add and the LayerNorm (Ba et al. 2016) after it, in one
// pass over each row's cache lines instead of three ATen ops (add, then layer_norm's moments and its
// affine pass): BERT's post-LN `LayerNorm(dense(h) + residual)` and the pre-LN decoders' (OPT,
// GPT-2, GPT-NeoX) `norm(residual + x)`, vLLM's fused_add_rms_norm convention:
//   residual <- input + residual, rounded to the model dtype (torch's add);
//   input    <- (residual - mean) * rstd * weight + bias, computed in float32, rounded once.
// Statistics in float32 as F.layer_norm's CPU kernel keeps them: the mean of the rounded sum, then
// the (biased) variance around that mean, rstd = 1 / sqrt(max(var, 0) + eps); the output is
// (x * rstd + (-mean * rstd)) * weight + bias, torch's form. torch sums with Welford's cascade
// (RowwiseMoments) where this kernel takes two passes (sum, then sum of squared deviations, each a
// W-lane vector accumulator reduced by vec.h's fixed tree), so the two agree to a few float32 ulps,
// not bitwise (tests/ops/test_layer_norm.py states the bound).
//
// A row's arithmetic depends only on its own elements and length (batch invariance, tested bitwise);
// rows run in parallel (at::parallel_for) in chunks of at least kLayerNormGrain elements.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "../op_checks.h"
#include "vec.h"

namespace pagedgen::cpu {
namespace {

constexpr int64_t kLayerNormGrain = 1 << 16;  // elements per parallel chunk, at least (as norm.cpp's)

void check_layer_norm_args(const at::Tensor& input, const at::Tensor& residual, const c10::optional<at::Tensor>& weight,
                           const c10::optional<at::Tensor>& bias) {
  constexpr const char* op = "fused_add_layer_norm";
  TORCH_CHECK(input.dim() == 2 && input.stride(1) == 1, op, ": input must be [num_tokens, hidden] with contiguous rows, got ",
              input.sizes(), " strides ", input.strides());
  TORCH_CHECK(residual.sizes() == input.sizes() && residual.stride(1) == 1, op, ": residual must be ", input.sizes(),
              " with contiguous rows, got ", residual.sizes(), " strides ", residual.strides());
  TORCH_CHECK(weight.has_value() == bias.has_value(), op, ": weight and bias must be given together or both be None");
  const auto dtype = input.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op,
              ": dtype must be float32, bfloat16 or float16, got ", dtype);
  TORCH_CHECK(residual.scalar_type() == dtype, op, ": residual dtype ", residual.scalar_type(), " != input dtype ", dtype);
  for (const auto* p : {&weight, &bias}) {
    if (!p->has_value()) continue;
    const at::Tensor& t = **p;
    const char* name = p == &weight ? "weight" : "bias";
    TORCH_CHECK(t.dim() == 1 && t.size(0) == input.size(1) && t.is_contiguous(), op, ": ", name, " must be [",
                input.size(1), "] contiguous, got ", t.sizes());
    TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " dtype ", t.scalar_type(), " != input dtype ", dtype);
    TORCH_CHECK(t.device().is_cpu(), op, " (CPU kernel): ", name, " must be on the CPU");
  }
  TORCH_CHECK(input.device().is_cpu() && residual.device().is_cpu(), op, " (CPU kernel): tensors must be on the CPU");
  checks::writable_output(op, "input", input, {{"residual", &residual}});
  if (weight.has_value()) {
    checks::writable_output(op, "input", input, {{"weight", &*weight}, {"bias", &*bias}});
    checks::writable_output(op, "residual", residual, {{"weight", &*weight}, {"bias", &*bias}});
  } else {
    checks::writable_output(op, "residual", residual, {});
  }
}

// residual[0:n] <- x + residual rounded to scalar_t; x[0:n] <- LayerNorm(residual). w, b: null for none.
template <typename scalar_t>
inline void add_layer_norm_row(scalar_t* x, scalar_t* res, const scalar_t* w, const scalar_t* b, int64_t n, float eps) {
  const int64_t full = n / W * W;
  const int tail = static_cast<int>(n - full);
  // pass 1: the sum, stored rounded (the add's result), and its total
  Vec<W> acc = splat<W>(0.0f);
  for (int64_t i = 0; i < full; i += W) {
    const Vec<W> s = round_to<scalar_t, W>(load<W>(x + i) + load<W>(res + i));
    store<W>(res + i, s);
    acc += s;
  }
  if (tail) {
    const Vec<W> s = round_to<scalar_t, W>(load_partial<W>(x + full, tail) + load_partial<W>(res + full, tail));
    store_partial<W>(res + full, s, tail);
    acc += s;  // the padding lanes are 0
  }
  const float mean = hsum<W>(acc) / static_cast<float>(n);
  // pass 2: the variance around the mean (the row is in L1)
  const Vec<W> mv = splat<W>(mean);
  Vec<W> sq = splat<W>(0.0f);
  for (int64_t i = 0; i < full; i += W) {
    const Vec<W> d = load<W>(res + i) - mv;
    sq += d * d;
  }
  float var_sum = hsum<W>(sq);
  for (int64_t i = full; i < n; ++i) {  // the tail lane by lane: a padding lane would add mean^2
    const float d = static_cast<float>(res[i]) - mean;
    var_sum += d * d;
  }
  const float var = std::max(var_sum / static_cast<float>(n), 0.0f);
  const float rstd = 1.0f / std::sqrt(var + eps);
  const Vec<W> scale = splat<W>(rstd), shift = splat<W>(-mean * rstd);
  // pass 3: the affine output, rounded once
  const auto normed = [&](const Vec<W>& s, int64_t i, int m) {
    Vec<W> y = s * scale + shift;
    if (w != nullptr) {
      y = m == W ? y * load<W>(w + i) + load<W>(b + i) : y * load_partial<W>(w + i, m) + load_partial<W>(b + i, m);
    }
    return y;
  };
  for (int64_t i = 0; i < full; i += W) store<W>(x + i, normed(load<W>(res + i), i, W));
  if (tail) store_partial<W>(x + full, normed(load_partial<W>(res + full, tail), full, tail), tail);
}

void fused_add_layer_norm_cpu(const at::Tensor& input,     // [num_tokens, hidden], becomes the norm
                              const at::Tensor& residual,  // [num_tokens, hidden], becomes input + residual
                              const c10::optional<at::Tensor>& weight,  // [hidden] or None
                              const c10::optional<at::Tensor>& bias,    // [hidden] or None
                              double epsilon) {
  check_layer_norm_args(input, residual, weight, bias);
  TORCH_CHECK(epsilon >= 0.0 && std::isfinite(epsilon), "fused_add_layer_norm: epsilon must be finite and >= 0, got ",
              epsilon);
  const int64_t rows = input.size(0), n = input.size(1);
  if (rows == 0 || n == 0) return;
  dispatch_float_types(input.scalar_type(), "fused_add_layer_norm", [&](auto zero) {
    using scalar_t = decltype(zero);
    scalar_t* x = input.data_ptr<scalar_t>();
    scalar_t* res = residual.data_ptr<scalar_t>();
    const scalar_t* w = weight.has_value() ? weight->const_data_ptr<scalar_t>() : nullptr;
    const scalar_t* b = bias.has_value() ? bias->const_data_ptr<scalar_t>() : nullptr;
    const int64_t xs = input.stride(0), rs = residual.stride(0);
    const float eps = static_cast<float>(epsilon);
    at::parallel_for(0, rows, std::max<int64_t>(1, kLayerNormGrain / n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) add_layer_norm_row(x + r * xs, res + r * rs, w, b, n, eps);
    });
  });
}

}  // namespace
}  // namespace pagedgen::cpu

TORCH_LIBRARY_IMPL(pagedgen, CPU, m) { m.impl("fused_add_layer_norm", &pagedgen::cpu::fused_add_layer_norm_cpu); }
