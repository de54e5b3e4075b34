// CPU kernel of pagedgen::paged_attention (schema in csrc/ops.cpp, oracle in
// pagedgen/ops/reference.py): varlen attention of prefill chunks and decode rows over the paged KV
// cache, in one call.
//
// A call holds S sequences; rows query_start_loc[s] .. query_start_loc[s + 1] - 1 of query are the new
// tokens of sequence s, at positions seq_lens[s] - q_len .. seq_lens[s] - 1, and each row attends over
// the cached tokens at positions <= its own (and > position - sliding_window with a window), read
// through block_tables[s]. So a call may hold thousands of prompt rows as well as many decode rows
// with 32k-token contexts. Hence:
//   * Work item = (block of consecutive rows of one sequence, KV head or group of KV heads): one row
//     for a decode sequence, up to R rows of a prompt chunk (tiled prefill: the rows share each K/V
//     tile they read, attention_general.h / attention_small.h). All query heads of a GQA group are
//     handled together, so each K/V row is read (and converted to float) once per group and block.
//     On the general path a short block (rows x group < kTransposedPairs: the k + 1 rows of a
//     speculative verify step, a short chunk) is a "streamed" block, laid out and read like a decode
//     row (streamed_block, attention_general.h).
//   * Two paths: head sizes 8 and 16 on AVX-512 and AVX2 + FMA builds take the small-head path
//     (attention_small.h: W x W in-register K transposes, W = 16 lanes with AVX-512 and 8 with AVX2,
//     256-token softmax tiles); every other head size, and head sizes 8 and 16 on other builds, the
//     general path (attention_general.h: 32-token tiles). PAGEDGEN_CPU_ATTENTION=general forces the
//     general path.
//   * Batch invariance (issue 13): a row's result is a function of its query, its position, its
//     context and the window only. Tiles are aligned to absolute positions, and every per-row loop
//     computes each value by the same operations whatever the rows around it (attention_math.h), so
//     prefill in one chunk, in chunks of any size and token-by-token decode give the same bits, as do
//     one or two threads and any mix of other sequences in the call.
//   * OpenMP `for` with dynamic scheduling over the items: item costs differ widely (prefill rows grow
//     with their position), and a static split would leave one core idle. Chunks are runs of
//     consecutive items, so neighbouring items of a sequence re-read the same blocks from cache. The
//     team has at most one thread per kMinWorkPerThread multiply-adds: small calls run inline.
//   * Decode rows read each K/V row once, from blocks scattered over the cache where the hardware
//     prefetchers do not follow: a decode item reads its block table two tiles ahead and prefetches
//     that tile's rows a few lines per step of its inner loops (TilePrefetch, attention_common.h),
//     and its last tiles prefetch the first ones of the next item its thread runs (run_items says
//     which); so do short (verify) blocks. Prefill blocks re-read each tile for many rows; the
//     walker's next-block prefetch does.
//   * Online softmax (Milakov & Gimelshein 2018, as in FlashAttention): per-thread scratch is
//     O(rows * heads * (head_size + tile)) floats whatever the context length, a buffer per thread
//     kept across calls. No allocation, no ATen call per item.
//   * float32 accumulation and softmax whatever the cache dtype; bf16 caches on AVX512-BF16 builds
//     score with vdpbf16ps from the bf16 query and K as stored (score_rows_bf16, attention_math.h).
//   * The 1-byte KV cache (pagedgen::paged_attention_quantized, kv_cache_dtype int8 / fp8): the same
//     kernel templated on the cache's element (Params<scalar_t, cache_t>, cache_t a 1-byte code
//     instead of scalar_t), so every case of the general path serves both (prefill blocks, decode
//     rows and verify blocks with their prefetch, GQA, windows, any head size, the threading, batch
//     invariance). K and V rows are read as float(code) (kv_codes.h: widened, or placed as fp16 bits,
//     in registers; in place for decode rows, into the tile buffers for prefill blocks) and each
//     token's scales applied once per token and head: q . k = s_k (q . code) on the scores, the
//     weights times s_v before the V accumulation (attention_general.h). So a value costs the read of
//     one byte and a conversion as cheap as bf16's, nothing is copied per step, and the result is
//     float32 attention over float(code) * float(scale) up to float rounding (the reference:
//     kv_quant.paged_attention_quantized, in float32). Head sizes 8 and 16 take the general path too
//     (the small-head path reads K rows in its register transposes and has no 1-byte read yet).
//
// Strides: query and out are read/written through all three of their strides (they may be views of a
// larger qkv or output tensor; no copy is made), block_tables through both of its strides.
// key_cache and value_cache must be contiguous.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/library.h>

