// CPU kernel of pagedgen::paged_attention (schema in csrc/ops.cpp, oracle in
// pagedgen/ops/reference.py): decode attention of one query row per sequence over its paged KV cache.
//
// The engine also runs prefill through this kernel, one row per prompt token (seq_len = position + 1,
// the sequence's block table repeated), so a call may hold thousands of short rows as well as a few
// rows with 32k-token contexts. Hence:
//   * Work item = (row, kv_head). All query heads of one GQA group are handled together, so each K/V
//     row is read (and converted to float) once per group, not once per query head.
//   * Head sizes 8 and 16 with AVX-512 (attend_small, attention_small_heads.h): work item = (row, all
//     KV heads), or the KV heads of one 16-float column tile when there are few rows. Scores come from
//     16 x 16 in-register transposes of K, 16 tokens per multiply-add, since at these sizes a dot
//     product per (token, head) costs more in horizontal sums than in arithmetic (2-2.5x faster on
//     the default model's decode, see docs/benchmarks.md).
//   * OpenMP `for` with dynamic scheduling over the items: row costs differ widely (prefill rows grow
//     with their position), and a static split would leave one core idle. Chunks are runs of
//     consecutive items, so neighbouring prefill rows of a sequence re-read the same blocks from cache.
//     The team has at most one thread per kMinWorkPerThread multiply-adds: small calls run inline.
//   * Online softmax (Milakov & Gimelshein 2018, as in FlashAttention) over tiles of kTile tokens: the
//     scratch per thread is O(group * head_size + kTile * head_size) floats whatever the context
//     length, allocated once per call before the parallel region. No allocation, no ATen call per item.
//   * float32 accumulation and softmax whatever the cache dtype; bf16/fp16 rows are converted to float
//     once per row into the thread's scratch, fp32 rows are read in place.
//   * Head sizes 8/16/32/64/128/256 are template constants, with the inner loops (attention_math.h)
//     held in registers; any other head size runs plain loops with run-time bounds.
//   * Blocks are scattered over the cache, so while one block is processed the rows of the next one
//     are prefetched (the hardware prefetcher cannot guess them).
//
// Strides: query and out are read/written through all three of their strides (they may be views of a
// larger qkv or output tensor; no copy is made), block_tables through both of its strides (a row may
// be an expand()ed copy of a sequence's table). key_cache and value_cache must be contiguous.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/library.h>

#include "attention_math.h"
#include "attention_small_heads.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace pagedgen::cpu {
namespace {

// Sizes, raw pointers and strides (in elements) shared by all threads.
template <typename scalar_t>
struct Params {
  scalar_t* out;              // out: [num_seqs, num_heads, head_size], strides out_s*
  const scalar_t* query;      // query: [num_seqs, num_heads, head_size], strides q_s*
  const scalar_t* key_cache;  // key_cache: [num_blocks, block_size, num_kv_heads, head_size], contiguous
  const scalar_t* value_cache;  // value_cache: same shape as key_cache, contiguous
  const int32_t* block_tables;  // block_tables: [num_seqs, max_blocks], strides bt_s*
  const int32_t* seq_lens;      // seq_lens: [num_seqs], contiguous
  int64_t out_s0, out_s1, out_s2, q_s0, q_s1, q_s2, bt_s0, bt_s1;
  int64_t num_seqs, num_heads, num_kv_heads, head_size, group, block_size, num_blocks;
  float scale;
};

// Asks the caches for the lines of [p, p + bytes); Locality as __builtin_prefetch's (3: all levels,
// 2: L2 and beyond).
template <int Locality = 3>
inline void prefetch_lines(const void* p, int64_t bytes) {
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p), end = begin + bytes;
  for (uintptr_t line = begin & ~uintptr_t{63}; line < end; line += 64) {
    __builtin_prefetch(reinterpret_cast<const char*>(line), 0, Locality);
  }
}

// Asks the caches for one K row and one V row of `head_size` elements.
template <typename scalar_t>
inline void prefetch_row(const scalar_t* k, const scalar_t* v, int head_size) {
  prefetch_lines(k, head_size * static_cast<int64_t>(sizeof(scalar_t)));
  prefetch_lines(v, head_size * static_cast<int64_t>(sizeof(scalar_t)));
}

