// pagedgen::paged_attention on CUDA (the varlen op of csrc/ops.cpp): checks the arguments (the checks
// shared with the CPU kernel, csrc/op_checks.h, before any pointer is read), picks the
// kernel (fast or generic) and the work split (single pass or split-K), and launches on the current
// stream of query's device. Nothing is read back from the GPU: the row -> sequence map is looked up by
// the kernels in query_start_loc (attention_params.cuh).
// Kernels: attention_fast.cuh, attention_generic.cu, attention_reduce.cu (see attention_params.cuh).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <array>
#include <atomic>
#include <cstdint>

#include "../op_checks.h"
#include "attention_params.cuh"

namespace pagedgen {
namespace {

int device_attribute(cudaDeviceAttr attr, int device) {
  int value = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, attr, device));
  return value;
}

int multiprocessor_count(int device) {
  static std::array<std::atomic<int>, 64> cache{};  // 0 = not read yet
  if (device < 0 || device >= int(cache.size())) return device_attribute(cudaDevAttrMultiProcessorCount, device);
  int n = cache[device].load(std::memory_order_relaxed);
  if (n == 0) {
    n = device_attribute(cudaDevAttrMultiProcessorCount, device);
    cache[device].store(n, std::memory_order_relaxed);
  }
  return n;
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

template <typename scalar_t>
void launch(const AttentionParams& p, bool fast, cudaStream_t stream) {
  if (!(fast && launch_attention_fast<scalar_t>(p, stream))) launch_attention_generic<scalar_t>(p, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (p.partition_size > 0) {
    launch_attention_reduce<scalar_t>(p, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace

void paged_attention(
    const at::Tensor& out,              // [num_tokens, num_heads, head_size], written
    const at::Tensor& query,            // [num_tokens, num_heads, head_size]
    const at::Tensor& key_cache,        // [num_blocks, block_size, num_kv_heads, head_size]
    const at::Tensor& value_cache,      // [num_blocks, block_size, num_kv_heads, head_size]
    const at::Tensor& block_tables,     // [num_seqs, max_blocks_per_seq] int32
    const at::Tensor& seq_lens,         // [num_seqs] int32
    const at::Tensor& query_start_loc,  // [num_seqs + 1] int32
    double scale, int64_t sliding_window) {
  const checks::AttentionSizes sz = checks::paged_attention(out, query, key_cache, value_cache, block_tables, seq_lens,
                                                            query_start_loc, sliding_window, c10::DeviceType::CUDA);
  const auto dtype = query.scalar_type();
  const int64_t num_tokens = sz.num_tokens, num_heads = sz.num_heads, head_size = sz.head_size;
  const int64_t block_size = sz.block_size, num_kv_heads = sz.num_kv_heads, num_seqs = sz.num_seqs;
  const int64_t max_blocks = sz.max_blocks_per_seq;
  if (num_tokens == 0 || num_heads == 0) return;

  const c10::cuda::CUDAGuard guard(query.device());
  const int device = query.get_device();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();

  // Fast kernel: known head size and 16-byte aligned query rows and cache (its vector loads).
  const int64_t vec = 16 / query.element_size();
  const bool fast = has_fast_kernel(int(head_size)) && aligned16(query.data_ptr()) && query.stride(0) % vec == 0 &&
                    query.stride(1) % vec == 0 && aligned16(key_cache.data_ptr()) && aligned16(value_cache.data_ptr());
  AttentionParams p{};
  p.out = out.data_ptr();
  p.query = query.data_ptr();
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.block_tables = block_tables.data_ptr<int>();
  p.seq_lens = seq_lens.data_ptr<int>();
  p.query_start_loc = query_start_loc.data_ptr<int>();
  p.q_stride_row = query.stride(0);
  p.q_stride_head = query.stride(1);
  p.out_stride_row = out.stride(0);
  p.out_stride_head = out.stride(1);
  p.block_table_stride = block_tables.stride(0);
  p.kv_token_stride = num_kv_heads * head_size;
  p.num_rows = int(num_tokens);
  p.num_seqs = int(num_seqs);
  p.sliding_window = int(sliding_window);
  p.num_heads = int(num_heads);
  p.num_kv_heads = int(num_kv_heads);
  p.head_size = int(head_size);
  p.group_size = int(num_heads / num_kv_heads);
  p.block_size = int(block_size);
  p.max_blocks_per_seq = int(max_blocks);
  p.num_blocks = sz.num_blocks;
  p.scale_log2 = float(scale * 1.4426950408889634);  // log2(e): the kernels use exp2
  plan_attention(p, fast, multiprocessor_count(device));
  if (!fast) {
    const size_t smem = attention_generic_smem_bytes(p);
    checks::attention_shared_memory(head_size, smem, device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  }

  at::Tensor tmp_out, max_logits, exp_sums;  // split-K scratch, see attention_params.cuh
  if (p.partition_size > 0) {
    const auto f32 = query.options().dtype(at::kFloat);
    tmp_out = at::empty({num_tokens, num_heads, p.max_partitions, head_size}, f32);
    max_logits = at::empty({num_tokens, num_heads, p.max_partitions}, f32);
    exp_sums = at::empty({num_tokens, num_heads, p.max_partitions}, f32);
    p.tmp_out = tmp_out.data_ptr<float>();
    p.max_logits = max_logits.data_ptr<float>();
    p.exp_sums = exp_sums.data_ptr<float>();
  }

  switch (dtype) {
    case at::kFloat: launch<float>(p, fast, stream); break;
    case at::kHalf: launch<__half>(p, fast, stream); break;
    default: launch<__nv_bfloat16>(p, fast, stream); break;
  }
}

TORCH_LIBRARY_IMPL(pagedgen, CUDA, m) { m.impl("paged_attention", &paged_attention); }

}  // namespace pagedgen
