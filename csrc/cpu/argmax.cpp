// CPU kernel of pagedgen::argmax (schema in csrc/ops.cpp, oracle in pagedgen/ops/reference.py): the
// greedy token of each row of logits, exactly torch's logits.max(dim=-1).indices (= torch.argmax):
// the first index of the maximum; -0.0 == +0.0 (the first of them wins); a row holding a NaN gives
// the index of its first NaN; a row of -inf gives 0.
//
// One pass over a row in blocks of kUnroll kLanes-wide vectors (csrc/cpu/vec.h; bf16/fp16 become
// float32 on the load, which is exact and keeps the order). Lane j of the running maximum sees the
// elements j, j + kLanes, ...: a block's lane maximum replaces it only when strictly greater, and
// `at` keeps the start of that block, so each lane knows the first block holding its largest value.
// At the end, the row's maximum is the largest lane value, and its first index the smallest of the
// first positions where a lane reaching it holds it in its block (read again: at most kUnroll
// elements per lane). Starting from (-inf, block 0) is right for a row of -inf. -0.0 == +0.0 in every
// comparison, so whichever zero comes first wins. NaN compares false and would never win: the pass
// also ORs an x != x mask, and a row with a NaN is scanned again for its first one. The row's last,
// partial block is padded with -inf, which never wins. Each row's result depends only on that row
// (batch invariance).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "vec.h"

namespace pagedgen::cpu {
namespace {

constexpr int kUnroll = 4;            // vectors per block (update() below is written for 4)
constexpr int kBlock = kUnroll * W;  // elements per block
static_assert(kUnroll == 4);

// The first index of the maximum of x[0:n] (NaN the maximum, as torch), n >= 1.
template <typename scalar_t>
int64_t argmax_row(const scalar_t* x, int64_t n) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  IVec<W> lane;
  for (int j = 0; j < W; ++j) lane[j] = j;
  Vec<W> best = splat<W>(neg_inf);  // lane j: the largest element of the lane so far
  IVec<W> at = {};                  // lane j: the start of the first block holding it
  IVec<W> nan = {};                 // lanes that saw a NaN
  auto update = [&](const Vec<W>* v, int64_t start) {  // v[0:kUnroll]: the block at x + start
    nan |= (v[0] != v[0]) | (v[1] != v[1]) | (v[2] != v[2]) | (v[3] != v[3]);
    const Vec<W> block_max = vmax<W>(vmax<W>(v[0], v[1]), vmax<W>(v[2], v[3]));
    const IVec<W> greater = block_max > best;
    best = greater ? block_max : best;
    at = greater ? IVec<W>{} + static_cast<int32_t>(start) : at;
  };
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    Vec<W> v[kUnroll];
#pragma GCC unroll 4
    for (int u = 0; u < kUnroll; ++u) v[u] = load<W>(x + i + u * W);
    update(v, i);
  }
  if (i < n) {  // the row's last, partial block, padded with -inf
    Vec<W> v[kUnroll];
    for (int u = 0; u < kUnroll; ++u) {
      const int m = static_cast<int>(std::clamp<int64_t>(n - i - u * W, 0, W));
      v[u] = m == W ? load<W>(x + i + u * W) : m == 0 ? splat<W>(neg_inf) : load_partial<W>(x + i + u * W, m);
      v[u] = lane < m ? v[u] : splat<W>(neg_inf);
    }
    update(v, i);
  }
  bool any_nan = false;
  for (int j = 0; j < W; ++j) any_nan |= nan[j] != 0;
  if (any_nan) {
    for (int64_t k = 0; k < n; ++k) {
      const float v = static_cast<float>(x[k]);
      if (v != v) return k;
    }
  }
  // The row's maximum first occurs, in each lane that reached it, in that lane's block `at`; the
  // answer is the smallest of those indices.
  const float max_value = hmax<W>(best);
  int64_t index = n;
  for (int j = 0; j < W; ++j) {
    if (best[j] != max_value) continue;
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t k = static_cast<int64_t>(at[j]) + u * W + j;
      if (k < n && static_cast<float>(x[k]) == max_value) {
        index = std::min(index, k);
        break;
      }
    }
  }
  return index;
}

void argmax_cpu(const at::Tensor& out,      // [num_rows] int64
                const at::Tensor& logits) {  // [num_rows, vocab], any row stride
  TORCH_CHECK(out.device().is_cpu() && logits.device().is_cpu(), "argmax (CPU kernel): tensors must be on the CPU");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) >= 1 && logits.stride(1) == 1,
              "argmax: logits must be [num_rows, vocab] with vocab >= 1 and contiguous rows, got ", logits.sizes(),
              " with strides ", logits.strides());
  const int64_t N = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V <= std::numeric_limits<int32_t>::max(), "argmax: vocab must be below 2^31, got ", V);
  TORCH_CHECK(out.dim() == 1 && out.size(0) == N && out.scalar_type() == at::kLong,
              "argmax: out must be int64 [", N, "], got ", out.scalar_type(), " ", out.sizes());
  dispatch_float_types(logits.scalar_type(), "argmax", [&](auto zero) {
    using scalar_t = decltype(zero);
    if (N == 0) return;
    const scalar_t* x = logits.const_data_ptr<scalar_t>();
    int64_t* o = out.data_ptr<int64_t>();
    const int64_t xs = logits.stride(0), os = out.stride(0);
    at::parallel_for(0, N, std::max<int64_t>(1, (int64_t{1} << 16) / V), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) o[t * os] = argmax_row(x + t * xs, V);
    });
  });
}

}  // namespace
}  // namespace pagedgen::cpu

TORCH_LIBRARY_IMPL(pagedgen, CPU, m) { m.impl("argmax", &pagedgen::cpu::argmax_cpu); }
