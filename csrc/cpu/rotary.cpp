// CPU kernel of pagedgen::rotary_embedding (schema in csrc/ops.cpp, oracle in
// pagedgen/ops/reference.py): rotary position embedding (RoFormer, Su et al. 2021) of query and key,
// in place, in the rotate-half form of transformers' Llama (apply_rotary_pos_emb):
//     x * cos + rotate_half(x) * sin,   rotate_half(x) = cat(-x[D/2:], x[:D/2])
// with cos and sin rows [head_size] of float32 tables indexed by position, converted to the model
// dtype first. Each product and the sum are rounded to the model dtype as torch does it, and the
// extension is compiled without floating-point contraction (no fused multiply-add, setup.py), so that
// the result is bitwise that of the PyTorch reference in every dtype.
//
// Vectorised over the half-rows: the first and second halves of a head are two runs of D/2 elements,
// taken W = 16, 8 or 4 at a time (the widest that fits in D/2 and the build's registers; a zero-padded
// vector for a tail), converted to float on the load and rounded on the store (csrc/cpu/vec.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace pagedgen::cpu {
namespace {

// One step of W elements of a head: x1 = x[i:i+W] (first half), x2 = x[i+half:...] (second half);
// c1/s1 and c2/s2 the matching cos/sin elements (c, s: the position's rows already rounded to the
// model dtype, round_row). Returns the two rotated runs through r1, r2.
template <typename scalar_t, int W>
inline void rotate_step(const Vec<W>& x1, const Vec<W>& x2, const float* c, const float* s, int64_t half,
                        int64_t i, int m, Vec<W>& r1, Vec<W>& r2) {
  const auto table = [&](const float* p) { return m == W ? load<W>(p) : load_partial<W>(p, m); };
  const Vec<W> c1 = table(c + i), s1 = table(s + i), c2 = table(c + i + half), s2 = table(s + i + half);
  // rotate_half(x) = (-x2, x1); negation is exact, so (-x2) * s1 rounds as torch's product does
  r1 = round_to<scalar_t, W>(x1 * c1) + round_to<scalar_t, W>(-x2 * s1);
  r2 = round_to<scalar_t, W>(x2 * c2) + round_to<scalar_t, W>(x1 * s2);
}

// dst[0:n] = src[0:n] rounded to scalar_t, as float: the cos or sin row of a position in the model dtype
// (as the reference converts them before multiplying), once per token for all its heads.
template <typename scalar_t, int W>
inline void round_row(const float* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) store<W>(dst + i, round_to<scalar_t, W>(load<W>(src + i)));
  if (i < n) {
    const int m = static_cast<int>(n - i);
    store_partial<W>(dst + i, round_to<scalar_t, W>(load_partial<W>(src + i, m)), m);
  }
}

// x: one head's row [2 * half] (contiguous), rotated in place; c, s: the position's cos and sin rows
// in the model dtype (as float).
template <typename scalar_t, int W>
inline void rotate_head(scalar_t* x, const float* c, const float* s, int64_t half) {
  int64_t i = 0;
  Vec<W> r1, r2;
  for (; i + W <= half; i += W) {
    rotate_step<scalar_t, W>(load<W>(x + i), load<W>(x + i + half), c, s, half, i, W, r1, r2);
    store<W>(x + i, r1);
    store<W>(x + i + half, r2);
  }
  if (i < half) {
    const int m = static_cast<int>(half - i);
    rotate_step<scalar_t, W>(load_partial<W>(x + i, m), load_partial<W>(x + i + half, m), c, s, half, i, m, r1, r2);
    store_partial<W>(x + i, r1, m);
    store_partial<W>(x + i + half, r2, m);
  }
}

void check_heads(const at::Tensor& x, const char* name, int64_t num_tokens, int64_t head_size) {
  TORCH_CHECK(x.device().is_cpu(), "rotary_embedding (CPU kernel): ", name, " must be on the CPU, got ", x.device());
  TORCH_CHECK(x.dim() == 3 && x.size(0) == num_tokens && x.size(2) == head_size && x.stride(2) == 1,
              "rotary_embedding: ", name, " must be [num_tokens=", num_tokens, ", heads, head_size=", head_size,
              "] with contiguous heads, got ", x.sizes(), " strides ", x.strides());
}