// Floats of per-thread scratch (padded to whole 64-byte lines so that threads never share a line).
inline int64_t scratch_floats(int64_t group, int64_t head_size) {
  const int64_t n = 2 * group * head_size + group * kTile + 2 * group + 3 * kTile * head_size;
  return (n + 15) / 16 * 16;
}

// Walks one sequence's block table a tile at a time: the slot (block * block_size + offset) of each
// token. Blocks are scattered over the cache, where no hardware prefetcher looks, so while the tokens
// of one block are handed out, the same rows of the next block are requested (`prefetch(slot)`, one
// per token: all at once would stall on the line-fill buffers).
struct BlockWalker {
  const int32_t* table;  // block_tables[seq, :], stride bt_s1
  int64_t bt_s1, block_size, num_blocks, seq_len;
  int64_t logical = 0, offset = 0, base = 0, next_base = -1;  // base: first slot of the current block

  // Slots of the next n tokens into slots[0:n]. False if the table names a block outside the cache.
  template <typename Prefetch>
  bool next(int n, int64_t* slots, Prefetch&& prefetch) {
    for (int j = 0; j < n; ++j) {
      if (offset == 0) {
        const int64_t block = table[logical * bt_s1];
        if (block < 0 || block >= num_blocks) return false;
        base = block * block_size;
        next_base = -1;
        if ((logical + 1) * block_size < seq_len) {
          const int64_t next_block = table[(logical + 1) * bt_s1];
          if (next_block >= 0 && next_block < num_blocks) next_base = next_block * block_size;
        }
      }
      if (next_base >= 0) prefetch(next_base + offset);
      slots[j] = base + offset;
      if (++offset == block_size) {
        offset = 0;
        ++logical;
      }
    }
    return true;
  }
};

template <typename scalar_t>
BlockWalker walker_of(const Params<scalar_t>& p, int64_t seq, int64_t seq_len) {
  return BlockWalker{p.block_tables + seq * p.bt_s0, p.bt_s1, p.block_size, p.num_blocks, seq_len};
}

// Scaled query of heads [h0, h0 + heads) of row seq into q: [heads, D] float; running max -inf, sum 0.
template <typename scalar_t>
void load_query(const Params<scalar_t>& p, int64_t seq, int64_t h0, int heads, int D, float* q, float* m, float* l) {
  const scalar_t* query = p.query + seq * p.q_s0 + h0 * p.q_s1;
  for (int h = 0; h < heads; ++h) {
    for (int d = 0; d < D; ++d) q[h * D + d] = static_cast<float>(query[h * p.q_s1 + d * p.q_s2]) * p.scale;
    m[h] = -std::numeric_limits<float>::infinity();
    l[h] = 0.0f;
  }
}

// out[seq, h0 + h] = acc[h] / l[h] for the item's heads (zeros when `valid` is false).
template <typename scalar_t>
void store_output(const Params<scalar_t>& p, int64_t seq, int64_t h0, int heads, int D, const float* acc,
                  const float* l, bool valid) {
  scalar_t* out = p.out + seq * p.out_s0 + h0 * p.out_s1;
  for (int h = 0; h < heads; ++h) {
    const float inv = valid ? 1.0f / l[h] : 0.0f;
    for (int d = 0; d < D; ++d) {
      out[h * p.out_s1 + d * p.out_s2] = static_cast<scalar_t>(valid ? acc[h * D + d] * inv : 0.0f);
    }
  }
}

