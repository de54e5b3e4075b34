// Shared pieces of the CPU paged attention kernel (csrc/cpu/attention.cpp): the call's sizes and
// pointers, the rows of one work item, block-table walking with prefetch, and the query / output
// rows of an item.
#pragma once

#include "vec.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

namespace pagedgen::cpu {

// Sizes, raw pointers and strides (in elements) shared by all threads. cache_t: the cache's element,
// scalar_t (a float cache) or a 1-byte code (int8_t, c10::Float8_e4m3fn, c10::Float8_e5m2: the
// cache of kv_cache_dtype int8 / fp8, read with its scales, kv_codes.h).
template <typename scalar_t, typename cache_t = scalar_t>
struct Params {
  scalar_t* out;               // out: [num_tokens, num_heads, head_size], strides out_s*
  const scalar_t* query;       // query: [num_tokens, num_heads, head_size], strides q_s*
  const cache_t* key_cache;    // key_cache: [num_blocks, block_size, num_kv_heads, head_size], contiguous
  const cache_t* value_cache;  // value_cache: same shape as key_cache, contiguous
  // 1-byte caches: [num_blocks, block_size, num_kv_heads] bfloat16, contiguous (the scale of a row
  // at element offset e of the cache is at e / head_size); nullptr for a float cache
  const c10::BFloat16* key_scales = nullptr;
  const c10::BFloat16* value_scales = nullptr;
  const int32_t* block_tables;  // block_tables: [num_seqs, max_blocks], strides bt_s*
  int64_t out_s0, out_s1, out_s2, q_s0, q_s1, q_s2, bt_s0, bt_s1;
  int64_t num_heads, num_kv_heads, head_size, group, block_size, num_blocks;
  int64_t sliding_window;  // 0: none; else a row at position p attends over (p - sliding_window, p]
  float scale;
};

// The rows of one work item: `rows` consecutive query rows of one sequence, the first at query row
// `row` and position `pos` (>= 0), the next ones at pos + 1, ... Row i attends over positions
// [lo(i), pos + i] (causal; lo > 0 only with a sliding window).
struct RowBlock {
  int64_t seq, row, pos;
  int rows;
};

// First position a row at position `pos` attends to: 0, or the start of its sliding window
// (transformers' sliding-window mask: key position > pos - window).
inline int64_t window_start(int64_t pos, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
}

// Asks the caches for the lines of [p, p + bytes); Locality as __builtin_prefetch's (3: all levels,
// 2: L2 and beyond).
template <int Locality = 3>
inline void prefetch_lines(const void* p, int64_t bytes) {
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p), end = begin + bytes;
  for (uintptr_t line = begin & ~uintptr_t{63}; line < end; line += 64) {
    __builtin_prefetch(reinterpret_cast<const char*>(line), 0, Locality);
  }
}

// Walks one sequence's block table token after token from `start`: the slot (block * block_size +
// offset) of each token. Blocks are scattered over the cache, where no hardware prefetcher looks, so
// while the tokens of one block are handed out, the same rows of the next block are requested
// (`prefetch(slot)`, one per token: all at once would stall on the line-fill buffers). Only the
// blocks of the tokens handed out are read from the table (blocks before a sliding window may have
// been returned to the pool).
struct BlockWalker {
  const int32_t* table;  // block_tables[seq, :], stride bt_s1
  int64_t bt_s1, block_size, num_blocks, end;  // end: one past the last token that will be asked for
  int64_t logical, offset, base = -1, next_base = -1;  // base: first slot of the current block

  BlockWalker(const int32_t* table, int64_t bt_s1, int64_t block_size, int64_t num_blocks, int64_t start, int64_t end)
      : table(table), bt_s1(bt_s1), block_size(block_size), num_blocks(num_blocks), end(end),
        logical(start / block_size), offset(start % block_size) {}

  // Slots of the next n tokens into slots[0:n]. False if the table names a block outside the cache.
  template <typename Prefetch>
  bool next(int n, int64_t* slots, Prefetch&& prefetch) {
    for (int j = 0; j < n; ++j) {
      if (base < 0) {
        const int64_t block = table[logical * bt_s1];
        if (block < 0 || block >= num_blocks) return false;
        base = block * block_size;
        next_base = -1;
        if ((logical + 1) * block_size < end) {
          const int64_t next_block = table[(logical + 1) * bt_s1];
          if (next_block >= 0 && next_block < num_blocks) next_base = next_block * block_size;
        }
      }
      if (next_base >= 0) prefetch(next_base + offset);
      slots[j] = base + offset;
      if (++offset == block_size) {
        offset = 0;
        ++logical;
        base = -1;
      }
    }
    return true;
  }
};

// The prefetch of the K and V rows of a later tile of a decode item, spread over the work on the
// current one. Decode reads each K/V row once, and its rows lie in blocks scattered over the cache,
// where no hardware prefetcher follows: asking for a whole tile at once (64 KiB of K and V for head
// size 64 and 4 fp32 KV heads) would fill the line-fill buffers and stall the loads the current tile
// needs; asking for each row only just before its use exposes the DRAM latency of every block.
// So step(), called from the inner loops (NoHook's place in attention_math.h), asks for the next
// `per` lines of K and of V, token after token in address order (with all KV heads in one item a
// block is one sequential run, which the DRAM pages and the L2 streamer like best); `per` comes
// from the number of steps the tile before took, so the requests end with the tile; finish() asks
// for whatever is left.
struct TilePrefetch {
  const char* key;       // key_cache as bytes
  const char* value;     // value_cache as bytes
  int64_t stride;        // bytes between consecutive slots
  int64_t first, bytes;  // the item's part of a slot's row: byte offset and size
  const int64_t* slots = nullptr;
  int n = 0, t = 0;                // the tile's slots[0:n]; t: the token being requested
  int64_t line = 0, line_end = 0;  // byte offsets (from the cache bases) of token t's lines still to ask for
  int per = 2;
  int64_t steps = 0;  // step() calls since start()

