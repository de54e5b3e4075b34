// CPU kernel of pagedgen::varlen_attention (schema in csrc/ops.cpp, oracle in
// pagedgen/ops/reference.py): bidirectional (non-causal) attention over packed sequences of any
// lengths, the encoders' attention (pagedgen/model/bert.py; issue 49).
//
//   out [T, H, D] = softmax(q k^T * scale) v, per sequence: rows cu_seqlens[s] .. cu_seqlens[s + 1] - 1
//   of query, key, value [T, H or Hkv, D] are sequence s, and each of its rows attends to all of them.
//
// No padding and no gathers: query, key and value are read through their strides (in the encoder,
// views of the fused qkv projection's output [T, 3 H D]), fp32 key/value rows in place, bf16/fp16 ones
// converted to float once per item and tile. The arithmetic is paged attention's general path
// (attention_math.h): key tiles of kTile tokens aligned to the sequence's first token, one
// online-softmax step per tile, everything in float32, the output rounded once to the dtype.
//
// Work items: (sequence, block of up to kItemRows query rows), each with all KV heads (one after the
// other, each with the query heads of its GQA group), or with one KV head each when there are too few
// blocks to share out. An item reads its sequence's K/V rows once per tile for all its (row, head)
// pairs of one KV head. A row's value is one fixed sequence of operations of its query and its
// sequence's keys and values (the tile boundaries depend on the sequence alone; score_rows and
// score_transposed_rows give the same bits): it does not depend on the other sequences of the call,
// their order, the items or the number of threads (tests/ops/test_varlen_attention.py checks it
// bitwise). Items are shared out to the threads in runs of about equal work (one run a thread), so
// a step of many short sentences (10-60 tokens) pays one parallel region a call, not one an item.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <vector>

#include "../op_checks.h"
#include "attention_general.h"  // Params, load_query, store_output, kTransposedPairs; attention_math.h