// Attention of query row `seq` for the `group` query heads that share KV head `kv_head`.
// Returns false (having written zeros) if the block table names a block outside the cache.
template <typename scalar_t, int kHeadSize>
bool attend_one(const Params<scalar_t>& p, int64_t seq, int64_t kv_head, float* scratch) {
  const int D = kHeadSize > 0 ? kHeadSize : static_cast<int>(p.head_size);
  const int G = static_cast<int>(p.group);
  float* q = scratch;         // [G, D] scaled query
  float* acc = q + G * D;     // [G, D] un-normalised output
  float* sc = acc + G * D;    // [G, kTile] scores, then probabilities, of the current tile
  float* m = sc + G * kTile;  // [G] running max of the scores
  float* l = m + G;           // [G] running sum of exp(score - m)
  float* kbuf = l + G;        // [kTile, D] the tile's K rows as float (unused for fp32)
  float* vbuf = kbuf + kTile * D;  // [kTile, D] the tile's V rows as float (unused for fp32)
  float* kt = vbuf + kTile * D;    // [D, kTile] the tile's K rows transposed (small heads only)
  const float* krows[kTile];  // the tile's K rows as float (in the cache for fp32, else in kbuf)
  const float* vrows[kTile];
  int64_t slots[kTile];

  const int64_t seq_len = p.seq_lens[seq];
  bool ok = true;
  if (seq_len > 0) {
    load_query(p, seq, kv_head * G, G, D, q, m, l);
    std::fill(acc, acc + G * D, 0.0f);
    const int64_t row_stride = p.num_kv_heads * D;  // elements between tokens in a block
    const int64_t col = kv_head * D;                // this KV head's first element in a token's row
    auto prefetch = [&](int64_t slot) {
      prefetch_row(p.key_cache + slot * row_stride + col, p.value_cache + slot * row_stride + col, D);
    };
    BlockWalker walk = walker_of(p, seq, seq_len);
    for (int64_t t0 = 0; t0 < seq_len && ok; t0 += kTile) {
      const int n = static_cast<int>(std::min<int64_t>(kTile, seq_len - t0));
      ok = walk.next(n, slots, prefetch);  // the tile's K/V rows for this KV head
      if (!ok) break;
      for (int j = 0; j < n; ++j) {
        const int64_t row = slots[j] * row_stride + col;
        krows[j] = row_as_float(p.key_cache + row, kbuf + j * D, D);
        vrows[j] = row_as_float(p.value_cache + row, vbuf + j * D, D);
      }
      if constexpr (kHeadSize > 0) {
        score_tile<kHeadSize>(q, G, krows, n, kt, sc);  // sc[h, j] = scale * q[h] . k[j]
      } else {
        score_tile_runtime(q, G, D, krows, n, sc);
      }
      for (int h = 0; h < G; ++h) {
        float* sh = sc + h * kTile;
        const float alpha = softmax_tile(sh, n, m[h], l[h]);  // sh: scores -> weights
        float* ah = acc + h * D;
#pragma omp simd
        for (int d = 0; d < D; ++d) ah[d] *= alpha;
        if constexpr (kHeadSize > 0) {  // acc[h] += sum_j w[h, j] * v[j]
          accumulate_tile<kHeadSize>(ah, sh, vrows, n);
        } else {
          accumulate_tile_runtime(ah, D, sh, vrows, n);
        }
      }
    }
  }
  store_output(p, seq, kv_head * G, G, D, acc, l, seq_len > 0 && ok);  // seq_len 0 or a bad block -> zeros
  return ok;
}

#if defined(__AVX512F__)
// Small heads (kD = 8 or 16, see attention_small_heads.h): attention of query row `seq` for all query
// heads of KV heads [kv_begin, kv_end) at once. Scores come from 16 x 16 register transposes of the
// K rows of those heads (each K element is loaded once, however many heads share it); softmax is
// attend_one's, per query head, and the V accumulation runs per KV head for all the query heads that
// share it. Online-softmax steps are tiles of kSmallTile tokens: with 8-16 multiply-adds per token and
// head, the per-tile bookkeeping (a horizontal max and sum, a rescale) would cost as much as the tile
// itself at attend_one's kTile.
constexpr int kSmallTile = 256;     // tokens per online-softmax step
constexpr int kPrefetchAhead = 2;   // K rows are requested this many 16-token sub-tiles ahead
alignas(64) constexpr float kZeroRow[small_heads::kColumns] = {};  // stands in for rows past the last token

