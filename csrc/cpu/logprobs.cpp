// CPU kernel of pagedgen::logprob_topk (schema in csrc/ops.cpp, argument checks in csrc/op_checks.cpp,
// oracle pagedgen/ops/reference.py::logprob_topk): what vLLM's logprobs need of each row of raw logits,
// in two passes over the row instead of the reference's five (a float32 copy, logsumexp, the rank
// count, topk, the candidates' nonzero), bf16/fp16 read in place (converted to float32 on the load,
// exact). For row r with chosen token t = token_ids[r] and x = logits[r] as float32:
//   out[r, 0]             t
//   out[r, 1]             x[t] - lse, lse = log(sum(exp(x))) (float32 subtraction, as the reference)
//   out[r, 2]             the rank of t: the number of x[j] >= x[t] (1 for the most likely)
//   out[r, 3 : 3 + k]     the k largest x[j] - lse, by value descending, ties by lowest token id
//   out[r, 3 + k : ]      their token ids
//
// Pass 1, in blocks of kUnroll kLanes-wide vectors (csrc/cpu/vec.h): the running maximum, the count of
// x >= x[t] (an int32 per lane), a NaN flag, and the top k in a sorted buffer of at most 20
// (value, id) entries, filled first with the row's first k entries. A block whose vectors hold no
// element strictly above the buffer's smallest value is skipped with one compare per vector; an
// element equal to it loses, since every entry already held has a lower id (so ties go to the lowest
// id, the reference's order). Elements are offered to the buffer in id order, one at a time.
// Pass 2: sum of exp(x - max) (vec.h's exp, within an ulp or two), each lane summing in float32 over
// a chunk of kChunkBlocks blocks, the chunks' lane sums added in float64 and the lanes combined in a
// fixed tree: the order depends only on the row's length, so a row's bits are the same whatever the
// other rows (batch invariance) and on any number of threads. lse = log(sum) + max in float64,
// rounded once to float32 (torch rounds log(sum) and the add each to float32: the two differ by an
// ulp or so). As torch's logsumexp, an infinite maximum is not subtracted: a row holding +inf has
// lse = +inf, a row of -inf lse = -inf (both without pass 2).
// A row holding a NaN (rare: a broken model) is redone by a scalar loop: lse NaN, NaN ranked above
// every number in the top k (as torch.topk), NaNs among themselves by id; its rank count stands.
// The row's last, partial block is padded with -inf (never above the buffer's threshold, exp 0),
// and its count only counts the row's own lanes.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "../op_checks.h"
#include "vec.h"

namespace pagedgen::cpu::logprob {
namespace {

constexpr int kUnroll = 4;           // vectors per block (the loops below are written for 4)
constexpr int kBlock = kUnroll * W;  // elements per block
constexpr int kChunkBlocks = 16;     // blocks each float32 lane sum covers before the float64 add
static_assert(kUnroll == 4);
constexpr float kInf = std::numeric_limits<float>::infinity();

typedef double DVec __attribute__((vector_size(W * sizeof(double))));  // W float64 lanes

// True when any lane of the mask m (lanes 0 or -1) is set.
PAGEDGEN_ALWAYS_INLINE bool any_lane(const IVec<W>& m) {
#if defined(__AVX512F__)
  if constexpr (W == 16) {
    const __m512i v = reinterpret_cast<const __m512i&>(m);
    return _mm512_test_epi32_mask(v, v) != 0;
  }
#endif
#if defined(__AVX__)
  if constexpr (W == 8) {
    const __m256i v = reinterpret_cast<const __m256i&>(m);
    return !_mm256_testz_si256(v, v);
  }
#endif
  int32_t r = 0;
  for (int j = 0; j < W; ++j) r |= m[j];
  return r != 0;
}

// a ranks above b in the top k: NaN above any number (torch.topk's order), otherwise a > b.
inline bool ranks_above(float a, float b) { return a != a ? b == b : a > b; }

// The k largest elements offered so far (ties: the first offered), sorted by rank; ids are offered
// in increasing order, so an element equal to an entry goes after it.
struct TopK {
  int k = 0, size = 0;
  float value[checks::kMaxLogprobTopK];
  int32_t id[checks::kMaxLogprobTopK];