namespace pagedgen::cpu {
namespace varlen {

constexpr int64_t kItemRows = 64;                     // query rows per item, at most
constexpr int64_t kMinWorkPerThread = int64_t{1} << 16;  // multiply-adds that pay for waking a thread

// The arguments of one call. `p` holds the query and out pointers, strides and the scale (what
// load_query and store_output read; its cache fields are unused).
template <typename scalar_t>
struct Args {
  Params<scalar_t> p;
  const scalar_t* key;    // [T, Hkv, D], strides k_s*
  const scalar_t* value;  // [T, Hkv, D], strides v_s*
  int64_t k_s0, k_s1, k_s2, v_s0, v_s1, v_s2;
};

// One work item: rows [row, row + rows) of the sequence whose tokens are [start, start + len), KV
// heads [kv_begin, kv_end).
struct Item {
  int64_t start, len, row, kv_begin, kv_end;
  int rows;
};

// Floats of scratch an item of `pairs` (row, query head) pairs needs.
inline int64_t scratch_floats(int64_t pairs, int64_t D) {
  return 2 * pairs * D + 2 * pairs + pairs * kTile + 3 * kTile * D + 2 * kLanes * kTile;
}

// The tile's rows of one KV head as float rows rows[0:n]: a float row with unit stride in place, any
// other one converted (or gathered through its stride) into buf[j * D].
template <typename scalar_t>
inline void tile_rows(const scalar_t* base, int64_t s0, int64_t s2, int n, int D, float* buf, const float** rows) {
  for (int j = 0; j < n; ++j) {
    const scalar_t* src = base + j * s0;
    if constexpr (std::is_same_v<scalar_t, float>) {
      if (s2 == 1) {
        rows[j] = src;
        continue;
      }
    }
    float* dst = buf + j * D;
    if (s2 == 1) {
      to_float(src, dst, D);
    } else {
      for (int d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d * s2]);
    }
    rows[j] = dst;
  }
}

// Attention of one item's (row, query head) pairs of KV head kv over its whole sequence.
template <typename scalar_t, int kHeadSize>
void attend_head(const Args<scalar_t>& a, const Item& it, int64_t kv, float* scratch) {
  const int D = kHeadSize > 0 ? kHeadSize : static_cast<int>(a.p.head_size);
  const int G = static_cast<int>(a.p.group), P = it.rows * G;  // pairs: row i, head g at i * G + g
  float* q = scratch;            // [P, D] scaled queries
  float* acc = q + P * D;        // [P, D] un-normalised outputs
  float* m = acc + P * D;        // [P] running max of the scores
  float* l = m + P;              // [P] running sum of exp(score - m)
  float* sc = l + P;             // [P, kTile] scores, then weights, of the current tile
  float* kbuf = sc + P * kTile;  // [kTile, D] the tile's K rows as float (unless read in place)
  float* vbuf = kbuf + kTile * D;
  float* kt = vbuf + kTile * D;  // [D, kTile] the tile's K rows transposed
  float* part = kt + kTile * D;  // [2 * kLanes * kTile] score_transposed_rows' lane chains
  const float* krows[kTile];
  const float* vrows[kTile];
  const int64_t h0 = kv * G;  // the group's first query head
  for (int i = 0; i < it.rows; ++i) load_query(a.p, it.row + i, h0, G, D, q + i * G * D, m + i * G, l + i * G);
  std::fill(acc, acc + P * D, 0.0f);
  for (int64_t t0 = 0; t0 < it.len; t0 += kTile) {
    const int ub = static_cast<int>(std::min<int64_t>(kTile, it.len - t0));  // every row attends to slots [0, ub)
    const int64_t token = it.start + t0;
    tile_rows(a.key + token * a.k_s0 + kv * a.k_s1, a.k_s0, a.k_s2, ub, D, kbuf, krows);
    tile_rows(a.value + token * a.v_s0 + kv * a.v_s1, a.v_s0, a.v_s2, ub, D, vbuf, vrows);
    if constexpr (kHeadSize > 0 && kHeadSize % kLanes == 0) {
      // many pairs share a tile that is more than half full: scores of the whole tile from its
      // transpose (the same bits as score_rows, which scores only the slots [0, ub))
      if (P >= kTransposedPairs && 2 * ub > kTile) {
        transpose_full_tile<kHeadSize>(krows, 0, ub, kt);
        score_transposed_rows<kHeadSize>(q, P, kt, sc, part);
      } else {
        score_rows<kHeadSize>(q, P, krows, 0, ub, sc);
      }
    } else if constexpr (kHeadSize > 0) {
      score_rows<kHeadSize>(q, P, krows, 0, ub, sc);
    } else {
      score_rows_runtime(q, P, D, krows, 0, ub, sc);
    }
    for (int h = 0; h < P; ++h) {
      const float alpha = softmax_tile(sc + h * kTile, 0, ub, m[h], l[h]);  // scores -> weights
      rescale(acc + h * D, D, alpha);
    }
    if constexpr (kHeadSize > 0) {  // acc[h] += sum_j w[h, j] * v[j]
      accumulate_heads<kHeadSize>(acc, P, sc, vrows, 0, ub);
    } else {
      for (int h = 0; h < P; ++h) accumulate_tile_runtime(acc + h * D, D, sc + h * kTile, vrows, 0, ub);
    }
  }
  for (int i = 0; i < it.rows; ++i) store_output(a.p, it.row + i, h0, G, D, acc + i * G * D, l + i * G, true);
}

// An item's attention, KV head after KV head.
template <typename scalar_t, int kHeadSize>
void attend_item(const Args<scalar_t>& a, const Item& it, float* scratch) {
  for (int64_t kv = it.kv_begin; kv < it.kv_end; ++kv) attend_head<scalar_t, kHeadSize>(a, it, kv, scratch);
}

// The items of the call, sequence after sequence, row block after row block (and KV head after KV
// head when there are few blocks), and the work of each (~ multiply-adds: rows x (len + 8) x heads x D).
template <typename scalar_t, int kHeadSize>
void attend_all(const Args<scalar_t>& a, const int32_t* cu, int64_t num_seqs) {
  const int64_t Hkv = a.p.num_kv_heads, threads = std::max(1, at::get_num_threads());
  int64_t blocks = 0;
  for (int64_t s = 0; s < num_seqs; ++s) blocks += (cu[s + 1] - cu[s] + kItemRows - 1) / kItemRows;
  const int64_t per_item = blocks >= 4 * threads ? Hkv : 1;  // KV heads an item
  std::vector<Item> items;
  std::vector<int64_t> done;  // done[i]: the work of items [0, i]
  items.reserve(blocks * (Hkv / per_item));
  done.reserve(blocks * (Hkv / per_item));
  int64_t work = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t start = cu[s], len = cu[s + 1] - cu[s];
    for (int64_t r = 0; r < len; r += kItemRows) {
      const int rows = static_cast<int>(std::min(kItemRows, len - r));
      for (int64_t kv = 0; kv < Hkv; kv += per_item) {
        items.push_back({start, len, start + r, kv, kv + per_item, rows});
        work += rows * (len + 8) * per_item * a.p.group * a.p.head_size;
        done.push_back(work);
      }
    }
  }
  if (items.empty()) return;
  // One run of items of about equal work per thread (fewer for a small call).
  const int64_t runs = std::clamp<int64_t>(work / kMinWorkPerThread, 1, threads);
  const int64_t max_pairs = std::min<int64_t>(kItemRows, cu[num_seqs]) * a.p.group;
  const int64_t floats = scratch_floats(max_pairs, a.p.head_size);
  const int64_t num_items = static_cast<int64_t>(items.size());
  at::parallel_for(0, runs, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> scratch(floats);
    // items [first, last): those whose work ends in (r0 / runs, r1 / runs] of the total
    const auto item_at = [&](int64_t r) {
      if (r == runs) return num_items;
      return static_cast<int64_t>(std::upper_bound(done.begin(), done.end(), work * r / runs) - done.begin());
    };
    const int64_t first = r0 == 0 ? 0 : item_at(r0), last = item_at(r1);
    for (int64_t i = first; i < last; ++i) {
      attend_item<scalar_t, kHeadSize>(a, items[i], scratch.data());
    }
  });
}