// Element offset, in a cache, of token j's row of the item (its first KV head), j within a tile.
struct RunRows {  // block_size a multiple of 16: every 16-token run of a tile lies in one block
  const int64_t* base;  // [runs] offset of each run's first row
  int64_t stride;       // elements between consecutive tokens of a block
  int64_t operator()(int j) const { return base[j >> 4] + (j & 15) * stride; }
};
struct SlotRows {  // any block size: one slot per token
  const int64_t* slots;
  int64_t stride, col;
  int64_t operator()(int j) const { return slots[j] * stride + col; }
};

// One tile of n tokens of attend_small: scores, online softmax, V accumulation. `rows` locates them.
template <typename scalar_t, int kD, typename Rows>
void small_tile(const Params<scalar_t>& p, const Rows& rows, int n, int heads, int width, const float* q,
                float* acc, float* sc, float* m, float* l, float* vbuf) {
  namespace sh = small_heads;
  const int G = static_cast<int>(p.group);
  const int64_t row_bytes = width * sizeof(scalar_t);
  const scalar_t* krow[sh::kTokens];  // the current 16 tokens' K rows
  const float* vrow[kSmallTile];      // the tile's V rows as float
  for (int j = 0; j < n; ++j) {
    if constexpr (std::is_same_v<scalar_t, float>) {
      vrow[j] = p.value_cache + rows(j);
    } else {
      vrow[j] = vbuf + j * width;
    }
  }
  // sc[h, j] = scale * q[h] . k[j], 16 tokens by 16 columns (one or two KV heads) at a time
  for (int sub = 0; sub < n; sub += sh::kTokens) {
    const int ns = std::min(sh::kTokens, n - sub);
    // K rows of a later sub-tile into L1; this sub-tile's V rows (read after the tile's softmax) into L2
    const int ahead = sub + kPrefetchAhead * sh::kTokens;
    for (int j = ahead; j < std::min(n, ahead + sh::kTokens); ++j) prefetch_lines(p.key_cache + rows(j), row_bytes);
    for (int j = sub; j < sub + ns; ++j) prefetch_lines<2>(p.value_cache + rows(j), row_bytes);
    for (int j = 0; j < ns; ++j) krow[j] = p.key_cache + rows(sub + j);
    const scalar_t* zero_row = reinterpret_cast<const scalar_t*>(kZeroRow);
    for (int c0 = 0; c0 < width; c0 += sh::kColumns) {
      const int h0 = c0 / kD * G;  // first query head of the column tile
      sh::score_column_tile<kD>([&](int j) { return j < ns ? krow[j] + c0 : zero_row; },
                                std::min(sh::kColumns, width - c0), q + h0 * kD, G, sc + h0 * kSmallTile + sub,
                                kSmallTile);
    }
  }
  for (int h = 0; h < heads; ++h) {
    const float alpha = softmax_tile(sc + h * kSmallTile, n, m[h], l[h]);  // scores -> weights
    float* ah = acc + h * kD;
#pragma omp simd
    for (int d = 0; d < kD; ++d) ah[d] *= alpha;
  }
  if constexpr (!std::is_same_v<scalar_t, float>) {
    for (int j = 0; j < n; ++j) to_float(p.value_cache + rows(j), vbuf + j * width, width);
  }
  for (int k = 0; k < heads / G; ++k) {  // acc[h] += sum_j w[h, j] * v[j, KV head of h]
    const auto row = [&](int j) { return vrow[j] + k * kD; };
    float* ak = acc + k * G * kD;
    const float* wk = sc + k * G * kSmallTile;
    switch (G) {
      case 1: accumulate_group<kD, 1>(ak, wk, kSmallTile, row, n); break;
      case 2: accumulate_group<kD, 2>(ak, wk, kSmallTile, row, n); break;
      case 4: accumulate_group<kD, 4>(ak, wk, kSmallTile, row, n); break;
      case 8: accumulate_group<kD, 8>(ak, wk, kSmallTile, row, n); break;
      default:
        for (int g = 0; g < G; ++g) accumulate_group<kD, 1>(ak + g * kD, wk + g * kSmallTile, kSmallTile, row, n);
    }
  }
}

