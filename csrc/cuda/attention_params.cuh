// Plain-C++ interface between the torch-facing op (paged_attention.cu) and the attention kernels
// (attention_fast.cuh, attention_generic.cu, attention_reduce.cu). No torch headers here, so the
// kernel translation units compile without them.
//
// Varlen rows (csrc/ops.cpp): query row r belongs to the sequence s with query_start_loc[s] <= r <
// query_start_loc[s + 1] (found by a binary search in the kernel: query_start_loc stays on the GPU),
// sits at position p = seq_lens[s] - q_len + (r - query_start_loc[s]) and attends over the positions
// [lo, p] of its sequence, lo = 0 or, with a sliding window, max(0, p - window + 1) (row_span below).
//
// Work split (PagedAttention, Kwon et al. SOSP 2023, section 4; the same op design as vLLM's v1/v2):
//   one thread block per (query row, KV head, chunk of its query heads, partition of the context).
//   * single pass (partition_size == 0): one partition covers the whole span and the block writes
//     `out` directly;
//   * split-K (partition_size > 0): partition k covers the positions [k * P, (k + 1) * P) of the
//     row's span (absolute positions, so the window's start cuts only the first partitions) and
//     writes its softmax-normalised partial output, its running max and its sum of exponentials;
//     attention_reduce.cu then combines the partitions of each (row, head) into `out`.
// Softmax runs in the log2 domain: logits are q.k * scale * log2(e), probabilities exp2(logit - max).
// Partitions outside the span write nothing; the reduce kernel never reads them.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace pagedgen {

// Query heads one block serves at most. A group of G = num_heads / num_kv_heads query heads shares
// one KV head; with G <= kMaxHeadsPerBlock a block reads its KV head's cache once for the whole
// group, larger groups are split into ceil(G / kMaxHeadsPerBlock) chunks (one block each).
constexpr int kMaxHeadsPerBlock = 8;
// Threads of every attention block (4 warps).
constexpr int kAttentionThreads = 128;
// Split-K sizing (paged_attention.cu): when fewer than kTargetBlocksPerSM blocks per multiprocessor
// would run without it, contexts are cut into partitions of at least kMinPartitionSize tokens.
constexpr int kTargetBlocksPerSM = 4;
constexpr int kMinPartitionSize = 256;

struct AttentionParams {
  void* out;               // [num_rows, num_heads, head_size] scalar_t, rows strided (out_stride_*)
  float* tmp_out;          // [num_rows, num_heads, max_partitions, head_size] (split-K only)
  float* max_logits;       // [num_rows, num_heads, max_partitions] log2-domain max (split-K only)
  float* exp_sums;         // [num_rows, num_heads, max_partitions] sum of exp2 (split-K only)
  const void* query;       // [num_rows, num_heads, head_size] scalar_t, rows strided (q_stride_*)
  const void* key_cache;   // [num_blocks, block_size, num_kv_heads, head_size] contiguous
  const void* value_cache; // [num_blocks, block_size, num_kv_heads, head_size] contiguous
  const int* block_tables; // [num_seqs, max_blocks_per_seq], rows strided (block_table_stride)
  const int* seq_lens;     // [num_seqs] context length of each sequence after this step
  const int* query_start_loc;  // [num_seqs + 1] first query row of each sequence
  int64_t q_stride_row, q_stride_head;      // in elements
  int64_t out_stride_row, out_stride_head;  // in elements
  int64_t block_table_stride;               // in elements
  int64_t kv_token_stride;                  // num_kv_heads * head_size
  int64_t num_blocks;                       // of the caches: a block id outside [0, num_blocks) traps
  int num_rows, num_seqs, num_heads, num_kv_heads, head_size;
  int sliding_window;    // 0: none
  int group_size;        // num_heads / num_kv_heads
  int heads_per_block;   // query heads per block (<= kMaxHeadsPerBlock)
  int num_head_chunks;   // ceil(group_size / heads_per_block)
  int block_size;
  int block_size_log2;   // log2(block_size) when a power of two, else -1
  int max_blocks_per_seq;
  int partition_size;    // 0: single pass; else tokens per partition
  int max_partitions;    // gridDim.z (1 for single pass)
  float scale_log2;      // scale * log2(e)
};

