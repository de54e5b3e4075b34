// CPU kernel of pagedgen::paged_attention (schema in csrc/ops.cpp, oracle in
// pagedgen/ops/reference.py): decode attention of one query row per sequence over its paged KV cache.
//
// The engine also runs prefill through this kernel, one row per prompt token (seq_len = position + 1,
// the sequence's block table repeated), so a call may hold thousands of short rows as well as a few
// rows with 32k-token contexts. Hence:
//   * Work item = (row, kv_head). All query heads of one GQA group are handled together, so each K/V
//     row is read (and converted to float) once per group, not once per query head.
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

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
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

// Asks the caches for one K row and one V row of `head_size` elements.
template <typename scalar_t>
inline void prefetch_row(const scalar_t* k, const scalar_t* v, int head_size) {
  for (int64_t b = 0; b < head_size * static_cast<int64_t>(sizeof(scalar_t)); b += 64) {
    __builtin_prefetch(reinterpret_cast<const char*>(k) + b);
    __builtin_prefetch(reinterpret_cast<const char*>(v) + b);
  }
}

// Floats of per-thread scratch (padded to whole 64-byte lines so that threads never share a line).
inline int64_t scratch_floats(int64_t group, int64_t head_size) {
  const int64_t n = 2 * group * head_size + group * kTile + 2 * group + 3 * kTile * head_size;
  return (n + 15) / 16 * 16;
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

  scalar_t* out = p.out + seq * p.out_s0 + kv_head * G * p.out_s1;  // out[seq, group heads]
  const int64_t seq_len = p.seq_lens[seq];
  bool ok = true;
  if (seq_len > 0) {
    const scalar_t* query = p.query + seq * p.q_s0 + kv_head * G * p.q_s1;
    for (int h = 0; h < G; ++h) {
      for (int d = 0; d < D; ++d) q[h * D + d] = static_cast<float>(query[h * p.q_s1 + d * p.q_s2]) * p.scale;
      m[h] = -std::numeric_limits<float>::infinity();
      l[h] = 0.0f;
    }
    std::fill(acc, acc + G * D, 0.0f);

    const int32_t* table = p.block_tables + seq * p.bt_s0;  // block_tables[seq, :]
    const int64_t row_stride = p.num_kv_heads * D;           // elements between tokens in a block
    int64_t logical = 0, offset = 0, base = 0, next_base = -1;  // base: first row of the current block
    for (int64_t t0 = 0; t0 < seq_len && ok; t0 += kTile) {
      const int n = static_cast<int>(std::min<int64_t>(kTile, seq_len - t0));
      // The tile's K/V rows for this KV head: token t is row t % bs of block block_table[t // bs].
      for (int j = 0; j < n; ++j) {
        if (offset == 0) {
          const int64_t block = table[logical * p.bt_s1];
          if (block < 0 || block >= p.num_blocks) {
            ok = false;
            break;
          }
          base = block * p.block_size;
          // The next block lies anywhere in the cache, where no hardware prefetcher looks: request
          // its rows one per token of this block (all at once would stall on the line-fill buffers).
          next_base = -1;
          if ((logical + 1) * p.block_size < seq_len) {
            const int64_t next = table[(logical + 1) * p.bt_s1];
            if (next >= 0 && next < p.num_blocks) next_base = next * p.block_size;
          }
        }
        if (next_base >= 0) {
          const int64_t next_row = (next_base + offset) * row_stride + kv_head * D;
          prefetch_row(p.key_cache + next_row, p.value_cache + next_row, D);
        }
        const int64_t row = (base + offset) * row_stride + kv_head * D;
        krows[j] = row_as_float(p.key_cache + row, kbuf + j * D, D);
        vrows[j] = row_as_float(p.value_cache + row, vbuf + j * D, D);
        if (++offset == p.block_size) {
          offset = 0;
          ++logical;
        }
      }
      if (!ok) break;
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
  const bool valid = seq_len > 0 && ok;  // seq_len 0 (or a bad block) -> zeros
  for (int h = 0; h < G; ++h) {
    const float inv = valid ? 1.0f / l[h] : 0.0f;
    for (int d = 0; d < D; ++d) {
      out[h * p.out_s1 + d * p.out_s2] = static_cast<scalar_t>(valid ? acc[h * D + d] * inv : 0.0f);
    }
  }
  return ok;
}

template <typename scalar_t, int kHeadSize>
void attend_all(const Params<scalar_t>& p, int64_t work) {
  const int64_t num_items = p.num_seqs * p.num_kv_heads;  // item = seq * num_kv_heads + kv_head
  // One thread per kMinWorkPerThread multiply-adds at most: a small call is done before a team of
  // threads would have woken up (and on a loaded machine, waiting for a second core costs far more).
  constexpr int64_t kMinWorkPerThread = int64_t{1} << 17;
  const int num_threads = static_cast<int>(std::clamp<int64_t>(
      std::min<int64_t>(work / kMinWorkPerThread, num_items), 1, std::max(1, at::get_num_threads())));
  const int64_t chunk = std::max<int64_t>(1, num_items / (num_threads * 16));
  const int64_t per_thread = scratch_floats(p.group, p.head_size);
  std::vector<float> scratch(per_thread * num_threads);
  std::atomic<int64_t> bad_seq{-1};

#pragma omp parallel num_threads(num_threads)
  {
    const int tid = omp_get_thread_num();
    float* my_scratch = scratch.data() + tid * per_thread;
#pragma omp for schedule(dynamic, chunk)
    for (int64_t item = 0; item < num_items; ++item) {
      const int64_t seq = item / p.num_kv_heads, kv_head = item % p.num_kv_heads;
      if (!attend_one<scalar_t, kHeadSize>(p, seq, kv_head, my_scratch)) bad_seq.store(seq);
    }
  }
  const int64_t bad = bad_seq.load();
  TORCH_CHECK(bad < 0, "paged_attention: block_tables[", bad, "] names a block outside the cache (",
              p.num_blocks, " blocks)");
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