template <typename scalar_t, int kD>
bool attend_small(const Params<scalar_t>& p, int64_t seq, int64_t kv_begin, int64_t kv_end, float* scratch) {
  const int G = static_cast<int>(p.group);
  const int heads = static_cast<int>(kv_end - kv_begin) * G;   // query heads of this item
  const int width = static_cast<int>(kv_end - kv_begin) * kD;  // elements of a token row for them
  float* q = scratch;                  // [heads, kD] scaled query
  float* acc = q + heads * kD;         // [heads, kD] un-normalised output
  float* sc = acc + heads * kD;        // [heads, kSmallTile] scores, then weights, of the current tile
  float* m = sc + heads * kSmallTile;  // [heads] running max of the scores
  float* l = m + heads;                // [heads] running sum of exp(score - m)
  float* vbuf = l + heads;             // [kSmallTile, width] the tile's V rows as float (not for fp32)
  int64_t slots[kSmallTile];           // token slots (or, with RunRows, 16-token run offsets)

  const int64_t seq_len = p.seq_lens[seq];
  bool ok = true;
  if (seq_len > 0) {
    load_query(p, seq, kv_begin * G, heads, kD, q, m, l);
    std::fill(acc, acc + heads * kD, 0.0f);
    const int64_t row_stride = p.num_kv_heads * kD;
    const int64_t col = kv_begin * kD;
    const int32_t* table = p.block_tables + seq * p.bt_s0;
    BlockWalker walk = walker_of(p, seq, seq_len);
    for (int64_t t0 = 0; t0 < seq_len && ok; t0 += kSmallTile) {
      const int n = static_cast<int>(std::min<int64_t>(kSmallTile, seq_len - t0));
      if (p.block_size % small_heads::kTokens == 0) {
        for (int r = 0; r * small_heads::kTokens < n; ++r) {
          const int64_t token = t0 + r * small_heads::kTokens;
          const int64_t block = table[token / p.block_size * p.bt_s1];
          if (block < 0 || block >= p.num_blocks) {
            ok = false;
            break;
          }
          slots[r] = (block * p.block_size + token % p.block_size) * row_stride + col;
        }
        if (ok) small_tile<scalar_t, kD>(p, RunRows{slots, row_stride}, n, heads, width, q, acc, sc, m, l, vbuf);
      } else {
        ok = walk.next(n, slots, [](int64_t) {});
        if (ok) small_tile<scalar_t, kD>(p, SlotRows{slots, row_stride, col}, n, heads, width, q, acc, sc, m, l, vbuf);
      }
    }
  }
  store_output(p, seq, kv_begin * G, heads, kD, acc, l, seq_len > 0 && ok);
  return ok;
}
#endif

// Runs body(item, scratch) for items [0, num_items) on the OpenMP team: at most one thread per
// kMinWorkPerThread multiply-adds (a small call is done before a team of threads would have woken up,
// and on a loaded machine waiting for a second core costs far more), dynamic chunks of consecutive
// items. Throws if any item reported a block outside the cache.
template <typename Body>
void run_items(int64_t num_items, int num_threads, int64_t scratch_per_thread, int64_t num_blocks,
               const Body& body) {
  const int64_t chunk = std::max<int64_t>(1, num_items / (num_threads * 16));
  std::vector<float> scratch(scratch_per_thread * num_threads);
  std::atomic<int64_t> bad_item{-1};
#pragma omp parallel num_threads(num_threads)
  {
    float* my_scratch = scratch.data() + omp_get_thread_num() * scratch_per_thread;
#pragma omp for schedule(dynamic, chunk)
    for (int64_t item = 0; item < num_items; ++item) {
      if (!body(item, my_scratch)) bad_item.store(item);
    }
  }
  TORCH_CHECK(bad_item.load() < 0, "paged_attention: a block table names a block outside the cache (",
              num_blocks, " blocks)");
}

// PAGEDGEN_CPU_ATTENTION=general sends every head size to the general path (read at each call; for
// tests, which cover both paths on one machine, and for comparing them).
inline bool general_path_forced() {
  const char* v = std::getenv("PAGEDGEN_CPU_ATTENTION");
  return v != nullptr && std::strcmp(v, "general") == 0;
}

