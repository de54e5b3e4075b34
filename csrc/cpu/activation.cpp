// CPU kernels of pagedgen::silu_and_mul and pagedgen::gelu (schemas in csrc/ops.cpp, oracles in
// pagedgen/ops/reference.py).
//
// silu_and_mul: the SwiGLU gate of Llama's MLP, out = silu(gate) * up for input rows
// [gate | up], as transformers computes act_fn(gate_proj(x)) * up_proj(x): silu(x) = x / (1 + exp(-x))
// in float32, rounded to the model dtype, then multiplied by up in the model dtype. exp is vec.h's
// (within an ulp or two of the correctly rounded value) where torch uses SLEEF's: results agree to an
// ulp of the output dtype.
//
// gelu: the exact (erf) GELU of BERT's intermediate (transformers' "gelu", F.gelu), torch's formula
// x * 0.5 * (1 + erf(x / sqrt(2))) in float32, rounded once to the model dtype. erf is erf_vec below
// (within about 2 float32 ulps of the correctly rounded erf); torch uses SLEEF's or oneDNN's, so the
// two agree to a few float32 ulps (an ulp of a bf16/fp16 output).
//
// Every dtype runs the same vector code (csrc/cpu/vec.h): kLanes elements at a time, bf16/fp16
// converted on the load and rounded on the store; a row's tail is a zero-padded vector. Each row's
// result depends only on that row (batch invariance).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
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


// erf(a), lane by lane, branch-free within a vector. Least-squares fits of this file's own (float64
// fits, coefficients rounded to float32; max fit errors 1.3e-9 and 2.5e-8):
//   |a| <= 0.921875:  erf(a) = a + a * P(a^2), P of degree 6;
//   |a| >  0.921875:  erf(|a|) = 1 - exp(Q(|a| - 2.4)), Q of degree 9 fitting log(erfc) on [0.92, 3.93]
//                     (|a| is clamped at 3.925, past which erf rounds to 1 in float32), sign restored.
// Both pieces are computed for every vector (branch-free: the four vectors of gelu_span's step then
// interleave their polynomial chains, which a branch per vector would serialise). NaN stays NaN (it
// takes the first piece); erf(+-inf) = +-1.
// Speed (AVX2 EPYC, 2026-12-07, micro-timing on a quiet 2-core machine): about 2 ns an element on
// one thread, in or out of cache, where torch's F.gelu (oneDNN's, a cheaper erf) takes about 1 ns
// out of cache: so the models do not call this op yet (pagedgen/layers/activation.py keeps F.gelu);
// a cheaper erf of the same accuracy would make it pay.
template <int W>
PAGEDGEN_ALWAYS_INLINE Vec<W> erf_small(const Vec<W>& a) {
  const Vec<W> s = a * a;
  Vec<W> p = splat<W>(8.505488221999258e-05f);
  p = fmadd<W>(p, s, splat<W>(-0.000817539868876338f));
  p = fmadd<W>(p, s, splat<W>(0.005203979555517435f));
  p = fmadd<W>(p, s, splat<W>(-0.026860617101192474f));
  p = fmadd<W>(p, s, splat<W>(0.11283718049526215f));
  p = fmadd<W>(p, s, splat<W>(-0.37612634897232056f));
  p = fmadd<W>(p, s, splat<W>(0.12837916612625122f));
  return fmadd<W>(a, p, a);
}

template <int W>
PAGEDGEN_ALWAYS_INLINE Vec<W> erf_large(const Vec<W>& a, const Vec<W>& t) {  // t = |a|
  const Vec<W> tc = t < splat<W>(3.925f) ? t : splat<W>(3.925f);
  const Vec<W> u = tc - splat<W>(2.4f);
  Vec<W> q = splat<W>(-3.158057992891372e-08f);
  q = fmadd<W>(q, u, splat<W>(1.6598702359260642e-06f));
  q = fmadd<W>(q, u, splat<W>(-1.4436961464525666e-05f));
  q = fmadd<W>(q, u, splat<W>(8.697494922671467e-05f));
  q = fmadd<W>(q, u, splat<W>(-0.00046975421719253063f));
  q = fmadd<W>(q, u, splat<W>(0.002387555781751871f));
  q = fmadd<W>(q, u, splat<W>(-0.011768000200390816f));
  q = fmadd<W>(q, u, splat<W>(-0.9405019283294678f));
  q = fmadd<W>(q, u, splat<W>(-5.164236545562744f));
  q = fmadd<W>(q, u, splat<W>(-7.280974864959717f));
  const UVec<W> sign = bits_of<W>(a) & 0x80000000u;
  return float_of<W>(bits_of<W>(splat<W>(1.0f) - exp<W>(q)) | sign);
}