#include "attention_common.h"
#include "attention_general.h"
#include "attention_math.h"
#include "attention_small.h"
#include "../op_checks.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace pagedgen::cpu {
namespace {

// Query heads (rows x group) of one prefill item, at most: R = max(1, kItemHeads / group) rows, at
// most kMaxItemRows (each K/V tile is converted once for those R x group (row, head) pairs; measured
// on 1,024-token prompts, head sizes 64 and 128, more rows per item pay up to about 64 pairs). The
// small-head path's items hold all KV heads of a row: kSmallItemHeads query heads per item; a
// sequence with few new rows (a speculative verify step) is one item of up to kSmallShortHeads
// (each K tile transposed once for all its rows; measured on stories260K's shape, 8 sequences of
// 100-300 tokens: 5-9 rows 6-11% faster than in items of 4 rows).
constexpr int64_t kItemHeads = 64;
constexpr int64_t kMaxItemRows = 32;
constexpr int64_t kSmallItemHeads = 32;
constexpr int64_t kSmallShortHeads = 80;

// The call's rows cut into blocks of at most max_rows rows of one sequence each, or one block for a
// sequence of at most short_rows rows (rows at a negative position, whose sequence has fewer context
// tokens than new ones, are left out: the caller zeroes them).
std::vector<RowBlock> row_blocks(const int32_t* qsl, const int32_t* lens, int64_t num_seqs, int64_t max_rows,
                                 int64_t short_rows = 0) {
  std::vector<RowBlock> blocks;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = qsl[s + 1] - qsl[s];
    const int64_t first_pos = static_cast<int64_t>(lens[s]) - q_len;
    const int64_t skip = std::clamp<int64_t>(-first_pos, 0, q_len);  // rows at negative positions
    const int64_t step = q_len - skip <= short_rows ? short_rows : max_rows;
    for (int64_t i = skip; i < q_len; i += step) {
      blocks.push_back(RowBlock{s, qsl[s] + i, first_pos + i, static_cast<int>(std::min(step, q_len - i))});
    }
  }
  return blocks;
}

// This thread's scratch buffer of at least n floats, kept across calls (one per thread of the team).
float* thread_scratch(int64_t n) {
  thread_local std::vector<float> scratch;
  if (static_cast<int64_t>(scratch.size()) < n) scratch.resize(n);
  return scratch.data();
}

