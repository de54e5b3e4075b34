// The small-head path of the CPU paged attention kernel (csrc/cpu/attention.cpp): head sizes 8 and
// 16 on AVX-512 and AVX2 + FMA builds (one algorithm; the register width W, 16 or 8 floats, is
// small_heads::kTokens). A work item is a block of rows of one sequence (one row in decode, up to R
// rows of a prompt chunk in prefill, all the rows of a short sequence such as a speculative verify
// step's k + 1: kSmallShortHeads in attention.cpp) with all query heads of KV heads [kv_begin,
// kv_end) at once.
//
// Scores come from W x W register transposes of the K rows of those heads (each K element is loaded
// and transposed once per item, however many rows and heads share it, attention_small_heads.h);
// softmax is the general path's, per (row, query head), over tiles of kSmallTile tokens aligned to
// absolute positions (with 8-16 multiply-adds per token and head, the per-tile bookkeeping would cost
// as much as the tile itself at kTile); the V accumulation runs per (row, KV head) for all the query
// heads that share it, over the V rows converted once per item. Each row uses the slots of a tile
// that it attends to and nothing else, computed by the same operations whatever the item's other
// rows are: prefill chunks of any size and decode give a row the same bits. (W is fixed by the build;
// an AVX2 and an AVX-512 build differ in the last bits, through the softmax's W-lane sum tree.)
#pragma once

#include "attention_small_heads.h"

#if defined(PAGEDGEN_SMALL_HEADS)
#include "attention_common.h"
#include "attention_math.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace pagedgen::cpu {

constexpr int kSmallTile = 256;     // tokens per online-softmax step
constexpr int kPrefetchAhead = 32;  // K rows are requested this many tokens ahead
constexpr int kRun = 16;            // tokens of a run (RunRows)
alignas(64) constexpr float kZeroRow[small_heads::kMaxColumns] = {};  // stands in for rows not attended to
static_assert(kSmallTile % kRun == 0 && kRun % small_heads::kTokens == 0 && kPrefetchAhead % small_heads::kTokens == 0);

// Element offset, in a cache, of the row of slot j of a tile (the item's first KV head). kRuns: a
// kTokens sub-tile (aligned to kTokens) lies in one kRun-token run, so in one block, its rows `stride`
// elements apart, and small_tile steps a pointer over them instead of looking every row up.
struct RunRows {  // block_size a multiple of kRun: every kRun-token run of a tile lies in one block
  static constexpr bool kRuns = true;
  const int64_t* base;  // [runs] offset of each run's first row
  int64_t stride;       // elements between consecutive tokens of a block
  int64_t operator()(int j) const { return base[unsigned(j) / kRun] + unsigned(j) % kRun * stride; }
};
struct SlotRows {  // any block size: one slot per token
  static constexpr bool kRuns = false;
  const int64_t* slots;
  int64_t stride, col;
  int64_t operator()(int j) const { return slots[j] * stride + col; }
};

// acc[g, 0:kD] += sum_j w[g, j] * row(j)[0:kD] over the slots [ja, jb), for the kG query heads of one
// KV head (rows of w are w_stride floats apart; row(j) is slot j's V row of that head, as float): each
// V row is loaded once for the whole group. U chains (token ja + i in chain i % U, a last incomplete
// round in chain 0), so that the kG * NV * U accumulator registers form independent chains.
template <int kD, int kG, typename Row>
inline void accumulate_group(float* acc, const float* w, int64_t w_stride, const Row& row, int ja, int jb) {
  constexpr int W = head_lanes<kD>(), NV = kD / W;
  constexpr int U = kG * NV >= 8 ? 1 : 8 / (kG * NV);
  Vec<W> a[U][kG][NV] = {};
  int j = ja;
  // every loop over the accumulators is unrolled, so that they stay in registers (with a rolled u
  // loop GCC 12 keeps a[u] on the stack: a store and a reload around each multiply-add)
  for (; j + U <= jb; j += U) {
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) {
      const float* vj = row(j + u);
#pragma GCC unroll 8
      for (int i = 0; i < NV; ++i) {
        const Vec<W> x = load<W>(vj + i * W);
#pragma GCC unroll 8
        for (int g = 0; g < kG; ++g) a[u][g][i] = fmadd<W>(splat<W>(w[g * w_stride + j + u]), x, a[u][g][i]);
      }
    }
  }
  for (; j < jb; ++j) {
    const float* vj = row(j);
#pragma GCC unroll 8
    for (int i = 0; i < NV; ++i) {
      const Vec<W> x = load<W>(vj + i * W);
#pragma GCC unroll 8
      for (int g = 0; g < kG; ++g) a[0][g][i] = fmadd<W>(splat<W>(w[g * w_stride + j]), x, a[0][g][i]);
    }
  }