// Every argument's metadata and cu_seqlens' values, before any pointer is read. Returns the number
// of sequences.
int64_t check_args(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                   const at::Tensor& cu_seqlens, double scale) {
  const char* op = "varlen_attention";
  TORCH_CHECK(query.dim() == 3, op, ": query must be [num_tokens, num_heads, head_size], got ", query.sizes());
  TORCH_CHECK(out.sizes() == query.sizes(), op, ": out ", out.sizes(), " must match query ", query.sizes());
  TORCH_CHECK(key.dim() == 3 && key.size(0) == query.size(0) && key.size(2) == query.size(2), op,
              ": key must be [num_tokens=", query.size(0), ", num_kv_heads, head_size=", query.size(2), "], got ",
              key.sizes());
  TORCH_CHECK(value.sizes() == key.sizes(), op, ": value ", value.sizes(), " must match key ", key.sizes());
  const int64_t T = query.size(0), H = query.size(1), D = query.size(2), Hkv = key.size(1);
  TORCH_CHECK(D > 0, op, ": head_size must be positive, got ", D);
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, op, ": num_heads (", H, ") must be a multiple of num_kv_heads (", Hkv, ")");
  TORCH_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.size(0) >= 1, op, ": cu_seqlens must be [num_seqs + 1], got ",
              cu_seqlens.sizes());
  const at::ScalarType dtype = query.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op,
              ": query dtype must be float32, bfloat16 or float16, got ", dtype);
  TORCH_CHECK(out.scalar_type() == dtype && key.scalar_type() == dtype && value.scalar_type() == dtype, op,
              ": out, query, key and value must share one dtype, got ", out.scalar_type(), ", ", dtype, ", ",
              key.scalar_type(), ", ", value.scalar_type());
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kInt, op, ": cu_seqlens must be int32, got ", cu_seqlens.scalar_type());
  TORCH_CHECK(std::isfinite(scale), op, ": scale must be finite, got ", scale);
  TORCH_CHECK(T < INT_MAX && H < INT_MAX && D < INT_MAX, op, ": sizes out of range ", query.sizes());
  for (const at::Tensor* t : {&out, &query, &key, &value, &cu_seqlens}) {
    TORCH_CHECK(t->device().is_cpu(), op, " (CPU kernel): every tensor must be on the CPU, got ", t->device());
  }
  checks::writable_output(op, "out", out, {{"query", &query}, {"key", &key}, {"value", &value}, {"cu_seqlens", &cu_seqlens}});
  // the values: 0, then non-decreasing, up to num_tokens
  const int64_t num_seqs = cu_seqlens.size(0) - 1;
  const at::Tensor cu_t = cu_seqlens.contiguous();
  const int32_t* cu = cu_t.const_data_ptr<int32_t>();
  TORCH_CHECK(cu[0] == 0 && cu[num_seqs] == T, op, ": cu_seqlens must run from 0 to num_tokens=", T, ", got ", cu[0],
              " .. ", cu[num_seqs]);
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(cu[s + 1] >= cu[s], op, ": cu_seqlens must not decrease, got ", cu[s], " then ", cu[s + 1],
                " at sequence ", s);
  }
  return num_seqs;
}