// Runs body(item, scratch, next_is_mine) for items [0, num_items) on the OpenMP team (next_is_mine:
// this thread runs item + 1 right after, the same chunk): at most one thread per
// kMinWorkPerThread multiply-adds (a small call is done before a team of threads would have woken up,
// and on a loaded machine waiting for a second core costs far more), dynamic chunks of consecutive
// items. Each thread's scratch is a buffer kept across calls. Throws if any item reported a block
// outside the cache.
template <typename Body>
void run_items(int64_t num_items, int num_threads, int64_t scratch_floats, int64_t num_blocks, const Body& body) {
  const int64_t chunk = std::max<int64_t>(1, num_items / (num_threads * 16));
  std::atomic<int64_t> bad_item{-1};
#pragma omp parallel num_threads(num_threads)
  {
    float* my_scratch = thread_scratch(scratch_floats);
#pragma omp for schedule(dynamic, chunk)
    for (int64_t item = 0; item < num_items; ++item) {
      // next_is_mine: item + 1 is in the same chunk, so this thread runs it next
      if (!body(item, my_scratch, item + 1 < num_items && (item + 1) % chunk != 0)) bad_item.store(item);
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

template <typename scalar_t, int kHeadSize, typename cache_t>
void attend_all(const Params<scalar_t, cache_t>& p, const int32_t* qsl, const int32_t* lens, int64_t num_seqs, int64_t work) {
  constexpr int64_t kMinWorkPerThread = int64_t{1} << 17;
  const auto threads_for = [&](int64_t num_items) {
    return static_cast<int>(std::clamp<int64_t>(std::min<int64_t>(work / kMinWorkPerThread, num_items), 1,
                                                std::max(1, at::get_num_threads())));
  };
#if defined(PAGEDGEN_SMALL_HEADS)
  if constexpr ((kHeadSize == 8 || kHeadSize == 16) && std::is_same_v<cache_t, scalar_t>) {  // not a 1-byte cache
    if (!general_path_forced()) {
      // One item per row block and group of KV heads: all KV heads of the rows, unless there are too
      // few blocks to share out, then the KV heads of one column tile (attention_small_heads.h).
      const int64_t tile_heads = small_heads::tile_columns<kHeadSize>() / kHeadSize;
      const int64_t max_rows = std::clamp<int64_t>(kSmallItemHeads / (p.num_kv_heads * p.group), 1, kMaxItemRows);
      const int64_t short_rows = std::clamp<int64_t>(kSmallShortHeads / (p.num_kv_heads * p.group), 1, kMaxItemRows);
      const std::vector<RowBlock> blocks = row_blocks(qsl, lens, num_seqs, max_rows, short_rows);
      const int64_t nb = static_cast<int64_t>(blocks.size());
      const int64_t per_item = nb >= 8 * threads_for(nb) ? p.num_kv_heads : std::min(tile_heads, p.num_kv_heads);
      const int64_t chunks = (p.num_kv_heads + per_item - 1) / per_item;
      const int64_t scratch = small_scratch_floats(std::max(max_rows, short_rows), per_item * p.group, per_item * kHeadSize,
                                                   kHeadSize);
      run_items(nb * chunks, threads_for(nb * chunks), scratch, p.num_blocks,
                [&](int64_t item, float* s, bool next_is_mine) {
                  const int64_t kv_begin = item % chunks * per_item;
                  // the next item's rows with the same KV heads (all of them: one item per row block)
                  const RowBlock* then = next_is_mine && chunks == 1 ? &blocks[item + 1] : nullptr;
                  return attend_small_rows<scalar_t, kHeadSize>(p, blocks[item / chunks], kv_begin,
                                                                std::min(kv_begin + per_item, p.num_kv_heads), s, then);
                });
      return;
    }
  }
#endif
  const int64_t max_rows = std::clamp<int64_t>(kItemHeads / p.group, 1, kMaxItemRows);
  const std::vector<RowBlock> blocks = row_blocks(qsl, lens, num_seqs, max_rows);
  const int64_t nb = static_cast<int64_t>(blocks.size());
  // Items: a prefill block per KV head (its rows x group already share each tile); decode rows and
  // short blocks (streamed_block: the rows of a speculative verify step) with all their KV heads when
  // there are enough blocks to share out, else one KV head each. The prefill blocks of a sequence are
  // listed KV head after KV head, so that consecutive items read the same head's K/V prefix (still in
  // L2 from the item before) rather than all heads' in turn.
  const int64_t decode_heads = nb >= 8 * threads_for(nb) ? p.num_kv_heads : 1;
  struct Item {
    int64_t block, kv_begin, kv_end;
  };
  std::vector<Item> items;
  items.reserve(nb * p.num_kv_heads);
  for (int64_t i = 0; i < nb;) {
    if (streamed_block(blocks[i].rows, p.group)) {
      for (int64_t k = 0; k < p.num_kv_heads; k += decode_heads) {
        items.push_back({i, k, std::min(k + decode_heads, p.num_kv_heads)});
      }
      ++i;
      continue;
    }
    int64_t end = i + 1;  // the sequence's prefill blocks [i, end)
    while (end < nb && blocks[end].seq == blocks[i].seq && !streamed_block(blocks[end].rows, p.group)) ++end;
    for (int64_t k = 0; k < p.num_kv_heads; ++k) {
      for (int64_t j = i; j < end; ++j) items.push_back({j, k, k + 1});
    }
    i = end;
  }
  const int64_t scratch = general_scratch_floats(max_rows, 1, p.group, p.head_size);
  const int64_t streamed_rows = std::min(max_rows, std::max<int64_t>(1, (kTransposedPairs - 1) / p.group));
  const int64_t scratch_decode = general_scratch_floats(streamed_rows, decode_heads, p.group, p.head_size);
  const int64_t num_items = static_cast<int64_t>(items.size());
  run_items(num_items, threads_for(num_items), std::max(scratch, scratch_decode), p.num_blocks,
            [&](int64_t item, float* s, bool next_is_mine) {
              const Item& it = items[item];
              const Item* then = next_is_mine ? &items[item + 1] : nullptr;
              const bool same_heads = then != nullptr && then->kv_begin == it.kv_begin && then->kv_end == it.kv_end;
              return attend_rows<scalar_t, kHeadSize>(p, blocks[it.block], it.kv_begin, it.kv_end, s,
                                                      same_heads ? &blocks[then->block] : nullptr);
            });
}

template <typename scalar_t, typename cache_t>
void dispatch_head_size(const Params<scalar_t, cache_t>& p, const int32_t* qsl, const int32_t* lens, int64_t num_seqs,
                        int64_t work) {
  switch (p.head_size) {
    case 8: return attend_all<scalar_t, 8, cache_t>(p, qsl, lens, num_seqs, work);
    case 16: return attend_all<scalar_t, 16, cache_t>(p, qsl, lens, num_seqs, work);
    case 32: return attend_all<scalar_t, 32, cache_t>(p, qsl, lens, num_seqs, work);
    case 64: return attend_all<scalar_t, 64, cache_t>(p, qsl, lens, num_seqs, work);
    case 128: return attend_all<scalar_t, 128, cache_t>(p, qsl, lens, num_seqs, work);
    case 256: return attend_all<scalar_t, 256, cache_t>(p, qsl, lens, num_seqs, work);
    default: return attend_all<scalar_t, 0, cache_t>(p, qsl, lens, num_seqs, work);  // run-time loop bounds
  }
}

// The checked call of either op (sizes, dtypes and devices checked by csrc/op_checks.cpp): the values
// of query_start_loc and seq_lens, then the kernel. key_scales / value_scales: nullptr for a float
// cache; with them (a 1-byte cache) every block id a row will read is checked here too, before any
// work (the float op reports one as its items read it).
void run_attention(const char* op, const checks::AttentionSizes& sz, const at::Tensor& out, const at::Tensor& query,
                   const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor* key_scales,
                   const at::Tensor* value_scales, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                   const at::Tensor& query_start_loc, double scale, int64_t sliding_window) {
  const int64_t num_tokens = sz.num_tokens, num_heads = sz.num_heads, head_size = sz.head_size;
  const int64_t num_blocks = sz.num_blocks, block_size = sz.block_size, num_kv_heads = sz.num_kv_heads;
  const int64_t num_seqs = sz.num_seqs;

  // The values (shared checks read none): query_start_loc and seq_lens here, block ids as items read them.
  const at::Tensor lens_t = seq_lens.contiguous(), qsl_t = query_start_loc.contiguous();  // [num_seqs (+ 1)], tiny
  const int32_t* lens = lens_t.const_data_ptr<int32_t>();
  const int32_t* qsl = qsl_t.const_data_ptr<int32_t>();
  TORCH_CHECK(qsl[0] == 0 && qsl[num_seqs] == num_tokens, op, ": query_start_loc must run from 0 to ",
              "num_tokens=", num_tokens, ", got ", qsl[0], " .. ", qsl[num_seqs]);
  const int64_t capacity = block_tables.size(1) * block_size;
  const int32_t* table = block_tables.const_data_ptr<int32_t>();
  int64_t attended = 0;  // (row, token) pairs of the call
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(qsl[s + 1] >= qsl[s], op, ": query_start_loc must not decrease, got ", qsl[s], " then ",
                qsl[s + 1], " at sequence ", s);
    TORCH_CHECK(lens[s] >= 0 && lens[s] <= capacity, op, ": seq_lens[", s, "] = ", lens[s],
                " is outside [0, ", capacity, "], the block table's capacity");
    const int64_t q_len = qsl[s + 1] - qsl[s], len = lens[s];
    const int64_t span = sliding_window > 0 ? std::min<int64_t>(len, sliding_window) : len;
    attended += std::min(q_len, len) * (span + 8);  // + 8: a row's fixed cost, in tokens
    if (key_scales != nullptr && q_len > 0) {  // the blocks of [first row's window start, len)
      const int64_t first = window_start(std::max<int64_t>(0, len - q_len), sliding_window) / block_size;
      for (int64_t j = first; j * block_size < len; ++j) {
        const int64_t id = table[s * block_tables.stride(0) + j * block_tables.stride(1)];
        TORCH_CHECK(id >= 0 && id < num_blocks, op, ": block_tables[", s, ", ", j, "] = ", id,
                    " is outside the cache's blocks [0, ", num_blocks, ")");
      }
    }
  }
  if (num_tokens == 0 || num_heads == 0) return;
  const int64_t work = attended * num_heads * head_size;  // ~ multiply-adds of the call

  dispatch_float_types(query.scalar_type(), op, [&](auto zero) {
    using scalar_t = decltype(zero);
    const auto launch = [&](auto cache_zero) {
      using cache_t = decltype(cache_zero);
      Params<scalar_t, cache_t> p;
      p.out = out.data_ptr<scalar_t>();
      p.query = query.const_data_ptr<scalar_t>();
      p.key_cache = static_cast<const cache_t*>(key_cache.const_data_ptr());
      p.value_cache = static_cast<const cache_t*>(value_cache.const_data_ptr());
      if (key_scales != nullptr) {
        p.key_scales = key_scales->const_data_ptr<c10::BFloat16>();
        p.value_scales = value_scales->const_data_ptr<c10::BFloat16>();
      }
      p.block_tables = table;
      p.out_s0 = out.stride(0), p.out_s1 = out.stride(1), p.out_s2 = out.stride(2);
      p.q_s0 = query.stride(0), p.q_s1 = query.stride(1), p.q_s2 = query.stride(2);
      p.bt_s0 = block_tables.stride(0), p.bt_s1 = block_tables.stride(1);
      p.num_heads = num_heads, p.num_kv_heads = num_kv_heads, p.head_size = head_size;
      p.group = num_heads / num_kv_heads, p.block_size = block_size, p.num_blocks = num_blocks;
      p.sliding_window = sliding_window;
      p.scale = static_cast<float>(scale);
      // Rows at a negative position (a sequence with fewer context tokens than new ones, e.g. the
      // seq_len 0 padding rows of a CUDA-graph batch) attend to nothing: zeros.
      for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t q_len = qsl[s + 1] - qsl[s];
        for (int64_t i = 0; i < q_len - lens[s]; ++i) {
          for (int64_t h = 0; h < num_heads; ++h) {
            scalar_t* o = p.out + (qsl[s] + i) * p.out_s0 + h * p.out_s1;
            for (int64_t d = 0; d < head_size; ++d) o[d * p.out_s2] = scalar_t(0.0f);
          }
        }
      }
      dispatch_head_size(p, qsl, lens, num_seqs, work);
    };
    switch (key_cache.scalar_type()) {
      case at::kChar: return launch(int8_t{});
      case at::kFloat8_e4m3fn: return launch(c10::Float8_e4m3fn{});
      case at::kFloat8_e5m2: return launch(c10::Float8_e5m2{});
      default: return launch(scalar_t{});  // a float cache of the query's dtype (checked)
    }
  });
}

void paged_attention_cpu(const at::Tensor& out,              // [num_tokens, num_heads, head_size]
                         const at::Tensor& query,            // [num_tokens, num_heads, head_size]
                         const at::Tensor& key_cache,        // [num_blocks, block_size, num_kv_heads, head_size]
                         const at::Tensor& value_cache,      // [num_blocks, block_size, num_kv_heads, head_size]
                         const at::Tensor& block_tables,     // [num_seqs, max_blocks] int32
                         const at::Tensor& seq_lens,         // [num_seqs] int32
                         const at::Tensor& query_start_loc,  // [num_seqs + 1] int32
                         double scale, int64_t sliding_window) {
  const checks::AttentionSizes sz = checks::paged_attention(out, query, key_cache, value_cache, block_tables, seq_lens,
                                                            query_start_loc, sliding_window, c10::DeviceType::CPU);
  run_attention("paged_attention", sz, out, query, key_cache, value_cache, nullptr, nullptr, block_tables, seq_lens,
                query_start_loc, scale, sliding_window);
}

// pagedgen::paged_attention_quantized: paged_attention over the 1-byte cache, its codes and scales
// read by the kernel itself (the general path for every head size).
void paged_attention_quantized_cpu(const at::Tensor& out,    // [num_tokens, num_heads, head_size]
                                   const at::Tensor& query,  // [num_tokens, num_heads, head_size]
                                   const at::Tensor& key_cache,     // [num_blocks, block_size, num_kv_heads, head_size] codes
                                   const at::Tensor& value_cache,   // the same
                                   const at::Tensor& key_scales,    // [num_blocks, block_size, num_kv_heads] bf16
                                   const at::Tensor& value_scales,  // the same
                                   const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                   const at::Tensor& query_start_loc, double scale, int64_t sliding_window) {
  const checks::AttentionSizes sz =
      checks::paged_attention_quantized(out, query, key_cache, value_cache, key_scales, value_scales, block_tables,
                                        seq_lens, query_start_loc, sliding_window, c10::DeviceType::CPU);
  run_attention("paged_attention_quantized", sz, out, query, key_cache, value_cache, &key_scales, &value_scales,
                block_tables, seq_lens, query_start_loc, scale, sliding_window);
}

}  // namespace
}  // namespace pagedgen::cpu

TORCH_LIBRARY_IMPL(pagedgen, CPU, m) {
  m.impl("paged_attention", &pagedgen::cpu::paged_attention_cpu);
  m.impl("paged_attention_quantized", &pagedgen::cpu::paged_attention_quantized_cpu);
}
