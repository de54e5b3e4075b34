// CPU kernels of pagedgen::rms_norm and pagedgen::fused_add_rms_norm (schemas in csrc/ops.cpp,
// oracles in pagedgen/ops/reference.py).
//
// Numerics are transformers' LlamaRMSNorm step by step: statistics in float32 (squares, their mean
// as sum / hidden, rsqrt as 1 / sqrt), the normalised row rounded to the model dtype, then multiplied
// by the weight in the model dtype. The sum of squares adds them in the order of torch's own CPU sum
// (torch_order_sum_of_squares below, with the vector width torch's sum is measured to use here:
// torch_sum_lanes), so the result is bitwise the reference's in every dtype (unless torch's sum
// matches neither order, as on a DEFAULT-capability build; then the two agree to an ulp or two).
//
// Every dtype runs the same vector code (csrc/cpu/vec.h): bf16/fp16 rows are converted to float
// kLanes elements at a time and rounded back on the store, with no per-element scalar conversion.
// A row's arithmetic depends only on its own elements and length, never on the other rows or on
// how rows are split between threads (batch invariance). One row per token; rows run in parallel
// only when there are enough of them to pay for waking threads (large prefill batches).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "../op_checks.h"
#include "vec.h"

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

// torch's row_sum (aten/src/ATen/native/cpu/SumKernel.cpp) of `size` values item(0) .. item(size - 1)
// of type Acc (float or a vector of floats): four interleaved chains (ilp 4) over rows of four items,
// whose rows are summed in a cascade of up to four levels of 2^level_power rows each (multi_row_sum),
// the leftover items into chain 0, then chains 1-3 into chain 0.
template <typename Acc, typename Item>
inline Acc torch_row_sum(const Item& item, int64_t size) {
  const int64_t rows = size / 4;
  int64_t ceil_log2 = 1;  // torch's utils::CeilLog2(rows)
  if (rows > 2) ceil_log2 = 64 - __builtin_clzll(static_cast<uint64_t>(rows - 1));
  const int64_t level_power = std::max<int64_t>(4, ceil_log2 / 4), level_step = int64_t{1} << level_power;
  Acc acc[4][4] = {};  // [level][chain]
  int64_t i = 0;
  while (i + level_step <= rows) {
    for (int64_t j = 0; j < level_step; ++j, ++i) {
      for (int k = 0; k < 4; ++k) acc[0][k] += item(i * 4 + k);
    }
    for (int level = 1; level < 4; ++level) {
      for (int k = 0; k < 4; ++k) {
        acc[level][k] += acc[level - 1][k];
        acc[level - 1][k] = Acc{};
      }
      if ((i & ((level_step - 1) << (level * level_power))) != 0) break;
    }
  }
  for (; i < rows; ++i) {
    for (int k = 0; k < 4; ++k) acc[0][k] += item(i * 4 + k);
  }
  for (int level = 1; level < 4; ++level) {
    for (int k = 0; k < 4; ++k) acc[0][k] += acc[level][k];
  }
  Acc chain = acc[0][0];
  for (int64_t v = rows * 4; v < size; ++v) chain += item(v);
  for (int k = 1; k < 4; ++k) chain += acc[0][k];
  return chain;
}

// sum_i x[i]^2 (each square rounded to float) in the order of torch's CPU sum of a contiguous float
// row (cascade_sum) whose vectors have V lanes: rows of at least V elements as vectors
// (vectorized_inner_sum: the vectors' torch_row_sum, then the scalar tail from 0, then the lanes one
// by one); shorter rows element by element (scalar_inner_sum).
template <int V, typename scalar_t>
inline float torch_order_sum_of_squares(const scalar_t* x, int64_t n) {
  const auto square = [&](int64_t e) {
    const float v = static_cast<float>(x[e]);
    return v * v;
  };
  if (n < V) return torch_row_sum<float>(square, n);
  const int64_t vec_size = n / V;
  const Vec<V> chain = torch_row_sum<Vec<V>>([&](int64_t i) {
    const Vec<V> v = load<V>(x + i * V);
    return v * v;
  }, vec_size);
  float sum = 0.0f;
  for (int64_t e = vec_size * V; e < n; ++e) sum += square(e);
  for (int lane = 0; lane < V; ++lane) sum += chain[lane];
  return sum;
}