void varlen_attention_cpu(const at::Tensor& out,         // [num_tokens, num_heads, head_size]
                          const at::Tensor& query,       // [num_tokens, num_heads, head_size]
                          const at::Tensor& key,         // [num_tokens, num_kv_heads, head_size]
                          const at::Tensor& value,       // [num_tokens, num_kv_heads, head_size]
                          const at::Tensor& cu_seqlens,  // [num_seqs + 1] int32
                          double scale) {
  const int64_t num_seqs = check_args(out, query, key, value, cu_seqlens, scale);
  if (query.numel() == 0) return;
  const at::Tensor cu_t = cu_seqlens.contiguous();
  dispatch_float_types(query.scalar_type(), "varlen_attention", [&](auto zero) {
    using scalar_t = decltype(zero);
    Args<scalar_t> a;
    Params<scalar_t>& p = a.p;
    p.out = out.data_ptr<scalar_t>();
    p.query = query.const_data_ptr<scalar_t>();
    p.key_cache = p.value_cache = nullptr;
    p.block_tables = nullptr;
    p.out_s0 = out.stride(0), p.out_s1 = out.stride(1), p.out_s2 = out.stride(2);
    p.q_s0 = query.stride(0), p.q_s1 = query.stride(1), p.q_s2 = query.stride(2);
    p.bt_s0 = p.bt_s1 = 0;
    p.num_heads = query.size(1), p.num_kv_heads = key.size(1), p.head_size = query.size(2);
    p.group = p.num_heads / p.num_kv_heads, p.block_size = 0, p.num_blocks = 0, p.sliding_window = 0;
    p.scale = static_cast<float>(scale);
    a.key = key.const_data_ptr<scalar_t>(), a.value = value.const_data_ptr<scalar_t>();
    a.k_s0 = key.stride(0), a.k_s1 = key.stride(1), a.k_s2 = key.stride(2);
    a.v_s0 = value.stride(0), a.v_s1 = value.stride(1), a.v_s2 = value.stride(2);
    const int32_t* cu = cu_t.const_data_ptr<int32_t>();
    switch (p.head_size) {
      case 32: return attend_all<scalar_t, 32>(a, cu, num_seqs);
      case 64: return attend_all<scalar_t, 64>(a, cu, num_seqs);
      case 128: return attend_all<scalar_t, 128>(a, cu, num_seqs);
      default: return attend_all<scalar_t, 0>(a, cu, num_seqs);  // run-time loop bounds
    }
  });
}

}  // namespace varlen
}  // namespace pagedgen::cpu

TORCH_LIBRARY_IMPL(pagedgen, CPU, m) { m.impl("varlen_attention", &pagedgen::cpu::varlen::varlen_attention_cpu); }