template <int W>
PAGEDGEN_ALWAYS_INLINE Vec<W> erf_vec(const Vec<W>& a) {
  const Vec<W> t = float_of<W>(bits_of<W>(a) & 0x7FFFFFFFu);  // |a|
  return t > splat<W>(0.921875f) ? erf_large<W>(a, t) : erf_small<W>(a);
}

// to_dtype(x * 0.5 * (1 + erf(x / sqrt(2)))), torch's formula and order of operations.
PAGEDGEN_ALWAYS_INLINE Vec<W> gelu_erf(const Vec<W>& x) {
  return x * splat<W>(0.5f) * (splat<W>(1.0f) + erf_vec<W>(x * splat<W>(0.70710678118654752440f)));
}

// out[0:n] = gelu(x[0:n]); out may be x (each element is read before it is written).
template <typename scalar_t>
inline void gelu_span(const scalar_t* x, scalar_t* out, int64_t n) {
  int64_t i = 0;
  for (; i + 4 * W <= n; i += 4 * W) {  // four independent polynomial chains interleave (latency-bound)
    Vec<W> r[4];
    for (int k = 0; k < 4; ++k) r[k] = gelu_erf(load<W>(x + i + k * W));
    for (int k = 0; k < 4; ++k) store<W>(out + i + k * W, r[k]);
  }
  for (; i + W <= n; i += W) store<W>(out + i, gelu_erf(load<W>(x + i)));
  if (i < n) {
    const int m = static_cast<int>(n - i);
    store_partial<W>(out + i, gelu_erf(load_partial<W>(x + i, m)), m);
  }
}

void gelu_cpu(const at::Tensor& out,     // any shape, contiguous; may be input itself (in place)
              const at::Tensor& input) {  // the same shape and dtype, contiguous
  TORCH_CHECK(out.sizes() == input.sizes(), "gelu: out ", out.sizes(), " must match input ", input.sizes());
  const auto dtype = input.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "gelu: dtype must be float32, bfloat16 or float16, got ", dtype);
  TORCH_CHECK(out.scalar_type() == dtype, "gelu: out dtype ", out.scalar_type(), " != input dtype ", dtype);
  TORCH_CHECK(input.is_contiguous() && out.is_contiguous(), "gelu: input and out must be contiguous, got strides ",
              input.strides(), " and ", out.strides());
  TORCH_CHECK(out.device().is_cpu() && input.device().is_cpu(), "gelu (CPU kernel): tensors must be on the CPU");
  const bool in_place = out.numel() == 0 || out.const_data_ptr() == input.const_data_ptr();
  if (!in_place) checks::writable_output("gelu", "out", out, {{"input", &input}});
  const int64_t n = input.numel();
  if (n == 0) return;
  dispatch_float_types(dtype, "gelu", [&](auto zero) {
    using scalar_t = decltype(zero);
    const scalar_t* x = input.const_data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    // chunks of whole vectors: an element's result does not depend on the split
    at::parallel_for(0, (n + W - 1) / W, std::max<int64_t>(1, kGrain / W), [&](int64_t begin, int64_t end) {
      const int64_t lo = begin * W, hi = std::min(n, end * W);
      gelu_span(x + lo, o + lo, hi - lo);
    });
  });
}

}  // namespace
}  // namespace pagedgen::cpu

TORCH_LIBRARY_IMPL(pagedgen, CPU, m) {
  m.impl("silu_and_mul", &pagedgen::cpu::silu_and_mul_cpu);
  m.impl("gelu", &pagedgen::cpu::gelu_cpu);
}