void rotary_embedding_cpu(const at::Tensor& positions,  // [num_tokens] int64
                          const at::Tensor& query,      // [num_tokens, num_heads, head_size], in place
                          const at::Tensor& key,        // [num_tokens, num_kv_heads, head_size], in place
                          const at::Tensor& cos,        // [max_positions, head_size] float32
                          const at::Tensor& sin) {      // [max_positions, head_size] float32
  TORCH_CHECK(positions.device().is_cpu() && cos.device().is_cpu() && sin.device().is_cpu(),
              "rotary_embedding (CPU kernel): positions, cos and sin must be on the CPU");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1,
              "rotary_embedding: positions must be int64 [num_tokens], got ", positions.scalar_type(), " ",
              positions.sizes());
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.dim() == 2 && cos.is_contiguous() && sin.sizes() == cos.sizes() &&
                  sin.scalar_type() == at::kFloat && sin.is_contiguous(),
              "rotary_embedding: cos and sin must be contiguous float32 [max_positions, head_size], got ", cos.sizes(),
              " and ", sin.sizes());
  const int64_t T = positions.size(0), D = cos.size(1), max_pos = cos.size(0);
  TORCH_CHECK(D % 2 == 0, "rotary_embedding: head_size must be even, got ", D);
  check_heads(query, "query", T, D);
  check_heads(key, "key", T, D);
  TORCH_CHECK(key.scalar_type() == query.scalar_type(), "rotary_embedding: key dtype ", key.scalar_type(),
              " != query dtype ", query.scalar_type());
  const at::Tensor pos = positions.contiguous();
  const int64_t* p = pos.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(p[t] >= 0 && p[t] < max_pos, "rotary_embedding: positions[", t, "] = ", p[t], " is outside [0, ",
                max_pos, ")");
  }
  if (T == 0 || D == 0) return;
  const float* c = cos.const_data_ptr<float>();
  const float* s = sin.const_data_ptr<float>();
  const int64_t half = D / 2, heads = query.size(1) + key.size(1);
  dispatch_float_types(query.scalar_type(), "rotary_embedding", [&](auto zero) {
    using scalar_t = decltype(zero);
    scalar_t* q = query.data_ptr<scalar_t>();
    scalar_t* k = key.data_ptr<scalar_t>();
    const int64_t qs0 = query.stride(0), qs1 = query.stride(1), ks0 = key.stride(0), ks1 = key.stride(1);
    const int64_t Hq = query.size(1), Hk = key.size(1);
    auto rows = [&](auto width, int64_t begin, int64_t end) {  // width: std::integral_constant, the W
      constexpr int W = decltype(width)::value;
      std::vector<float> rounded(std::is_same_v<scalar_t, float> ? 0 : 2 * D);  // [2, D] this token's cos, sin
      for (int64_t t = begin; t < end; ++t) {
        const float* ct = c + p[t] * D;
        const float* st = s + p[t] * D;
        if constexpr (!std::is_same_v<scalar_t, float>) {
          round_row<scalar_t, W>(ct, rounded.data(), D);
          round_row<scalar_t, W>(st, rounded.data() + D, D);
          ct = rounded.data(), st = rounded.data() + D;
        }
        for (int64_t h = 0; h < Hq; ++h) rotate_head<scalar_t, W>(q + t * qs0 + h * qs1, ct, st, half);
        for (int64_t h = 0; h < Hk; ++h) rotate_head<scalar_t, W>(k + t * ks0 + h * ks1, ct, st, half);
      }
    };
    at::parallel_for(0, T, std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(heads * D, 1)),
                     [&](int64_t begin, int64_t end) {
                       if (kLanes >= 16 && half >= 16) return rows(std::integral_constant<int, std::min(kLanes, 16)>(), begin, end);
                       if (kLanes >= 8 && half >= 8) return rows(std::integral_constant<int, std::min(kLanes, 8)>(), begin, end);
                       return rows(std::integral_constant<int, 4>(), begin, end);
                     });
  });
}

}  // namespace
}  // namespace pagedgen::cpu

TORCH_LIBRARY_IMPL(pagedgen, CPU, m) { m.impl("rotary_embedding", &pagedgen::cpu::rotary_embedding_cpu); }