#pragma GCC unroll 8
  for (int g = 0; g < kG; ++g) {
#pragma GCC unroll 8
    for (int i = 0; i < NV; ++i) {
      Vec<W> sum = load<W>(acc + g * kD + i * W);
#pragma GCC unroll 8
      for (int u = 0; u < U; ++u) sum += a[u][g][i];
      store<W>(acc + g * kD + i * W, sum);
    }
  }
}

// Floats of per-thread scratch for blocks of up to R rows of `heads` query heads, `width` cache
// elements per token row.
inline int64_t small_scratch_floats(int64_t R, int64_t heads, int64_t width, int64_t head_size) {
  return 2 * R * heads * head_size + R * heads * kSmallTile + 2 * R * heads + kSmallTile * width + 16;
}

// The item's per-row state, rows i = 0 .. R - 1 (see attend_small_rows).
struct SmallRows {
  float* q;    // [R, heads, kD] scaled queries
  float* acc;  // [R, heads, kD] un-normalised outputs
  float* sc;   // [R, heads, kSmallTile] scores, then weights, of the current tile
  float* m;    // [R, heads] running max of the scores
  float* l;    // [R, heads] running sum of exp(score - m)
};

// One tile (tokens t0 .. t0 + kSmallTile) of attend_small_rows: the union [ua, ub) of the slots its
// rows attend to is read through `rows`; each row then gets its scores, softmax and V accumulation
// over its own slots.
template <typename scalar_t, int kD, typename Rows>
void small_tile(const Params<scalar_t>& p, const RowBlock& b, int64_t t0, const Rows& rows, int ua, int ub, int heads,
                int width, const SmallRows& s, float* vbuf) {
  namespace sh = small_heads;
  const int G = static_cast<int>(p.group), R = b.rows;
  const int64_t row_bytes = width * sizeof(scalar_t);
  // Slots [ja(i), jb(i)) of this tile that row i attends to (empty if none).
  const auto range = [&](int i, int& ja, int& jb) {
    const int64_t pos = b.pos + i;
    ja = static_cast<int>(std::clamp<int64_t>(window_start(pos, p.sliding_window) - t0, 0, kSmallTile));
    jb = static_cast<int>(std::clamp<int64_t>(pos + 1 - t0, 0, kSmallTile));
  };
  const scalar_t* zero_row = reinterpret_cast<const scalar_t*>(kZeroRow);
  constexpr int kColumns = sh::tile_columns<kD>();
  const scalar_t* krow[sh::kTokens];  // the current kTokens slots' K rows (a zero row outside [ua, ub))
  // sc[i, h, j] = scale * q[i, h] . k[j], kTokens slots by kColumns columns (one or two KV heads) at a time
  for (int sub = ua / sh::kTokens * sh::kTokens; sub < ub; sub += sh::kTokens) {
    // K rows of a later sub-tile into L1; this sub-tile's V rows (read after the softmax) into L2.
    // (Row by row through rows(j), even for runs: stepping a pointer instead, the prefetches issued
    // back to back and decode over scattered blocks ran 1.3-1.7x slower on the AVX2 EPYC.)
    const int ahead = sub + kPrefetchAhead;
    for (int j = std::max(ahead, ua); j < std::min(ub, ahead + sh::kTokens); ++j) {
      prefetch_lines(p.key_cache + rows(j), row_bytes);
    }
    for (int j = std::max(sub, ua); j < std::min(ub, sub + sh::kTokens); ++j) {
      prefetch_lines<2>(p.value_cache + rows(j), row_bytes);
    }
    // every slot of the sub-tile attended to, its rows `stride` apart: a pointer stepped, no zero rows
    const bool strided = Rows::kRuns && sub >= ua && sub + sh::kTokens <= ub;
    const scalar_t* k0 = strided ? p.key_cache + rows(sub) : nullptr;
    if (!strided) {
      for (int j = 0; j < sh::kTokens; ++j) {
        krow[j] = sub + j >= ua && sub + j < ub ? p.key_cache + rows(sub + j) : zero_row;
      }
    }
    for (int c0 = 0; c0 < width; c0 += kColumns) {
      const int cw = std::min(kColumns, width - c0);
      const int h0 = c0 / kD * G;  // first query head of the column tile
      sh::Reg r[kColumns];
      if (strided) {
        sh::load_column_tile<kD>([&](int j) { return k0 + j * rows.stride + c0; }, cw, r);
      } else {
        sh::load_column_tile<kD>([&](int j) { return krow[j] == zero_row ? zero_row : krow[j] + c0; }, cw, r);
      }
      for (int i = 0; i < R; ++i) {
        int ja, jb;
        range(i, ja, jb);
        if (ja >= jb || jb <= sub || ja >= sub + sh::kTokens) continue;  // row i needs none of these slots
        sh::score_column_heads<kD>(r, cw, s.q + (i * heads + h0) * kD, G,
                                   s.sc + (i * heads + h0) * kSmallTile + sub, kSmallTile);
      }
    }
  }
  // V rows of the union as float (fp32 rows are read in place)
  const float* vrow[kSmallTile];
  for (int j = ua; j < ub; ++j) {
    if constexpr (std::is_same_v<scalar_t, float>) {
      vrow[j] = p.value_cache + rows(j);
    } else {
      to_float(p.value_cache + rows(j), vbuf + j * width, width);
      vrow[j] = vbuf + j * width;
    }
  }
  for (int i = 0; i < R; ++i) {
    int ja, jb;
    range(i, ja, jb);
    if (ja >= jb) continue;
    float* sci = s.sc + i * heads * kSmallTile;
    float* acci = s.acc + i * heads * kD;
    for (int h = 0; h < heads; ++h) {
      const float alpha = softmax_tile(sci + h * kSmallTile, ja, jb, s.m[i * heads + h], s.l[i * heads + h]);
      rescale(acci + h * kD, kD, alpha);
    }
    for (int k = 0; k < heads / G; ++k) {  // acc[h] += sum_j w[h, j] * v[j, KV head of h]
      const auto row = [&](int j) { return vrow[j] + k * kD; };
      float* ak = acci + k * G * kD;
      const float* wk = sci + k * G * kSmallTile;
      switch (G) {
        case 1: accumulate_group<kD, 1>(ak, wk, kSmallTile, row, ja, jb); break;
        case 2: accumulate_group<kD, 2>(ak, wk, kSmallTile, row, ja, jb); break;
        case 4: accumulate_group<kD, 4>(ak, wk, kSmallTile, row, ja, jb); break;
        case 8: accumulate_group<kD, 8>(ak, wk, kSmallTile, row, ja, jb); break;
        default:
          for (int g = 0; g < G; ++g) {
            accumulate_group<kD, 1>(ak + g * kD, wk + g * kSmallTile, kSmallTile, row, ja, jb);
          }
      }
    }
  }
}

