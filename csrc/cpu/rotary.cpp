// CPU kernel of pagedgen::rotary_embedding (schema in csrc/ops.cpp, oracle in
// pagedgen/ops/reference.py): rotary position embedding (RoFormer, Su et al. 2021) of query and key,
// in place, in the rotate-half form of transformers' Llama (apply_rotary_pos_emb):
//     x * cos + rotate_half(x) * sin,   rotate_half(x) = cat(-x[D/2:], x[:D/2])
// with cos and sin rows [head_size] of float32 tables indexed by position, converted to the model
// dtype first. Each product and the sum are rounded to the model dtype as torch does it, and this file
// is compiled without floating-point contraction (no fused multiply-add), so that the result is
// bitwise that of the PyTorch reference.
#pragma GCC optimize("fp-contract=off")

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <type_traits>

namespace pagedgen::cpu {
namespace {

// x: one head's row [2 * half] (contiguous), rotated in place; c, s: the position's cos and sin rows.
// kHalf > 0: half known at compile time (the loop is then one or a few whole vectors).
template <typename scalar_t, int kHalf = 0>
inline void rotate_head(scalar_t* x, const float* c, const float* s, int64_t runtime_half) {
  const int64_t half = kHalf > 0 ? kHalf : runtime_half;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
    // rotate_half(x) = (-x2, x1); negation is exact, so (-x2) * s == -(x2 * s) bitwise
    const scalar_t a1 = static_cast<scalar_t>(x1 * static_cast<float>(static_cast<scalar_t>(c[i])));
    const scalar_t b1 = static_cast<scalar_t>(-x2 * static_cast<float>(static_cast<scalar_t>(s[i])));
    const scalar_t a2 = static_cast<scalar_t>(x2 * static_cast<float>(static_cast<scalar_t>(c[i + half])));
    const scalar_t b2 = static_cast<scalar_t>(x1 * static_cast<float>(static_cast<scalar_t>(s[i + half])));
    x[i] = static_cast<scalar_t>(static_cast<float>(a1) + static_cast<float>(b1));
    x[i + half] = static_cast<scalar_t>(static_cast<float>(a2) + static_cast<float>(b2));
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
  TORCH_CHECK(query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16 ||
                  query.scalar_type() == at::kHalf,
              "rotary_embedding: dtype must be float32, bfloat16 or float16, got ", query.scalar_type());
  TORCH_CHECK(key.scalar_type() == query.scalar_type(), "rotary_embedding: key dtype ", key.scalar_type(),
              " != query dtype ", query.scalar_type());
  const at::Tensor pos = positions.contiguous();
  const int64_t* p = pos.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(p[t] >= 0 && p[t] < max_pos, "rotary_embedding: positions[", t, "] = ", p[t], " is outside [0, ",
                max_pos, ")");
  }
  const float* c = cos.const_data_ptr<float>();
  const float* s = sin.const_data_ptr<float>();
  const int64_t heads = query.size(1) + key.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "rotary_embedding_cpu", [&] {
    scalar_t* q = query.data_ptr<scalar_t>();
    scalar_t* k = key.data_ptr<scalar_t>();
    const int64_t qs0 = query.stride(0), qs1 = query.stride(1), ks0 = key.stride(0), ks1 = key.stride(1);
    const int64_t Hq = query.size(1), Hk = key.size(1);
    at::parallel_for(0, T, std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(heads * D, 1)),
                     [&](int64_t begin, int64_t end) {
                       auto rows = [&](auto half) {  // half: std::integral_constant, 0 = run-time
                         for (int64_t t = begin; t < end; ++t) {
                           const float* ct = c + p[t] * D;
                           const float* st = s + p[t] * D;
                           for (int64_t h = 0; h < Hq; ++h) rotate_head<scalar_t, half>(q + t * qs0 + h * qs1, ct, st, D / 2);
                           for (int64_t h = 0; h < Hk; ++h) rotate_head<scalar_t, half>(k + t * ks0 + h * ks1, ct, st, D / 2);
                         }
                       };
                       switch (D) {
                         case 8: return rows(std::integral_constant<int, 4>());
                         case 16: return rows(std::integral_constant<int, 8>());
                         case 32: return rows(std::integral_constant<int, 16>());
                         case 64: return rows(std::integral_constant<int, 32>());
                         case 128: return rows(std::integral_constant<int, 64>());
                         default: return rows(std::integral_constant<int, 0>());
                       }
                     });
  });
}

}  // namespace
}  // namespace pagedgen::cpu

TORCH_LIBRARY_IMPL(pagedgen, CPU, m) { m.impl("rotary_embedding", &pagedgen::cpu::rotary_embedding_cpu); }