  void offer(float x, int32_t i) {
    int p;
    if (size < k) {
      p = size++;
    } else if (k > 0 && ranks_above(x, value[k - 1])) {
      p = k - 1;
    } else {
      return;
    }
    for (; p > 0 && ranks_above(x, value[p - 1]); --p) {
      value[p] = value[p - 1];
      id[p] = id[p - 1];
    }
    value[p] = x;
    id[p] = i;
  }
  // Below this, an element cannot enter a full buffer (+inf when k == 0: nothing enters).
  float threshold() const { return k == 0 ? kInf : value[k - 1]; }
};

struct Scan {
  float max;
  int64_t rank;
  bool nan;
};

// Pass 1 over x[0:n] (n >= 1): max, count of x >= chosen, NaN flag; the top k into `top` (k <= n).
template <typename scalar_t>
Scan scan_row(const scalar_t* x, int64_t n, float chosen, TopK& top) {
  for (int i = 0; i < top.k; ++i) top.offer(static_cast<float>(x[i]), i);
  IVec<W> lane;
  for (int j = 0; j < W; ++j) lane[j] = j;
  const Vec<W> c = splat<W>(chosen);
  Vec<W> best = splat<W>(-kInf);
  Vec<W> t = splat<W>(top.threshold());
  IVec<W> count = {}, nan = {};
  // v[0:kUnroll]: the block at x + start; `valid`: its lanes inside the row (all but in the last block)
  auto block = [&](const Vec<W>* v, int64_t start, const IVec<W>* valid) {
    nan |= (v[0] != v[0]) | (v[1] != v[1]) | (v[2] != v[2]) | (v[3] != v[3]);
    best = vmax<W>(best, vmax<W>(vmax<W>(v[0], v[1]), vmax<W>(v[2], v[3])));
    if (valid == nullptr) {
      count -= ((v[0] >= c) + (v[1] >= c)) + ((v[2] >= c) + (v[3] >= c));  // lanes: 0 or -1 each
    } else {
      for (int u = 0; u < kUnroll; ++u) count -= (v[u] >= c) & valid[u];
    }
    if (__builtin_expect(any_lane((v[0] > t) | (v[1] > t) | (v[2] > t) | (v[3] > t)), 0)) {
      for (int u = 0; u < kUnroll; ++u) {
        for (int j = 0; j < W; ++j) {
          const int64_t i = start + u * W + j;
          if (i >= top.k && i < n) top.offer(v[u][j], static_cast<int32_t>(i));
        }
      }
      t = splat<W>(top.threshold());
    }
  };
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    Vec<W> v[kUnroll];
#pragma GCC unroll 4
    for (int u = 0; u < kUnroll; ++u) v[u] = load<W>(x + i + u * W);
    block(v, i, nullptr);
  }
  if (i < n) {  // the last, partial block, padded with -inf
    Vec<W> v[kUnroll];
    IVec<W> valid[kUnroll];
    for (int u = 0; u < kUnroll; ++u) {
      const int m = static_cast<int>(std::clamp<int64_t>(n - i - u * W, 0, W));
      v[u] = m == W ? load<W>(x + i + u * W) : m == 0 ? splat<W>(-kInf) : load_partial<W>(x + i + u * W, m);
      valid[u] = lane < m;
      v[u] = valid[u] ? v[u] : splat<W>(-kInf);
    }
    block(v, i, valid);
  }
  int64_t rank = 0;
  bool any_nan = false;
  for (int j = 0; j < W; ++j) {
    rank += count[j];
    any_nan |= nan[j] != 0;
  }
  return {hmax<W>(best), rank, any_nan};
}

// Pass 2: sum of exp(x[j] - max) over x[0:n] in float64, for a finite row maximum `max` (every
// exponent <= 0). The order of the additions depends only on n (see the top of the file).
template <typename scalar_t>
double exp_sum(const scalar_t* x, int64_t n, float max) {
  const Vec<W> m = splat<W>(max);
  DVec total = {};
  int64_t i = 0;
  while (i < n) {
    const int64_t end = std::min<int64_t>(n, i + int64_t{kChunkBlocks} * kBlock);
    Vec<W> part[kUnroll] = {};
    for (; i + kBlock <= end; i += kBlock) {
#pragma GCC unroll 4
      for (int u = 0; u < kUnroll; ++u) part[u] += exp_nonpositive<W>(load<W>(x + i + u * W) - m);
    }
    if (i < end) {  // the row's last, partial block: lanes past the row add exp(-inf) = 0
      IVec<W> lane;
      for (int j = 0; j < W; ++j) lane[j] = j;
      for (int u = 0; u < kUnroll; ++u) {
        const int r = static_cast<int>(std::clamp<int64_t>(n - i - u * W, 0, W));
        Vec<W> v = r == W ? load<W>(x + i + u * W) : r == 0 ? splat<W>(-kInf) : load_partial<W>(x + i + u * W, r);
        v = lane < r ? v : splat<W>(-kInf);
        part[u] += exp_nonpositive<W>(v - m);
      }
      i = end;
    }
    total += __builtin_convertvector((part[0] + part[1]) + (part[2] + part[3]), DVec);
  }
  double lanes[W];
  for (int j = 0; j < W; ++j) lanes[j] = total[j];
  for (int width = W / 2; width >= 1; width /= 2) {  // fixed tree: lane j += lane j + width
    for (int j = 0; j < width; ++j) lanes[j] += lanes[j + width];
  }
  return lanes[0];
}

// The row with a NaN: the top k again by a scalar loop, NaN first (as torch.topk).
template <typename scalar_t>
void nan_row_topk(const scalar_t* x, int64_t n, TopK& top) {
  top.size = 0;
  for (int64_t i = 0; i < n; ++i) top.offer(static_cast<float>(x[i]), static_cast<int32_t>(i));
}

template <typename scalar_t>
void logprob_row(const scalar_t* x, int64_t n, int64_t token, int k, double* out) {
  const float chosen = static_cast<float>(x[token]);
  TopK top;
  top.k = k;
  const Scan s = scan_row(x, n, chosen, top);
  float lse;
  if (s.nan) {
    nan_row_topk(x, n, top);
    lse = std::numeric_limits<float>::quiet_NaN();
  } else if (std::isinf(s.max)) {  // torch's logsumexp: log(sum(exp(x))) without a shift: +inf or -inf
    lse = s.max;
  } else {
    lse = static_cast<float>(std::log(exp_sum(x, n, s.max)) + static_cast<double>(s.max));
  }
  out[0] = static_cast<double>(token);
  out[1] = static_cast<double>(chosen - lse);
  out[2] = static_cast<double>(s.rank);
  for (int j = 0; j < k; ++j) {
    out[3 + j] = static_cast<double>(top.value[j] - lse);
    out[3 + k + j] = static_cast<double>(top.id[j]);
  }
}

void logprob_topk_cpu(const at::Tensor& out,        // [R, 3 + 2 * k_max] float64
                      const at::Tensor& logits,     // [R, V] float32 / bfloat16 / float16, rows contiguous
                      const at::Tensor& token_ids,  // [R] int64, each in [0, V)
                      int64_t k_max) {
  checks::logprob_topk(out, logits, token_ids, k_max, c10::DeviceType::CPU);
  const int64_t R = logits.size(0), V = logits.size(1);
  const int64_t* ids = token_ids.const_data_ptr<int64_t>();
  const int64_t ids_stride = token_ids.stride(0);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = ids[r * ids_stride];
    TORCH_CHECK(t >= 0 && t < V, "logprob_topk: token_ids[", r, "] = ", t, " is outside [0, ", V, ")");
  }
  dispatch_float_types(logits.scalar_type(), "logprob_topk", [&](auto zero) {
    using scalar_t = decltype(zero);
    if (R == 0) return;
    const scalar_t* x = logits.const_data_ptr<scalar_t>();
    double* o = out.data_ptr<double>();
    const int64_t xs = logits.stride(0), os = out.stride(0);
    const int k = static_cast<int>(k_max);
    at::parallel_for(0, R, std::max<int64_t>(1, (int64_t{1} << 14) / V), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) logprob_row(x + r * xs, V, ids[r * ids_stride], k, o + r * os);
    });
  });
}

}  // namespace
}  // namespace pagedgen::cpu::logprob

TORCH_LIBRARY_IMPL(pagedgen, CPU, m) { m.impl("logprob_topk", &pagedgen::cpu::logprob::logprob_topk_cpu); }