// The K and V rows of the first kPrefetchAhead tokens of decode row `then` (KV heads from kv_begin,
// `bytes` of a token row) into L2: the next item a thread runs, whose own prefetches start
// kPrefetchAhead tokens in. A block outside the cache is left for that item to report.
template <typename scalar_t>
void prefetch_first_rows(const Params<scalar_t>& p, const RowBlock& then, int64_t kv_begin, int64_t bytes) {
  const int64_t lo = window_start(then.pos, p.sliding_window);
  const int n = static_cast<int>(std::min<int64_t>(kPrefetchAhead, then.pos + 1 - lo));
  int64_t slots[kPrefetchAhead];
  if (n <= 0 || !walker_of(p, then, lo).next(n, slots, [](int64_t) {})) return;
  const int64_t row_stride = p.num_kv_heads * p.head_size, col = kv_begin * p.head_size;
  for (int j = 0; j < n; ++j) {
    prefetch_lines<2>(p.key_cache + slots[j] * row_stride + col, bytes);
    prefetch_lines<2>(p.value_cache + slots[j] * row_stride + col, bytes);
  }
}

// Attention of the rows of `b` for all query heads of KV heads [kv_begin, kv_end) (kD = 8 or 16).
// Returns false (having written zeros) if the block table names a block outside the cache. `then`:
// the decode row this thread runs next with the same KV heads (nullptr if none or not known), whose
// first rows are prefetched while this item's last tile runs.
template <typename scalar_t, int kD>
bool attend_small_rows(const Params<scalar_t>& p, const RowBlock& b, int64_t kv_begin, int64_t kv_end, float* scratch,
                       const RowBlock* then = nullptr) {
  const int G = static_cast<int>(p.group), R = b.rows;
  const int heads = static_cast<int>(kv_end - kv_begin) * G;   // query heads of this item, per row
  const int width = static_cast<int>(kv_end - kv_begin) * kD;  // elements of a token row for them
  SmallRows s;
  s.q = scratch;
  s.acc = s.q + R * heads * kD;
  s.sc = s.acc + R * heads * kD;
  s.m = s.sc + R * heads * kSmallTile;
  s.l = s.m + R * heads;
  float* vbuf = s.l + R * heads;  // [kSmallTile, width] the tile's V rows as float (not for fp32)
  int64_t slots[kSmallTile];      // token slots (or, with RunRows, kRun-token run offsets)

  for (int i = 0; i < R; ++i) {
    load_query(p, b.row + i, kv_begin * G, heads, kD, s.q + i * heads * kD, s.m + i * heads, s.l + i * heads);
  }
  std::fill(s.acc, s.acc + R * heads * kD, 0.0f);
  const int64_t row_stride = p.num_kv_heads * kD;
  const int64_t col = kv_begin * kD;
  const int32_t* table = p.block_tables + b.seq * p.bt_s0;
  const int64_t lo = window_start(b.pos, p.sliding_window), end = b.pos + R;
  BlockWalker walk = walker_of(p, b, lo);
  bool ok = true;
  for (int64_t t0 = lo / kSmallTile * kSmallTile; t0 < end && ok; t0 += kSmallTile) {
    const int ua = static_cast<int>(std::max(lo, t0) - t0), ub = static_cast<int>(std::min(end, t0 + kSmallTile) - t0);
    if (then != nullptr && then->rows == 1 && t0 + kSmallTile >= end) {
      prefetch_first_rows(p, *then, kv_begin, width * static_cast<int64_t>(sizeof(scalar_t)));
    }
    if (p.block_size % kRun == 0) {
      // one run offset per kRun slots; runs that hold an attended token lie in blocks still in use
      for (int r = ua / kRun; r * kRun < ub; ++r) {
        const int64_t token = t0 + r * kRun;
        const int64_t block = table[token / p.block_size * p.bt_s1];
        if (block < 0 || block >= p.num_blocks) {
          ok = false;
          break;
        }
        slots[r] = (block * p.block_size + token % p.block_size) * row_stride + col;
      }
      if (ok) small_tile<scalar_t, kD>(p, b, t0, RunRows{slots, row_stride}, ua, ub, heads, width, s, vbuf);
    } else {
      ok = walk.next(ub - ua, slots + ua, [](int64_t) {});
      if (ok) small_tile<scalar_t, kD>(p, b, t0, SlotRows{slots, row_stride, col}, ua, ub, heads, width, s, vbuf);
    }
  }
  for (int i = 0; i < R; ++i) {
    store_output(p, b.row + i, kv_begin * G, heads, kD, s.acc + i * heads * kD, s.l + i * heads, ok);
  }
  return ok;
}

}  // namespace pagedgen::cpu
#endif  // PAGEDGEN_SMALL_HEADS