template <typename scalar_t, int kHeadSize>
void attend_all(const Params<scalar_t>& p, int64_t work) {
  constexpr int64_t kMinWorkPerThread = int64_t{1} << 17;
  const auto threads_for = [&](int64_t num_items) {
    return static_cast<int>(std::clamp<int64_t>(std::min<int64_t>(work / kMinWorkPerThread, num_items), 1,
                                                std::max(1, at::get_num_threads())));
  };
#if defined(__AVX512F__)
  if constexpr (kHeadSize == 8 || kHeadSize == 16) {
    if (!general_path_forced()) {
      // One item per row and group of KV heads: all KV heads of the row, unless there are too few rows
      // to share out, then the KV heads of one column tile (16 floats of a token row).
      const int64_t tile_heads = small_heads::kColumns / kHeadSize;
      const int64_t per_item =
          p.num_seqs >= 8 * threads_for(p.num_seqs) ? p.num_kv_heads : std::min(tile_heads, p.num_kv_heads);
      const int64_t chunks = (p.num_kv_heads + per_item - 1) / per_item;
      const int64_t heads = per_item * p.group, width = per_item * kHeadSize;
      const int64_t scratch = (2 * heads * kHeadSize + heads * kSmallTile + 2 * heads + kSmallTile * width + 15) / 16 * 16;
      run_items(p.num_seqs * chunks, threads_for(p.num_seqs * chunks), scratch, p.num_blocks,
                [&](int64_t item, float* s) {
                  const int64_t seq = item / chunks, kv_begin = item % chunks * per_item;
                  return attend_small<scalar_t, kHeadSize>(p, seq, kv_begin, std::min(kv_begin + per_item, p.num_kv_heads), s);
                });
      return;
    }
  }
#endif
  const int64_t num_items = p.num_seqs * p.num_kv_heads;  // item = seq * num_kv_heads + kv_head
  run_items(num_items, threads_for(num_items), scratch_floats(p.group, p.head_size), p.num_blocks,
            [&](int64_t item, float* s) {
              return attend_one<scalar_t, kHeadSize>(p, item / p.num_kv_heads, item % p.num_kv_heads, s);
            });
}

template <typename scalar_t>
void dispatch_head_size(const Params<scalar_t>& p, int64_t work) {
  switch (p.head_size) {
    case 8: return attend_all<scalar_t, 8>(p, work);
    case 16: return attend_all<scalar_t, 16>(p, work);
    case 32: return attend_all<scalar_t, 32>(p, work);
    case 64: return attend_all<scalar_t, 64>(p, work);
    case 128: return attend_all<scalar_t, 128>(p, work);
    case 256: return attend_all<scalar_t, 256>(p, work);
    default: return attend_all<scalar_t, 0>(p, work);  // any other head size: runtime loop bounds
  }
}

