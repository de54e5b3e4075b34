// The general path of the CPU paged attention kernel (csrc/cpu/attention.cpp): any head size, one
// work item per (block of rows of one sequence, KV head), all query heads of the KV head's GQA group
// together.
//
// Decode and prefill are one loop: a decode item is a block of one row, a prefill item a block of up
// to R consecutive rows of a prompt chunk. The item walks the tiles of kTile tokens (aligned to
// absolute positions) that any of its rows needs, reads each tile's K/V rows once through the block
// table (converted to float once for bf16/fp16: the cost shared by all R x group (row, head) pairs;
// with AVX512-BF16, bf16 K is never converted: score_rows_bf16 reads it as stored; decode rows and
// short blocks of fewer than kTransposedPairs pairs, e.g. the k + 1 rows of a speculative verify
// step, read bf16/fp16 K and V in place and stream them as decode rows do, streamed_block),
// and then runs, for each row, the per-row inner loops of attention_math.h over the slots that row
// attends to in the tile (causal within the chunk, the cached prefix before it, the sliding window).
// Rows whose slot ranges in a tile are equal (a whole tile of an earlier prefix or chunk) share one
// call of the score loop, as extra heads. Every (row, head) value is computed by the same operations
// whatever R is, so a row's output is bitwise the same in a prefill chunk of any size, in a verify
// block, as a decode row, and whatever the other rows of the call are (reading in place or from a
// converted copy, and the prefetches, never change the arithmetic).
// A 1-byte KV cache (cache_t a code, attention.cpp) is read as bf16 is, its rows as float(code) (in
// place for decode rows and short blocks, converted into kbuf / vbuf otherwise), with each token's
// scales applied to its scores and weights (scale_slots): the same per-row arithmetic on every route.
//
// Measured (issue 34; AMD EPYC Zen 4, AVX512-BF16, bf16 cache, head size 64, 9 heads / 3 KV heads,
// 8 sequences of 100-300 tokens): short blocks are bound by the score, softmax and V-accumulation
// arithmetic that invariance fixes, not by memory: streaming them gains about 7% at 2 rows (6 pairs)
// and is within noise at 4 rows. Tried and not kept, the same bits both: bf16 scores from a K tile
// of 32-bit words transposed once per tile (a vertical hsum tree, no shuffles: the broadcast query
// words and the extra K loads cost what the shuffles saved, 0-10% slower), and the softmax of 16
// heads at a time (hmax/hsum of 16 heads in one register, one vector exp for the alphas: verify
// unchanged, decode 20% slower), and bf16 score registers of 4 heads x 4 slots (or 3 x 5, 2 x 8)
// sharing each K slice load (within noise for 4-row blocks, decode 5% slower with 3 x 5).
#pragma once

#include "attention_common.h"
#include "attention_math.h"
#include "kv_codes.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace pagedgen::cpu {

// Floats of per-thread scratch of the general path for blocks of up to R rows and KV heads at a time.
inline int64_t general_scratch_floats(int64_t R, int64_t kv_heads, int64_t group, int64_t head_size) {
  const int64_t heads = R * kv_heads * group;
  return 2 * heads * head_size + R * group * kTile + 2 * heads + 3 * kTile * head_size + 2 * kLanes * kTile +
         (heads * head_size + 1) / 2 + 32;  // + the bf16 bits of the queries (bf16 scores)
}

// One K or V row of D values as the attention reads it, into dst[0:D] as float: a float cache's row
// converted, or a 1-byte cache's codes as float (kv_codes.h; the row's scale is applied to its
// scores and weights, scale_slots).
template <typename cache_t>
PAGEDGEN_ALWAYS_INLINE void kv_row_to_float(const cache_t* src, float* dst, int D) {
  if constexpr (is_kv_code<cache_t>()) {
    codes_to_float(src, dst, D);
  } else {
    to_float(src, dst, D);
  }
}

// s[j] *= f[j] over the registers that hold the slots [ja, jb) of a tile (the 1-byte cache's
// per-token scales on scores and weights; lanes outside [ja, jb) are masked or never read).
inline void scale_slots(float* s, const float* f, int ja, int jb) {
  for (int t = first_register(ja); t < end_register(jb); ++t) {
    store<kLanes>(s + t * kLanes, load<kLanes>(s + t * kLanes) * load<kLanes>(f + t * kLanes));
  }
}

