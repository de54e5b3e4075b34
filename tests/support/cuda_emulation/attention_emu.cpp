// C entry point running pagedgen's paged-attention kernels under emulation.h, for
// tests/ops/test_cuda_emulation.py (ctypes). Mirrors csrc/cuda/paged_attention.cu's host side: the same
// AttentionParams, plan_attention and kernel choice; only the launches differ.
#include "emulation.h"

#include "attention_fast.cuh"
#include "attention_generic.cu"
#include "attention_reduce.cu"

namespace pagedgen {
namespace {

template <typename scalar_t, int kHeadSize, int kHeads>
void run_fast(const AttentionParams& p) {
  pagedgen_emu::launch(attention_grid(p), kAttentionThreads,
                       [&] { fast::attention_fast_kernel<scalar_t, kHeadSize, kHeads>(p); });
}

template <typename scalar_t, int kHeadSize>
void run_fast_heads(const AttentionParams& p) {
  switch (p.heads_per_block) {
    case 1: run_fast<scalar_t, kHeadSize, 1>(p); break;
    case 2: run_fast<scalar_t, kHeadSize, 2>(p); break;
    case 4: run_fast<scalar_t, kHeadSize, 4>(p); break;
    default: run_fast<scalar_t, kHeadSize, 8>(p); break;
  }
}

template <typename scalar_t>
void run(const AttentionParams& p, bool fast) {
  if (fast) {
    switch (p.head_size) {
      case 64: run_fast_heads<scalar_t, 64>(p); break;
      case 80: run_fast_heads<scalar_t, 80>(p); break;
      case 96: run_fast_heads<scalar_t, 96>(p); break;
      case 112: run_fast_heads<scalar_t, 112>(p); break;
      case 128: run_fast_heads<scalar_t, 128>(p); break;
      default: run_fast_heads<scalar_t, 256>(p); break;
    }
  } else {
    pagedgen_emu::launch(attention_grid(p), kAttentionThreads, [&] { attention_generic_kernel<scalar_t>(p); });
  }
  if (p.partition_size > 0)
    pagedgen_emu::launch(dim3(p.num_rows, p.num_heads), kAttentionThreads,
                         [&] { attention_reduce_kernel<scalar_t>(p); });
}

}  // namespace
}  // namespace pagedgen

// dtype: 0 float32, 1 float16, 2 bfloat16. Tensors as in csrc/ops.cpp (host memory, the caches
// contiguous): num_rows query rows, num_seqs sequences (block_tables, seq_lens, query_start_loc).
// plan (out) [4]: partition_size, max_partitions, heads_per_block, fast kernel used. Returns 0, or 2
// when a kernel trapped (a block id outside [0, num_blocks): the GPU would have stopped there).
extern "C" int emu_paged_attention(int dtype, void* out, const void* query, const void* key_cache,
                                   const void* value_cache, const int* block_tables, const int* seq_lens,
                                   const int* query_start_loc, int num_rows, int num_seqs, int num_heads,
                                   int num_kv_heads, int head_size, int num_blocks, int block_size,
                                   int max_blocks_per_seq,
                                   int64_t q_stride_row, int64_t q_stride_head, int64_t out_stride_row,
                                   int64_t out_stride_head, int64_t block_table_stride, float scale,
                                   int sliding_window, int num_sms, int allow_fast, int* plan) {
  using namespace pagedgen;
  const int elem = dtype == 0 ? 4 : 2;
  const bool fast = allow_fast && has_fast_kernel(head_size) && q_stride_row % (16 / elem) == 0 &&
                    q_stride_head % (16 / elem) == 0;
  AttentionParams p{};
  p.out = out;
  p.query = query;
  p.key_cache = key_cache;
  p.value_cache = value_cache;
  p.block_tables = block_tables;
  p.seq_lens = seq_lens;
  p.query_start_loc = query_start_loc;
  p.q_stride_row = q_stride_row;
  p.q_stride_head = q_stride_head;
  p.out_stride_row = out_stride_row;
  p.out_stride_head = out_stride_head;
  p.block_table_stride = block_table_stride;
  p.kv_token_stride = int64_t(num_kv_heads) * head_size;
  p.num_blocks = num_blocks;
  p.num_rows = num_rows;
  p.num_seqs = num_seqs;
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.head_size = head_size;
  p.sliding_window = sliding_window;
  p.group_size = num_heads / num_kv_heads;
  p.block_size = block_size;
  p.max_blocks_per_seq = max_blocks_per_seq;
  p.scale_log2 = float(scale * 1.4426950408889634);
  plan_attention(p, fast, num_sms);
  std::vector<float> tmp_out, max_logits, exp_sums;
  if (p.partition_size > 0) {
    const size_t rows = size_t(num_rows) * num_heads * p.max_partitions;
    tmp_out.assign(rows * head_size, NAN);  // poisoned: every value read must have been written
    max_logits.assign(rows, NAN);
    exp_sums.assign(rows, NAN);
    p.tmp_out = tmp_out.data();
    p.max_logits = max_logits.data();
    p.exp_sums = exp_sums.data();
  }
  plan[0] = p.partition_size;
  plan[1] = p.max_partitions;
  plan[2] = p.heads_per_block;
  plan[3] = fast;
  pagedgen_emu::trapped.store(false);
  switch (dtype) {
    case 0: run<float>(p, fast); break;
    case 1: run<__half>(p, fast); break;
    case 2: run<__nv_bfloat16>(p, fast); break;
    default: return 1;
  }
  return pagedgen_emu::trapped.load() ? 2 : 0;
}