  // Prefetch the rows of slots[0:count] from now until finish().
  void start(const int64_t* s, int count) {
    const int64_t lines = count * (bytes / 64 + 2);  // at most, whatever the alignment
    if (steps > 0) per = static_cast<int>(std::max<int64_t>(1, (lines + steps - 1) / steps));
    slots = s, n = count, t = 0, steps = 0;
    begin_token();
  }
  PAGEDGEN_ALWAYS_INLINE void begin_token() {
    if (t < n) {
      const int64_t a = slots[t] * stride + first;
      line = a & ~int64_t{63};
      line_end = a + bytes;
    }
  }
  PAGEDGEN_ALWAYS_INLINE bool one() {
    if (t >= n) return false;
    __builtin_prefetch(key + line, 0, 2);  // to L2: two tiles ahead would not fit L1 (measured)
    __builtin_prefetch(value + line, 0, 2);
    line += 64;
    if (line >= line_end) {
      ++t;
      begin_token();
    }
    return true;
  }
  PAGEDGEN_ALWAYS_INLINE void step() {
    ++steps;
    for (int i = 0; i < per && one(); ++i) {
    }
  }
  void finish() {
    while (one()) {
    }
  }
};

// The hook of attention_math.h's loops that drives a TilePrefetch.
struct PrefetchHook {
  TilePrefetch* prefetch;
  PAGEDGEN_ALWAYS_INLINE void operator()() const { prefetch->step(); }
};

template <typename scalar_t, typename cache_t>
BlockWalker walker_of(const Params<scalar_t, cache_t>& p, const RowBlock& b, int64_t start) {
  return BlockWalker(p.block_tables + b.seq * p.bt_s0, p.bt_s1, p.block_size, p.num_blocks, start, b.pos + b.rows);
}

// Scaled query of heads [h0, h0 + heads) of query row `row` into q: [heads, D] float; running max
// -inf and sum 0 into m, l: [heads].
template <typename scalar_t, typename cache_t>
void load_query(const Params<scalar_t, cache_t>& p, int64_t row, int64_t h0, int heads, int D, float* q, float* m, float* l) {
  const scalar_t* query = p.query + row * p.q_s0 + h0 * p.q_s1;
  const Vec<kLanes> scale = splat<kLanes>(p.scale);
  for (int h = 0; h < heads; ++h) {
    const scalar_t* src = query + h * p.q_s1;
    float* dst = q + h * D;
    if (p.q_s2 == 1) {
      int d = 0;
      for (; d + kLanes <= D; d += kLanes) store<kLanes>(dst + d, load<kLanes>(src + d) * scale);
      if (d < D) store_partial<kLanes>(dst + d, load_partial<kLanes>(src + d, D - d) * scale, D - d);
    } else {
      for (int d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d * p.q_s2]) * p.scale;
    }
    m[h] = -std::numeric_limits<float>::infinity();
    l[h] = 0.0f;
  }
}

// The 16-bit words of query heads [h0, h0 + heads) of `row` as the model gave them (unscaled):
// q[h * D + d]. The operand of the bf16 score path (score_rows_bf16); scalar_t is 16 bits wide.
template <typename scalar_t, typename cache_t>
void load_query_bits(const Params<scalar_t, cache_t>& p, int64_t row, int64_t h0, int heads, int D, uint16_t* q) {
  static_assert(sizeof(scalar_t) == sizeof(uint16_t), "load_query_bits: a 16-bit dtype");
  const scalar_t* query = p.query + row * p.q_s0 + h0 * p.q_s1;
  for (int h = 0; h < heads; ++h) {
    const scalar_t* src = query + h * p.q_s1;
    if (p.q_s2 == 1) {
      std::memcpy(q + h * D, src, D * sizeof(uint16_t));
    } else {
      for (int d = 0; d < D; ++d) std::memcpy(q + h * D + d, src + d * p.q_s2, sizeof(uint16_t));
    }
  }
}

// out[row, h0 + h] = acc[h] / l[h] for the item's heads (zeros when `valid` is false).
template <typename scalar_t, typename cache_t>
void store_output(const Params<scalar_t, cache_t>& p, int64_t row, int64_t h0, int heads, int D, const float* acc,
                  const float* l, bool valid) {
  scalar_t* out = p.out + row * p.out_s0 + h0 * p.out_s1;
  for (int h = 0; h < heads; ++h) {
    const float inv = valid ? 1.0f / l[h] : 0.0f;
    const Vec<kLanes> vinv = splat<kLanes>(inv);
    const float* src = acc + h * D;
    scalar_t* dst = out + h * p.out_s1;
    if (p.out_s2 == 1 && valid) {
      int d = 0;
      for (; d + kLanes <= D; d += kLanes) store<kLanes>(dst + d, load<kLanes>(src + d) * vinv);
      if (d < D) store_partial<kLanes>(dst + d, load_partial<kLanes>(src + d, D - d) * vinv, D - d);
    } else {
      for (int d = 0; d < D; ++d) dst[d * p.out_s2] = static_cast<scalar_t>(valid ? src[d] * inv : 0.0f);
    }
  }
}

}  // namespace pagedgen::cpu