// Fills the work split of `p` (heads_per_block, num_head_chunks, block_size_log2, partition_size,
// max_partitions) from its sizes (num_rows, num_kv_heads, group_size, block_size,
// max_blocks_per_seq). `fast`: the fast kernel runs (it is built for 1, 2, 4 or 8 heads per block).
//
// Without split-K there is one block per (query row, KV head, head chunk). When that leaves the GPU
// short of kTargetBlocksPerSM blocks per multiprocessor (small batches: one 32k-token sequence has
// only num_kv_heads of them), every context is cut into partitions so that about that many blocks
// run. The longest context is bounded by the block table's width (seq_lens stays on the GPU; reading
// it would sync), so a wide table makes partitions longer, never more numerous than needed. Large
// batches (and prefill chunks, one block row per prompt token) run single pass.
inline void plan_attention(AttentionParams& p, bool fast, int num_sms) {
  auto ceil_div = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  const int capped = p.group_size < kMaxHeadsPerBlock ? p.group_size : kMaxHeadsPerBlock;
  int pow2 = 1;
  while (pow2 < capped) pow2 *= 2;
  p.heads_per_block = fast ? pow2 : capped;
  p.num_head_chunks = int(ceil_div(p.group_size, p.heads_per_block));
  p.block_size_log2 = -1;
  for (int b = 0; b < 31; ++b)
    if (p.block_size == (1 << b)) p.block_size_log2 = b;

  const int64_t max_context = int64_t(p.max_blocks_per_seq) * p.block_size;
  const int64_t base_blocks = int64_t(p.num_rows) * p.num_kv_heads * p.num_head_chunks;
  const int64_t target_blocks = int64_t(kTargetBlocksPerSM) * num_sms;
  p.partition_size = 0;
  p.max_partitions = 1;
  if (base_blocks < target_blocks && max_context > kMinPartitionSize) {
    int64_t size = ceil_div(ceil_div(max_context, ceil_div(target_blocks, base_blocks)), 64) * 64;
    size = size < kMinPartitionSize ? kMinPartitionSize : size;
    if (size < max_context) {
      p.partition_size = int(size);
      p.max_partitions = int(ceil_div(max_context, size));
    }
  }
}

// Grid shared by the fast and the generic kernel: x = query row (up to 2^31 - 1 of them),
// y = KV head * num_head_chunks + chunk, z = partition.
inline dim3 attention_grid(const AttentionParams& p) {
  return dim3(p.num_rows, p.num_kv_heads * p.num_head_chunks, p.max_partitions);
}

// Head sizes with a fast kernel (launch_attention_fast).
inline bool has_fast_kernel(int head_size) {
  return head_size == 64 || head_size == 80 || head_size == 96 || head_size == 112 || head_size == 128 ||
         head_size == 256;
}

// Fast path for head sizes 64, 80, 96, 112, 128 and 256 (16-byte aligned rows): returns false,
// launching nothing, for any other head size. scalar_t: float, __half or __nv_bfloat16.
template <typename scalar_t>
bool launch_attention_fast(const AttentionParams& p, cudaStream_t stream);

// Any head size, any alignment (scalar loads); slower. Needs attention_generic_smem_bytes(p)
// bytes of dynamic shared memory, which the caller checks against the device limit.
template <typename scalar_t>
void launch_attention_generic(const AttentionParams& p, cudaStream_t stream);
size_t attention_generic_smem_bytes(const AttentionParams& p);

// Combines the split-K partitions into `out` (only when p.partition_size > 0).
template <typename scalar_t>
void launch_attention_reduce(const AttentionParams& p, cudaStream_t stream);

}  // namespace pagedgen
