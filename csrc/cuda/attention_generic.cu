// Generic attention kernel: any head size (e.g. 8 for stories260K), any row alignment,
// scalar loads. Same grid, partitions and outputs as the fast kernel (attention_params.cuh); it
// trades speed for simplicity: a tile of kTile tokens at a time, staged through shared memory,
// with block-wide barriers between the q.k, softmax and p.V steps.
#include "attention_params.cuh"
#include "kernel_utils.cuh"

namespace pagedgen {
namespace {

constexpr int kTile = 64;  // tokens per tile

// Dynamic shared memory layout (offsets in order; the int64 array comes first for alignment):
//   tok_row [kTile] int64  element offset of each tile token's row (this KV head)
//   q       [H * D] float  the block's query heads, scaled by scale * log2(e)
//   acc     [H * D] float  un-normalised output; element o belongs to thread o % blockDim.x
//   probs   [H * kTile] float  logits, then probabilities, of the tile
//   m, l, alpha [H] float  running max, running sum, last rescale factor
template <typename scalar_t>
__global__ void __launch_bounds__(kAttentionThreads) attention_generic_kernel(const AttentionParams p) {
  const int D = p.head_size, H = p.heads_per_block;
  int64_t* tok_row = dynamic_smem<int64_t>();
  float* q_s = reinterpret_cast<float*>(tok_row + kTile);
  float* acc_s = q_s + H * D;
  float* probs = acc_s + H * D;
  float* m_s = probs + H * kTile;
  float* l_s = m_s + H;
  float* alpha_s = l_s + H;

  const int row = blockIdx.x;
  const int kv_head = blockIdx.y / p.num_head_chunks;
  const int first = (blockIdx.y % p.num_head_chunks) * H;
  const int nh = min(H, p.group_size - first);  // heads of this block
  const int head0 = kv_head * p.group_size + first;
  const int partition = blockIdx.z;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, num_warps = kAttentionThreads / 32;

  const RowSpan span = row_span(p.query_start_loc, p.seq_lens, p.num_seqs, row, p.sliding_window,
                                p.max_blocks_per_seq, p.block_size);
  const int start = p.partition_size > 0 ? max(partition * p.partition_size, span.lo) : span.lo;
  const int end = p.partition_size > 0 ? min((partition + 1) * p.partition_size, span.hi) : span.hi;
  scalar_t* out = static_cast<scalar_t*>(p.out) + row * p.out_stride_row + head0 * p.out_stride_head;
  if (start >= end) {
    if (p.partition_size == 0) {
      for (int o = tid; o < nh * D; o += kAttentionThreads)
        out[(o / D) * p.out_stride_head + o % D] = from_float<scalar_t>(0.f);
    }
    return;
  }

  const scalar_t* q = static_cast<const scalar_t*>(p.query) + row * p.q_stride_row + head0 * p.q_stride_head;
  for (int o = tid; o < nh * D; o += kAttentionThreads) {
    q_s[o] = to_float(q[(o / D) * p.q_stride_head + o % D]) * p.scale_log2;
    acc_s[o] = 0.f;
  }
  for (int g = tid; g < nh; g += kAttentionThreads) {
    m_s[g] = -FLT_MAX;
    l_s[g] = 0.f;
  }

  const int* block_table = p.block_tables + span.seq * p.block_table_stride;
  const scalar_t* k_cache = static_cast<const scalar_t*>(p.key_cache);
  const scalar_t* v_cache = static_cast<const scalar_t*>(p.value_cache);
  const int64_t kv_head_offset = int64_t(kv_head) * D;

  for (int tile = start; tile < end; tile += kTile) {
    const int n = min(kTile, end - tile);
    for (int t = tid; t < n; t += kAttentionThreads)
      tok_row[t] = token_offset(block_table, tile + t, p.block_size, p.block_size_log2, p.num_blocks,
                                p.kv_token_stride, kv_head_offset);
    __syncthreads();  // also orders the q / acc / m / l initialisation before first use

    // logits: one (token, head) pair per thread
    for (int i = tid; i < n * nh; i += kAttentionThreads) {
      const int t = i / nh, g = i % nh;
      const scalar_t* k = k_cache + tok_row[t];
      const float* qg = q_s + g * D;
      float dot = 0.f;
      for (int d = 0; d < D; ++d) dot = fmaf(qg[d], to_float(k[d]), dot);
      probs[g * kTile + t] = dot;
    }
    __syncthreads();

    // online softmax: one warp per head
    for (int g = warp; g < nh; g += num_warps) {
      float* pg = probs + g * kTile;
      const float m_old = m_s[g];
      float tile_max = -FLT_MAX;
      for (int t = lane; t < n; t += 32) tile_max = fmaxf(tile_max, pg[t]);
      const float m_new = fmaxf(m_old, warp_max(tile_max));
      float sum = 0.f;
      for (int t = lane; t < n; t += 32) {
        pg[t] = exp2f(pg[t] - m_new);
        sum += pg[t];
      }
      sum = warp_sum(sum);  // every lane has read m_old before lane 0 writes below
      if (lane == 0) {
        const float alpha = exp2f(m_old - m_new);
        alpha_s[g] = alpha;
        l_s[g] = l_s[g] * alpha + sum;
        m_s[g] = m_new;
      }
    }
    __syncthreads();

    // acc = acc * alpha + p . V: one output element per thread
    for (int o = tid; o < nh * D; o += kAttentionThreads) {
      const int g = o / D, d = o % D;
      const float* pg = probs + g * kTile;
      float a = acc_s[o] * alpha_s[g];
      for (int t = 0; t < n; ++t) a = fmaf(pg[t], to_float(v_cache[tok_row[t] + d]), a);
      acc_s[o] = a;
    }
    __syncthreads();  // before the next tile overwrites tok_row and probs
  }

  for (int o = tid; o < nh * D; o += kAttentionThreads) {
    const int g = o / D, d = o % D;
    const float value = acc_s[o] / l_s[g];  // l >= 1: the max token contributes 2^0
    if (p.partition_size == 0) {
      out[g * p.out_stride_head + d] = from_float<scalar_t>(value);
    } else {
      const int64_t slot = (int64_t(row) * p.num_heads + head0 + g) * p.max_partitions + partition;
      p.tmp_out[slot * D + d] = value;
      if (d == 0) {
        p.max_logits[slot] = m_s[g];
        p.exp_sums[slot] = l_s[g];
      }
    }
  }
}

}  // namespace

size_t attention_generic_smem_bytes(const AttentionParams& p) {
  const size_t h = p.heads_per_block, d = p.head_size;
  return kTile * sizeof(int64_t) + (2 * h * d + h * kTile + 3 * h) * sizeof(float);
}

// Launcher: nvcc only (the kernel above also compiles as host C++, see tests/support/cuda_emulation).
#ifdef __CUDACC__
template <typename scalar_t>
void launch_attention_generic(const AttentionParams& p, cudaStream_t stream) {
  const size_t smem = attention_generic_smem_bytes(p);
  if (smem > 48 * 1024)  // the default dynamic limit; the caller checked the device's opt-in maximum
    cudaFuncSetAttribute(attention_generic_kernel<scalar_t>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  attention_generic_kernel<scalar_t><<<attention_grid(p), kAttentionThreads, smem, stream>>>(p);
}

template void launch_attention_generic<float>(const AttentionParams&, cudaStream_t);
template void launch_attention_generic<__half>(const AttentionParams&, cudaStream_t);
template void launch_attention_generic<__nv_bfloat16>(const AttentionParams&, cudaStream_t);
#endif  // __CUDACC__

}  // namespace pagedgen