// Tiles ahead of the current one whose K/V rows a decode item prefetches (one tile of fp32 head
// size 64 with 4 KV heads is 64 KiB of K and V: two tiles ahead stay well inside L2).
constexpr int kDecodeAhead = 2;

// (row, query head) pairs of an item from which its tiles' scores come from a transposed tile
// (score_transposed_rows: no horizontal sums, for the cost of one transpose per tile).
constexpr int kTransposedPairs = 16;

// A block of rows that reads each K/V row for few (row, query head) pairs, as a decode row does: one
// row, or a short block (the k + 1 rows of a speculative verify step, a short prefill chunk) with
// fewer than kTransposedPairs pairs per KV head. Such blocks stream K/V like decode rows (read in
// place, block table read ahead, TilePrefetch) and are laid out in items as decode rows are.
inline bool streamed_block(int64_t rows, int64_t group) { return rows == 1 || rows * group < kTransposedPairs; }

// Attention of the rows of `b` for the query heads of KV heads [kv_begin, kv_end) (each with its
// group of query heads). Returns false (having written zeros) if the block table names a block
// outside the cache. Several KV heads per item (decode rows of a large batch) read each token's
// rows of those heads together: a block is then one contiguous run of memory. `then`: the row block
// of the item this thread runs next with the same KV heads (nullptr if none or not known), whose
// first tiles a decode row prefetches while it ends.
template <typename scalar_t, int kHeadSize, typename cache_t>
bool attend_rows(const Params<scalar_t, cache_t>& p, const RowBlock& b, int64_t kv_begin, int64_t kv_end, float* scratch,
                 const RowBlock* then = nullptr) {
  // bf16 with AVX512-BF16 and a head of whole 32-element slices: every row's scores from the bf16
  // query and the cache's K directly (score_rows_bf16); K is never converted.
  // A 1-byte cache (cache_t a code, kv_codes.h): rows of float(code), converted into kbuf / vbuf or
  // read in place (decode rows), the tokens' scales applied to the scores and the weights (sk, sv);
  // never scored with vdpbf16ps.
  constexpr bool kSame = std::is_same_v<cache_t, scalar_t>;  // a float cache of the query's dtype
  constexpr bool kCodes = is_kv_code<cache_t>();
  constexpr bool kDot = kSame && std::is_same_v<scalar_t, c10::BFloat16> && bf16_dot_head<kHeadSize>();
  const int D = kHeadSize > 0 ? kHeadSize : static_cast<int>(p.head_size);
  const int G = static_cast<int>(p.group), R = b.rows, K = static_cast<int>(kv_end - kv_begin);
  const int RG = R * G;  // (row, query head) pairs of one KV head
  float* q = scratch;                 // [K, R, G, D] scaled queries
  float* acc = q + K * RG * D;        // [K, R, G, D] un-normalised outputs
  float* m = acc + K * RG * D;        // [K, R, G] running max of the scores
  float* l = m + K * RG;              // [K, R, G] running sum of exp(score - m)
  float* sc = l + K * RG;             // [R, G, kTile] scores, then weights, of the current tile and KV head
  float* kbuf = sc + RG * kTile;      // [kTile, D] the tile's K rows as float (unused for fp32 decode)
  float* vbuf = kbuf + kTile * D;     // [kTile, D] the tile's V rows as float
  float* kt = vbuf + kTile * D;       // [D, kTile] the tile's K rows transposed (heads <= 16 floats, or many pairs)
  float* part = kt + kTile * D;       // [2 * kLanes * kTile] score_transposed_rows' lane chains
  uint16_t* qbits = reinterpret_cast<uint16_t*>(part + 2 * kLanes * kTile);  // [K, R, G, D] bf16 queries (kDot)
  const float* krows[kTile];  // slot j: the tile's K row of token (tile start + j), as float
  const float* vrows[kTile];
  const cache_t* kraw[kTile];  // slot j: the same rows in the cache (bf16/fp16/1-byte decode rows read in place)
  const cache_t* vraw[kTile];
  alignas(64) float sk[kTile];  // a 1-byte cache: slot j's key scale (times code_fold), 0 outside [ua, ub)
  alignas(64) float sv[kTile];  // and its value scale
  int64_t slots[kTile];

  for (int k = 0; k < K; ++k) {
    for (int i = 0; i < R; ++i) {
      const int64_t at = (k * R + i) * G;
      load_query(p, b.row + i, (kv_begin + k) * G, G, D, q + at * D, m + at, l + at);
      if constexpr (kDot) load_query_bits(p, b.row + i, (kv_begin + k) * G, G, D, qbits + at * D);
    }
  }
  std::fill(acc, acc + K * RG * D, 0.0f);
  const int64_t row_stride = p.num_kv_heads * D;  // elements between tokens in a block
  const int64_t bytes = K * D * static_cast<int64_t>(sizeof(cache_t));  // of a token's row for the item's KV heads
  auto prefetch = [&](int64_t slot) {
    prefetch_lines(p.key_cache + slot * row_stride + kv_begin * D, bytes);
    prefetch_lines(p.value_cache + slot * row_stride + kv_begin * D, bytes);
  };
  const int64_t lo = window_start(b.pos, p.sliding_window);  // the first row's window starts first
  const int64_t end = b.pos + R;                              // one past the last row's position
  BlockWalker walk = walker_of(p, b, lo);
  // A decode row, or a short block of rows (streamed_block), reads each K/V row for few pairs: its
  // tiles' slots are read from the block table kDecodeAhead tiles ahead, and that tile's rows are
  // prefetched a few lines at a time from the inner loops of the current one (TilePrefetch); a
  // prefill block re-reads each tile for many (row, head) pairs, and the walker's prefetch of the next
  // block's rows is enough.
  const bool decode = streamed_block(R, G);
  // bf16/fp16/1-byte decode rows and short blocks with a compile-time head size read K/V in place, converted
  // to float as the score and accumulate loops load them (exact, so the same bits as converting
  // first): one pass over each row instead of a conversion pass, a store and a reload. The
  // transposed-tile score path (many query heads per KV head) and small heads take float rows.
  // A 1-byte cache reads in place where each K/V slice is converted about once: int8 codes always
  // (two instructions, as bf16), fp8 codes (more: e4m3 ten) only for heads that do not share a KV
  // head across score blocks (score_rows: one head at a time with AVX-512, pairs with AVX2); with
  // larger groups they are converted once per token into kbuf / vbuf. The same bits either way.
  constexpr bool kFloat = kSame && std::is_same_v<scalar_t, float>;  // an fp32 cache: read in place
  const bool raw_codes = !kCodes || std::is_same_v<cache_t, int8_t> || G <= (kLanes >= 16 ? 1 : 2);
  const bool raw = !kFloat && decode && kHeadSize > 16 && RG < kTransposedPairs && raw_codes;
  int64_t ring[kDecodeAhead + 1][kTile];  // decode: slots of the item's tile i in ring[i % (kDecodeAhead + 1)]
  const int64_t first_t0 = lo / kTile * kTile;
  int64_t read_t0 = first_t0;  // decode: the next tile whose slots to read from the block table
  const auto ring_of = [&](int64_t t) { return ring[(t - first_t0) / kTile % (kDecodeAhead + 1)]; };
  TilePrefetch ahead{reinterpret_cast<const char*>(p.key_cache), reinterpret_cast<const char*>(p.value_cache),
                     row_stride * static_cast<int64_t>(sizeof(cache_t)),
                     kv_begin * D * static_cast<int64_t>(sizeof(cache_t)), bytes};
  const PrefetchHook hook{&ahead};
  bool ok = true;
  for (int64_t t0 = first_t0; t0 < end && ok; t0 += kTile) {
    // The tile's tokens that some row attends to: [ua, ub), contiguous from tile to tile.
    const int ua = static_cast<int>(std::max(lo, t0) - t0), ub = static_cast<int>(std::min(end, t0 + kTile) - t0);
    const int64_t* cur = slots;  // cur[ua:ub]: the tile's slots
    if (!decode) {
      ok = walk.next(ub - ua, slots + ua, prefetch);
      if (!ok) break;
    } else {
      for (; ok && read_t0 < end && read_t0 <= t0 + kDecodeAhead * kTile; read_t0 += kTile) {
        const int a = static_cast<int>(std::max(lo, read_t0) - read_t0);
        const int n = static_cast<int>(std::min(end, read_t0 + kTile) - read_t0);
        ok = walk.next(n - a, ring_of(read_t0) + a, [](int64_t) {});
        if constexpr (kCodes) {  // that tile's scales too (the K/V rows: TilePrefetch)
          for (int j = a; ok && j < n; ++j) {
            __builtin_prefetch(p.key_scales + ring_of(read_t0)[j] * p.num_kv_heads + kv_begin, 0, 2);
            __builtin_prefetch(p.value_scales + ring_of(read_t0)[j] * p.num_kv_heads + kv_begin, 0, 2);
          }
        }
      }
      if (!ok) break;
      cur = ring_of(t0);
      const int64_t target = t0 + kDecodeAhead * kTile;  // the tile to prefetch
      if (target < end) {
        ahead.start(ring_of(target), static_cast<int>(std::min(end, target + kTile) - target));
      } else if (then != nullptr && streamed_block(then->rows, G)) {
        // past the block's last tile: tile m of the decode row (or short block) this thread runs next,
        // which prefetches its own tiles from kDecodeAhead on (a block outside the cache is left for
        // that item to report)
        const int64_t m = (target - (end + kTile - 1) / kTile * kTile) / kTile;
        const int64_t lo2 = window_start(then->pos, p.sliding_window), t2 = lo2 / kTile * kTile + m * kTile;
        const int64_t a = std::max(lo2, t2), z = std::min(then->pos + then->rows, t2 + kTile);
        BlockWalker then_walk = walker_of(p, *then, a);
        int64_t* free_slots = ring_of(target);  // holds no tile of this row
        if (a < z && then_walk.next(static_cast<int>(z - a), free_slots, [](int64_t) {})) {
          ahead.start(free_slots, static_cast<int>(z - a));
        }
      }
    }
    // fp32 and in-place decode read K/V in the score and accumulate loops; other bf16/fp16 decode
    // rows in the conversion loop
    const bool hook_math = decode && (kFloat || raw);
    for (int k = 0; k < K; ++k) {
      const int64_t col = (kv_begin + k) * D;  // this KV head's first element in a token's row
      if constexpr (kCodes) {  // the registers' slots outside [ua, ub): scale 0
        for (int j = first_register(ua) * kLanes; j < ua; ++j) sk[j] = sv[j] = 0.0f;
        for (int j = ub; j < end_register(ub) * kLanes; ++j) sk[j] = sv[j] = 0.0f;
      }
      for (int j = ua; j < ub; ++j) {
        const int64_t row = cur[j] * row_stride + col;
        if constexpr (kCodes) {
          sk[j] = static_cast<float>(p.key_scales[row / D]) * code_fold<cache_t>();
          sv[j] = static_cast<float>(p.value_scales[row / D]) * code_fold<cache_t>();
        }
        if (kDot || raw) kraw[j] = p.key_cache + row;
        if (raw) {
          vraw[j] = p.value_cache + row;
          continue;
        }
        if constexpr (!kFloat) {
          if (decode) hook();
        }
        if constexpr (kFloat) {
          if (decode) {  // a decode row or short block of fp32: read in place
            krows[j] = p.key_cache + row;
            vrows[j] = p.value_cache + row;
            continue;
          }
        }
        // as float into kbuf/vbuf: converted (bf16/fp16), or copied for a block of rows that reads
        // them many times (in the cache, rows lie num_kv_heads * head_size apart, which maps them to
        // few L1 sets)
        // (a 1-byte cache: its codes as float, kv_codes.h)
        if constexpr (!kDot) {
          kv_row_to_float(p.key_cache + row, kbuf + j * D, D);
          krows[j] = kbuf + j * D;
        }
        kv_row_to_float(p.value_cache + row, vbuf + j * D, D);
        vrows[j] = vbuf + j * D;
      }
      if constexpr (kHeadSize > 0 && kHeadSize <= 16) transpose_tile<kHeadSize>(krows, ua, ub, kt);
      float* qk = q + k * RG * D;
      float* ak = acc + k * RG * D;
      float* mk = m + k * RG;
      float* lk = l + k * RG;
      // Many pairs (a prefill block): the scores of all rows that attend to the tile, for the whole
      // tile, from its transpose (the same bits as score_rows).
      bool scored = false;
      if constexpr (!kDot && kHeadSize > 16 && kHeadSize % kLanes == 0) {
        if (RG >= kTransposedPairs) {
          int i_first = 0, i_last = R;  // rows [i_first, i_last) attend to some slot of the tile
          while (i_first < R && b.pos + i_first < t0) ++i_first;
          while (i_last > i_first && window_start(b.pos + i_last - 1, p.sliding_window) >= t0 + kTile) --i_last;
          if (i_first < i_last) {
            transpose_full_tile<kHeadSize>(krows, ua, ub, kt);
            score_transposed_rows<kHeadSize>(qk + i_first * G * D, (i_last - i_first) * G, kt, sc + i_first * G * kTile,
                                             part);
          }
          scored = true;
        }
      }
      // Rows i0 .. i1 - 1 with the same slots [ja, jb) of this tile: scores in one call.
      int i0 = 0;
      while (i0 < R) {
        const int64_t pos0 = b.pos + i0;
        const int ja = static_cast<int>(std::max(window_start(pos0, p.sliding_window), t0) - t0);
        const int jb = static_cast<int>(std::min(pos0 + 1, t0 + kTile) - t0);
        int i1 = i0 + 1;
        while (i1 < R && std::max(window_start(b.pos + i1, p.sliding_window), t0) - t0 == ja &&
               std::min(b.pos + i1 + 1, t0 + kTile) - t0 == jb) {
          ++i1;
        }
        // scores, softmax and V accumulation of the run's (row, head) pairs [h0, h1), with `hk` called
        // from the token loops
        const auto run = [&](auto hk, const auto* ks, const auto* vs) {
          const int h0 = i0 * G, h1 = i1 * G;
          if (scored) {
          } else if constexpr (kDot) {
#if defined(__AVX512BF16__)
            score_rows_bf16<kHeadSize>(qbits + (k * RG + h0) * D, h1 - h0, kraw, ja, jb, sc + h0 * kTile, p.scale, hk);
#endif
          } else if constexpr (kHeadSize > 0 && kHeadSize <= 16) {
            score_transposed<kHeadSize>(qk + h0 * D, h1 - h0, kt, ja, jb, sc + h0 * kTile);  // sc[h, j] = q[h] . k[j]
          } else if constexpr (kHeadSize > 0) {
            score_rows<kHeadSize>(qk + h0 * D, h1 - h0, ks, ja, jb, sc + h0 * kTile, hk);
          } else {
            score_rows_runtime(qk + h0 * D, h1 - h0, D, krows, ja, jb, sc + h0 * kTile, hk);
          }
          if constexpr (kCodes) {  // q . k = s_k (q . code)
            for (int h = h0; h < h1; ++h) scale_slots(sc + h * kTile, sk, ja, jb);
          }
          for (int h = h0; h < h1; ++h) {
            const float alpha = softmax_tile(sc + h * kTile, ja, jb, mk[h], lk[h]);  // scores -> weights
            rescale(ak + h * D, D, alpha);
            if constexpr (kCodes) scale_slots(sc + h * kTile, sv, ja, jb);  // (w s_v) . code
          }
          if constexpr (kHeadSize > 0) {  // acc[h] += sum_j w[h, j] * v[j]
            accumulate_heads<kHeadSize>(ak + h0 * D, h1 - h0, sc + h0 * kTile, vs, ja, jb, hk);
          } else {
            for (int h = h0; h < h1; ++h) accumulate_tile_runtime(ak + h * D, D, sc + h * kTile, vrows, ja, jb, hk);
          }
        };
        if (ja < jb) {
          if (raw) {
            if constexpr (kHeadSize > 16) run(hook, kraw, vraw);
          } else if (hook_math) {
            run(hook, krows, vrows);
          } else {
            run(NoHook{}, krows, vrows);
          }
        }
        i0 = i1;
      }
    }
    ahead.finish();
  }
  for (int k = 0; k < K; ++k) {
    for (int i = 0; i < R; ++i) {
      const int64_t at = (k * R + i) * G;
      store_output(p, b.row + i, (kv_begin + k) * G, G, D, acc + at * D, l + at, ok);
    }
  }
  return ok;
}

}  // namespace pagedgen::cpu
