// pagedgen::paged_attention on CUDA (the varlen op of csrc/ops.cpp): checks the arguments, picks the
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
#include <climits>
#include <cstdint>

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
  TORCH_CHECK(query.is_cuda(), "paged_attention: query must be a CUDA tensor, got ", query.device());
  for (const at::Tensor* t : {&out, &key_cache, &value_cache, &block_tables, &seq_lens, &query_start_loc})
    TORCH_CHECK(t->device() == query.device(), "paged_attention: all tensors must be on ", query.device(),
                ", got one on ", t->device());
  TORCH_CHECK(query.dim() == 3, "paged_attention: query must be [num_tokens, num_heads, head_size], got ", query.sizes());
  const auto dtype = query.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
              "paged_attention: query must be float32, float16 or bfloat16, got ", dtype);
  TORCH_CHECK(out.sizes() == query.sizes(), "paged_attention: out ", out.sizes(), " must match query ", query.sizes());
  TORCH_CHECK(out.scalar_type() == dtype, "paged_attention: out dtype ", out.scalar_type(), " != query dtype ", dtype);
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1,
              "paged_attention: query and out must be contiguous in the head_size dimension");
  TORCH_CHECK(key_cache.dim() == 4,
              "paged_attention: key_cache must be [num_blocks, block_size, num_kv_heads, head_size], got ",
              key_cache.sizes());
  TORCH_CHECK(value_cache.sizes() == key_cache.sizes(), "paged_attention: value_cache ", value_cache.sizes(),
              " must match key_cache ", key_cache.sizes());
  TORCH_CHECK(key_cache.scalar_type() == dtype && value_cache.scalar_type() == dtype,
              "paged_attention: key_cache and value_cache must have query's dtype ", dtype);
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(),
              "paged_attention: key_cache and value_cache must be contiguous");
  const int64_t num_tokens = query.size(0), num_heads = query.size(1), head_size = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_size, "paged_attention: cache head_size ", key_cache.size(3),
              " != query head_size ", head_size);
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "paged_attention: num_heads (", num_heads,
              ") must be a multiple of num_kv_heads (", num_kv_heads, ")");
  TORCH_CHECK(block_size > 0 && head_size > 0, "paged_attention: block_size and head_size must be positive");
  TORCH_CHECK(block_tables.dim() == 2, "paged_attention: block_tables must be [num_seqs, max_blocks_per_seq], got ",
              block_tables.sizes());
  const int64_t num_seqs = block_tables.size(0);
  TORCH_CHECK(block_tables.scalar_type() == at::kInt, "paged_attention: block_tables must be int32, got ",
              block_tables.scalar_type());
  TORCH_CHECK(block_tables.size(1) <= 1 || block_tables.stride(1) == 1,
              "paged_attention: block_tables rows must be contiguous");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == num_seqs, "paged_attention: seq_lens must be [num_seqs=",
              num_seqs, "], got ", seq_lens.sizes());
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt, "paged_attention: seq_lens must be int32, got ",
              seq_lens.scalar_type());
  TORCH_CHECK(seq_lens.is_contiguous(), "paged_attention: seq_lens must be contiguous");
  TORCH_CHECK(query_start_loc.dim() == 1 && query_start_loc.size(0) == num_seqs + 1,
              "paged_attention: query_start_loc must be [num_seqs + 1=", num_seqs + 1, "], got ",
              query_start_loc.sizes());
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt, "paged_attention: query_start_loc must be int32, got ",
              query_start_loc.scalar_type());
  TORCH_CHECK(query_start_loc.is_contiguous(), "paged_attention: query_start_loc must be contiguous");
  TORCH_CHECK(sliding_window >= 0 && sliding_window < INT_MAX,
              "paged_attention: sliding_window must be >= 0 (0: none), got ", sliding_window);
  const int64_t max_blocks = block_tables.size(1);
  const int64_t max_context = max_blocks * block_size;  // every span is clamped to this
  TORCH_CHECK(num_tokens < INT_MAX && num_seqs < INT_MAX && max_context < INT_MAX && num_heads < 65536,
              "paged_attention: sizes out of range (num_tokens ", num_tokens, ", num_seqs ", num_seqs,
              ", max_blocks_per_seq * block_size ", max_context, ", num_heads ", num_heads, ")");
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
  p.scale_log2 = float(scale * 1.4426950408889634);  // log2(e): the kernels use exp2
  plan_attention(p, fast, multiprocessor_count(device));
  if (!fast) {
    const size_t smem = attention_generic_smem_bytes(p);
    const int limit = device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    TORCH_CHECK(smem <= size_t(limit), "paged_attention: head_size ", head_size, " needs ", smem,
                " bytes of shared memory in the generic kernel, the device allows ", limit);
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