void paged_attention_cpu(const at::Tensor& out,                 // [num_seqs, num_heads, head_size]
                         const at::Tensor& query,         // [num_seqs, num_heads, head_size]
                         const at::Tensor& key_cache,     // [num_blocks, block_size, num_kv_heads, head_size]
                         const at::Tensor& value_cache,   // [num_blocks, block_size, num_kv_heads, head_size]
                         const at::Tensor& block_tables,  // [num_seqs, max_blocks] int32
                         const at::Tensor& seq_lens,      // [num_seqs] int32
                         double scale) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&out, &query, &key_cache, &value_cache, &block_tables, &seq_lens}) {
    TORCH_CHECK(t->device().is_cpu(), "paged_attention (CPU kernel): all tensors must be on the CPU, got ",
                t->device());
  }
  TORCH_CHECK(query.dim() == 3, "paged_attention: query must be [num_seqs, num_heads, head_size], got ",
              query.sizes());
  TORCH_CHECK(out.sizes() == query.sizes(), "paged_attention: out ", out.sizes(), " must match query ",
              query.sizes());
  TORCH_CHECK(key_cache.dim() == 4,
              "paged_attention: key_cache must be [num_blocks, block_size, num_kv_heads, head_size], got ",
              key_cache.sizes());
  TORCH_CHECK(value_cache.sizes() == key_cache.sizes(), "paged_attention: value_cache ", value_cache.sizes(),
              " must match key_cache ", key_cache.sizes());
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(),
              "paged_attention: key_cache and value_cache must be contiguous");
  const auto dtype = query.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "paged_attention: dtype must be float32, bfloat16 or float16, got ", dtype);
  TORCH_CHECK(out.scalar_type() == dtype && key_cache.scalar_type() == dtype && value_cache.scalar_type() == dtype,
              "paged_attention: out, query, key_cache and value_cache must share one dtype, got ", out.scalar_type(),
              ", ", dtype, ", ", key_cache.scalar_type(), ", ", value_cache.scalar_type());
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_size = query.size(2);
  const int64_t num_blocks = key_cache.size(0), block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_size, "paged_attention: cache head_size ", key_cache.size(3),
              " != query head_size ", head_size);
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "paged_attention: num_heads (", num_heads,
              ") must be a multiple of num_kv_heads (", num_kv_heads, ")");
  TORCH_CHECK(block_size > 0 && head_size > 0, "paged_attention: block_size and head_size must be positive");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.size(0) == num_seqs,
              "paged_attention: block_tables must be int32 [num_seqs=", num_seqs, ", max_blocks], got ",
              block_tables.scalar_type(), " ", block_tables.sizes());
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 && seq_lens.size(0) == num_seqs,
              "paged_attention: seq_lens must be int32 [num_seqs=", num_seqs, "], got ", seq_lens.scalar_type(), " ",
              seq_lens.sizes());
  if (num_seqs == 0 || num_heads == 0) return;

  const at::Tensor lens = seq_lens.contiguous();  // [num_seqs], tiny
  const int32_t* lens_ptr = lens.data_ptr<int32_t>();
  const int64_t max_len = block_tables.size(1) * block_size;
  int64_t total_tokens = 0;
  for (int64_t i = 0; i < num_seqs; ++i) {
    TORCH_CHECK(lens_ptr[i] <= max_len, "paged_attention: seq_lens[", i, "] = ", lens_ptr[i],
                " exceeds the block table's capacity of ", max_len, " tokens");
    total_tokens += std::max<int32_t>(lens_ptr[i], 0) + 8;  // + 8: a row's fixed cost, in tokens
  }
  const int64_t work = total_tokens * num_heads * head_size;  // ~ multiply-adds of the call

  auto launch = [&](auto zero) {  // zero: a value of the element type
    using scalar_t = decltype(zero);
    Params<scalar_t> p;
    p.out = out.data_ptr<scalar_t>();
    p.query = query.const_data_ptr<scalar_t>();
    p.key_cache = key_cache.const_data_ptr<scalar_t>();
    p.value_cache = value_cache.const_data_ptr<scalar_t>();
    p.block_tables = block_tables.const_data_ptr<int32_t>();
    p.seq_lens = lens_ptr;
    p.out_s0 = out.stride(0), p.out_s1 = out.stride(1), p.out_s2 = out.stride(2);
    p.q_s0 = query.stride(0), p.q_s1 = query.stride(1), p.q_s2 = query.stride(2);
    p.bt_s0 = block_tables.stride(0), p.bt_s1 = block_tables.stride(1);
    p.num_seqs = num_seqs, p.num_heads = num_heads, p.num_kv_heads = num_kv_heads, p.head_size = head_size;
    p.group = num_heads / num_kv_heads, p.block_size = block_size, p.num_blocks = num_blocks;
    p.scale = static_cast<float>(scale);
    dispatch_head_size(p, work);
  };
  // Like AT_DISPATCH_FLOATING_TYPES_AND2(kHalf, kBFloat16, ...) without the float64 instantiations.
  switch (dtype) {
    case at::kFloat: return launch(0.0f);
    case at::kBFloat16: return launch(c10::BFloat16(0.0f));
    default: return launch(c10::Half(0.0f));  // kHalf, checked above
  }
}

}  // namespace
}  // namespace pagedgen::cpu

TORCH_LIBRARY_IMPL(pagedgen, CPU, m) { m.impl("paged_attention", &pagedgen::cpu::paged_attention_cpu); }