// The lanes of the vectors torch's own CPU sum uses here: 16 or 8. It is not always this build's
// width: on a Xeon with AMX, torch 2.14.1's AVX-512 build reduces with 8-lane vectors (measured),
// while on an AVX-512 AMD EPYC the 16-lane order matched torch bitwise (this file's tests passed
// there with it). So it is measured once,
// on first use: the sum of squares of a fixed 1,000-element row by torch (as the reference computes
// it: pow(2) then sum over the row) against this file's sum in each order. A torch that matches
// neither (a DEFAULT-capability build) gets this build's width; the two then agree to an ulp or two.
int torch_sum_lanes() {
  static const int lanes = [] {
    constexpr int64_t n = 1000;
    std::vector<float> row(n);
    uint32_t state = 12345u;
    for (auto& v : row) {  // values spread over six binades, so that each order rounds differently
      state = state * 1664525u + 1013904223u;
      v = std::ldexp(static_cast<float>(state >> 8) / 16777216.0f, static_cast<int>(state % 6));
    }
    const float expected = at::from_blob(row.data(), {1, n}, at::kFloat).pow(2).sum(-1).item<float>();
#if defined(__AVX512F__)
    if (torch_order_sum_of_squares<16>(row.data(), n) == expected) return 16;
#endif
    if (torch_order_sum_of_squares<8>(row.data(), n) == expected) return 8;
    return kLanes >= 16 ? 16 : 8;
  }();
  return lanes;
}

template <typename scalar_t>
inline float sum_of_squares(const scalar_t* x, int64_t n, int lanes) {
#if defined(__AVX512F__)
  if (lanes == 16) return torch_order_sum_of_squares<16>(x, n);
#endif
  return torch_order_sum_of_squares<8>(x, n);
}

// out[0:n] = weight * to_dtype(x * rsqrt(mean(x^2) + eps)), x as float. out may be x.
template <typename scalar_t>
inline void norm_row(const scalar_t* x, const scalar_t* weight, scalar_t* out, int64_t n, float eps, int lanes) {
  const float sum = sum_of_squares(x, n, lanes);
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  int64_t i = 0;
  const auto normed = [&](const Vec<W>& xv, const Vec<W>& wv) { return wv * round_to<scalar_t, W>(xv * inv); };
  for (; i + W <= n; i += W) store<W>(out + i, normed(load<W>(x + i), load<W>(weight + i)));
  if (i < n) {
    const int m = static_cast<int>(n - i);
    store_partial<W>(out + i, normed(load_partial<W>(x + i, m), load_partial<W>(weight + i, m)), m);
  }
}

// residual[0:n] += x[0:n], rounded to the model dtype.
template <typename scalar_t>
inline void add_row(scalar_t* residual, const scalar_t* x, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) store<W>(residual + i, load<W>(residual + i) + load<W>(x + i));
  if (i < n) {
    const int m = static_cast<int>(n - i);
    store_partial<W>(residual + i, load_partial<W>(residual + i, m) + load_partial<W>(x + i, m), m);
  }
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
  checks::writable_output("rms_norm", "out", out, {{"input", &input}, {"weight", &weight}});
  const int64_t rows = input.size(0), n = input.size(1);
  if (rows == 0 || n == 0) return;
  const int lanes = torch_sum_lanes();
  dispatch_float_types(input.scalar_type(), "rms_norm", [&](auto zero) {
    using scalar_t = decltype(zero);
    const scalar_t* x = input.const_data_ptr<scalar_t>();
    const scalar_t* w = weight.const_data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const int64_t xs = input.stride(0), os = out.stride(0);
    at::parallel_for(0, rows, std::max<int64_t>(1, kRowsGrain / n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) norm_row(x + r * xs, w, o + r * os, n, static_cast<float>(epsilon), lanes);
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
  checks::writable_output("fused_add_rms_norm", "input", input, {{"residual", &residual}, {"weight", &weight}});
  checks::writable_output("fused_add_rms_norm", "residual", residual, {{"weight", &weight}});
  const int64_t rows = input.size(0), n = input.size(1);
  if (rows == 0 || n == 0) return;
  const int lanes = torch_sum_lanes();
  dispatch_float_types(input.scalar_type(), "fused_add_rms_norm", [&](auto zero) {
    using scalar_t = decltype(zero);
    scalar_t* x = input.data_ptr<scalar_t>();
    scalar_t* res = residual.data_ptr<scalar_t>();
    const scalar_t* w = weight.const_data_ptr<scalar_t>();
    const int64_t xs = input.stride(0), rs = residual.stride(0);
    at::parallel_for(0, rows, std::max<int64_t>(1, kRowsGrain / n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* xr = x + r * xs;
        scalar_t* rr = res + r * rs;
        add_row(rr, xr, n);  // the row stays in L1 for the norm's two passes
        norm_row(rr, w, xr, n, static_cast<float>(epsilon), lanes);
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
