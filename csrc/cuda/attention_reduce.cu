// Split-K combine: each partition p of a (sequence, head) left its normalised output o_p, its max
// logit m_p and its sum of exponentials l_p (log2 domain, attention_params.cuh). With M = max_p m_p
// and w_p = l_p * 2^(m_p - M), the attention output is sum_p w_p o_p / sum_p w_p.
#include "attention_params.cuh"
#include "kernel_utils.cuh"

namespace pagedgen {
namespace {

// One block per (query row, head); grid (num_rows, num_heads). Partitions [lo / P, ceil(hi / P)) of
// the row's span [lo, hi) hold results (attention_params.cuh).
// Dynamic shared memory: weights [max_partitions] float, then reduction scratch [32] float.
template <typename scalar_t>
__global__ void __launch_bounds__(kAttentionThreads) attention_reduce_kernel(const AttentionParams p) {
  float* weights = dynamic_smem<float>();
  float* scratch = weights + p.max_partitions;
  const int row = blockIdx.x, head = blockIdx.y, D = p.head_size;
  scalar_t* out = static_cast<scalar_t*>(p.out) + row * p.out_stride_row + head * p.out_stride_head;

  const RowSpan span = row_span(p.query_start_loc, p.seq_lens, p.num_seqs, row, p.sliding_window,
                                p.max_blocks_per_seq, p.block_size);
  if (span.lo >= span.hi) {
    for (int d = threadIdx.x; d < D; d += blockDim.x) out[d] = from_float<scalar_t>(0.f);
    return;
  }
  const int first = span.lo / p.partition_size;
  const int n = (span.hi + p.partition_size - 1) / p.partition_size - first;  // first + n <= max_partitions
  const int64_t slot = (int64_t(row) * p.num_heads + head) * p.max_partitions + first;  // partition `first`

  float local_max = -FLT_MAX;
  for (int i = threadIdx.x; i < n; i += blockDim.x) local_max = fmaxf(local_max, p.max_logits[slot + i]);
  const float global_max = block_reduce<true>(local_max, scratch);
  float local_sum = 0.f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    weights[i] = p.exp_sums[slot + i] * exp2f(p.max_logits[slot + i] - global_max);
    local_sum += weights[i];
  }
  const float inv_sum = 1.f / block_reduce<false>(local_sum, scratch);  // barrier: weights visible

  const float* tmp = p.tmp_out + slot * D;  // [n, D]: the row's partitions from `first` on
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float acc = 0.f;
    for (int i = 0; i < n; ++i) acc = fmaf(weights[i], tmp[int64_t(i) * D + d], acc);
    out[d] = from_float<scalar_t>(acc * inv_sum);
  }
}

}  // namespace

// Launcher: nvcc only (the kernel above also compiles as host C++, see tests/support/cuda_emulation).
#ifdef __CUDACC__
template <typename scalar_t>
void launch_attention_reduce(const AttentionParams& p, cudaStream_t stream) {
  const size_t smem = (size_t(p.max_partitions) + 32) * sizeof(float);
  if (smem > 48 * 1024)
    cudaFuncSetAttribute(attention_reduce_kernel<scalar_t>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  attention_reduce_kernel<scalar_t><<<dim3(p.num_rows, p.num_heads), kAttentionThreads, smem, stream>>>(p);
}

template void launch_attention_reduce<float>(const AttentionParams&, cudaStream_t);
template void launch_attention_reduce<__half>(const AttentionParams&, cudaStream_t);
template void launch_attention_reduce<__nv_bfloat16>(const AttentionParams&, cudaStream_t);
#endif  // __CUDACC__

}  // namespace pagedgen
