// Fast attention kernel, templated on element type, head size and query heads per block.
// Included only by attention_fast_{bf16,f16,f32}.cu, which instantiate it for one element type each
// (so that the three compile in parallel).
//
// Thread layout (one block = kAttentionThreads threads, see attention_params.cuh for the grid):
//   the block's threads form kGroups "token groups" of kLanes lanes each. A token group takes one
//   token at a time; its lanes split the token's K (and V) row of head_size elements into 16-byte
//   vectors, lane `lane` holding vectors lane, lane + kLanes, ... (coalesced: consecutive lanes read
//   consecutive 16 bytes). Each lane keeps, in registers, the matching slice of every query head the
//   block serves (kHeads of them, one GQA group or a chunk of one), so each K/V row is read once for
//   the whole group. A q.k partial dot product is summed over the group's lanes by xor shuffles.
//   Each token group runs its own online softmax (running max m, running sum l and output
//   accumulator per head) over the tokens t = base + u * kGroups + group; no barrier is needed
//   inside the token loop. At the end the groups' states are merged through shared memory.
#pragma once

#include "attention_params.cuh"
#include "kernel_utils.cuh"

namespace pagedgen {
namespace fast {

constexpr int pow2_ceil(int x) { return x <= 1 ? 1 : 2 * pow2_ceil((x + 1) / 2); }
constexpr int min_c(int a, int b) { return a < b ? a : b; }
constexpr int max_c(int a, int b) { return a > b ? a : b; }

template <typename scalar_t, int kHeadSize, int kHeads>
struct Layout {
  static constexpr int kVec = kVecSize<scalar_t>;  // elements per 16-byte vector
  static_assert(kHeadSize % kVec == 0, "the fast path needs rows made of whole 16-byte vectors");
  static constexpr int kRowVecs = kHeadSize / kVec;  // 16-byte vectors per K/V row
  // Lanes per token: enough that a lane keeps <= 32 query floats (kHeads * kHeadSize / kLanes), at
  // least 2 (a pair of lanes reads a whole 32-byte sector), at most one vector per lane.
  static constexpr int kLanes =
      max_c(2, min_c(pow2_ceil((kHeads * kHeadSize + 31) / 32), min_c(32, pow2_ceil(kRowVecs))));
  static constexpr int kVecsPerLane = (kRowVecs + kLanes - 1) / kLanes;
  static constexpr bool kRagged = kRowVecs % kLanes != 0;  // some lanes own one vector fewer
  static constexpr int kPerLane = kVecsPerLane * kVec;       // row elements per lane
  static constexpr int kGroups = kAttentionThreads / kLanes;  // tokens in flight per block step
  // Tokens per lane per step: ~32 row elements of K and of V in flight, <= 16 logits in registers.
  static constexpr int kTokensPerLane = min_c(max_c(1, 32 / kPerLane), max_c(1, 16 / kHeads));
  // Shared memory of the final merge: m and l [kGroups][kHeads], acc [kGroups][kHeads][kHeadSize].
  static constexpr int kSmemBytes = (2 * kGroups * kHeads + kGroups * kHeads * kHeadSize) * 4;
  static_assert(kSmemBytes <= 48 * 1024, "merge buffer above the default shared-memory limit");
};

template <typename scalar_t, int kHeadSize, int kHeads>
__global__ void __launch_bounds__(kAttentionThreads) attention_fast_kernel(const AttentionParams p) {
  using L = Layout<scalar_t, kHeadSize, kHeads>;
  constexpr int kVec = L::kVec, kLanes = L::kLanes, kNV = L::kVecsPerLane, kPer = L::kPerLane;
  constexpr int kGroups = L::kGroups, kU = L::kTokensPerLane;

  const int row = blockIdx.x;
  const int kv_head = blockIdx.y / p.num_head_chunks;
  const int first = (blockIdx.y % p.num_head_chunks) * kHeads;  // first head of the chunk, in group
  const int num_heads_here = min(kHeads, p.group_size - first);
  const int head0 = kv_head * p.group_size + first;  // query head of g = 0
  const int partition = blockIdx.z;

  const RowSpan span = row_span(p.query_start_loc, p.seq_lens, p.num_seqs, row, p.sliding_window,
                                p.max_blocks_per_seq, p.block_size);
  const int start = p.partition_size > 0 ? max(partition * p.partition_size, span.lo) : span.lo;
  const int end = p.partition_size > 0 ? min((partition + 1) * p.partition_size, span.hi) : span.hi;
  scalar_t* out = static_cast<scalar_t*>(p.out) + row * p.out_stride_row + head0 * p.out_stride_head;
  if (start >= end) {  // empty span (or a partition outside it: the reduce never reads it)
    if (p.partition_size == 0) {
      for (int o = threadIdx.x; o < num_heads_here * kHeadSize; o += kAttentionThreads)
        out[(o / kHeadSize) * p.out_stride_head + o % kHeadSize] = from_float<scalar_t>(0.f);
    }
    return;
  }

  const int group = threadIdx.x / kLanes;  // token group
  const int lane = threadIdx.x % kLanes;   // lane in the token group
  // Lane's j-th vector is vector j * kLanes + lane of the row; ragged layouts leave some lanes short.
  auto has_vec = [&](int j) { return !L::kRagged || j * kLanes + lane < L::kRowVecs; };

  // q: [kHeads][kPer] this lane's slice of each query head, scaled by scale * log2(e).
  float q[kHeads][kPer];
  const scalar_t* q_seq = static_cast<const scalar_t*>(p.query) + row * p.q_stride_row + head0 * p.q_stride_head;
#pragma unroll
  for (int g = 0; g < kHeads; ++g) {
#pragma unroll
    for (int j = 0; j < kNV; ++j) {
      if (g < num_heads_here && has_vec(j)) {
        unpack<scalar_t>(load_vec(q_seq + g * p.q_stride_head + (j * kLanes + lane) * kVec), &q[g][j * kVec]);
#pragma unroll
        for (int e = 0; e < kVec; ++e) q[g][j * kVec + e] *= p.scale_log2;
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) q[g][j * kVec + e] = 0.f;
      }
    }
  }

  // Online-softmax state of this token group, per head (identical in all its lanes).
  float m[kHeads], l[kHeads], acc[kHeads][kPer];
#pragma unroll
  for (int g = 0; g < kHeads; ++g) {
    m[g] = -FLT_MAX;
    l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < kPer; ++i) acc[g][i] = 0.f;
  }

  const int* block_table = p.block_tables + span.seq * p.block_table_stride;
  const int64_t kv_head_offset = int64_t(kv_head) * kHeadSize;
  const scalar_t* k_cache = static_cast<const scalar_t*>(p.key_cache);
  const scalar_t* v_cache = static_cast<const scalar_t*>(p.value_cache);

  for (int base = start; base < end; base += kGroups * kU) {  // same trip count in every thread
    // Issue all K and V loads of this step first (kU tokens x kNV vectors each).
    uint4 k_raw[kU][kNV], v_raw[kU][kNV];
    bool valid[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int t = base + u * kGroups + group;
      valid[u] = t < end;
      const int64_t row = valid[u] ? token_offset(block_table, t, p.block_size, p.block_size_log2,
                                                  p.num_blocks, p.kv_token_stride, kv_head_offset)
                                   : 0;
#pragma unroll
      for (int j = 0; j < kNV; ++j) {
        if (valid[u] && has_vec(j)) {
          const int64_t off = row + (j * kLanes + lane) * kVec;
          k_raw[u][j] = load_vec(k_cache + off);
          v_raw[u][j] = load_vec(v_cache + off);
        } else {
          k_raw[u][j] = make_uint4(0, 0, 0, 0);
          v_raw[u][j] = make_uint4(0, 0, 0, 0);
        }
      }
    }

    // s: [kU][kHeads] logits (log2 domain) of this lane's tokens.
    float s[kU][kHeads];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
#pragma unroll
      for (int g = 0; g < kHeads; ++g) s[u][g] = 0.f;
#pragma unroll
      for (int j = 0; j < kNV; ++j) {
        float k[kVec];
        unpack<scalar_t>(k_raw[u][j], k);
#pragma unroll
        for (int g = 0; g < kHeads; ++g) {
#pragma unroll
          for (int e = 0; e < kVec; ++e) s[u][g] = fmaf(q[g][j * kVec + e], k[e], s[u][g]);
        }
      }
    }
    // Sum the partial dot products over the token group's lanes (kLanes is a power of two and
    // groups are kLanes-aligned, so xor masks < kLanes stay inside the group).
#pragma unroll
    for (int mask = 1; mask < kLanes; mask <<= 1) {
#pragma unroll
      for (int u = 0; u < kU; ++u) {
#pragma unroll
        for (int g = 0; g < kHeads; ++g) s[u][g] += __shfl_xor_sync(kFullMask, s[u][g], mask);
      }
    }

    // Online softmax: rescale the state to the new running max, turn logits into probabilities.
#pragma unroll
    for (int g = 0; g < kHeads; ++g) {
      float step_max = -FLT_MAX;
#pragma unroll
      for (int u = 0; u < kU; ++u)
        if (valid[u]) step_max = fmaxf(step_max, s[u][g]);
      const float m_new = fmaxf(m[g], step_max);
      const float alpha = exp2f(m[g] - m_new);  // 0 on the first token (m = -FLT_MAX), else <= 1
      m[g] = m_new;
      float step_sum = 0.f;
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        s[u][g] = valid[u] ? exp2f(s[u][g] - m_new) : 0.f;
        step_sum += s[u][g];
      }
      l[g] = l[g] * alpha + step_sum;
#pragma unroll
      for (int i = 0; i < kPer; ++i) acc[g][i] *= alpha;
    }

    // acc += p . V (invalid tokens have p = 0 and V = 0).
#pragma unroll
    for (int u = 0; u < kU; ++u) {
#pragma unroll
      for (int j = 0; j < kNV; ++j) {
        float v[kVec];
        unpack<scalar_t>(v_raw[u][j], v);
#pragma unroll
        for (int g = 0; g < kHeads; ++g) {
#pragma unroll
          for (int e = 0; e < kVec; ++e) acc[g][j * kVec + e] = fmaf(s[u][g], v[e], acc[g][j * kVec + e]);
        }
      }
    }
  }

  // Merge the token groups: M = max_k m_k, L = sum_k l_k 2^(m_k - M), o = sum_k acc_k 2^(m_k - M) / L.
  // A group with no token has m = -FLT_MAX, weight 0.
  float(*red_m)[kHeads] = dynamic_smem<float[kHeads]>();           // [kGroups][kHeads]
  float(*red_l)[kHeads] = red_m + kGroups;                          // [kGroups][kHeads]
  float(*red_acc)[kHeads][kHeadSize] =                              // [kGroups][kHeads][kHeadSize]
      reinterpret_cast<float(*)[kHeads][kHeadSize]>(red_l + kGroups);
  if (lane == 0) {
#pragma unroll
    for (int g = 0; g < kHeads; ++g) {
      red_m[group][g] = m[g];
      red_l[group][g] = l[g];
    }
  }
  __syncthreads();
#pragma unroll
  for (int g = 0; g < kHeads; ++g) {
    float block_max = -FLT_MAX;
    for (int k = 0; k < kGroups; ++k) block_max = fmaxf(block_max, red_m[k][g]);
    const float w = exp2f(m[g] - block_max);
#pragma unroll
    for (int j = 0; j < kNV; ++j) {
      if (has_vec(j)) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) red_acc[group][g][(j * kLanes + lane) * kVec + e] = acc[g][j * kVec + e] * w;
      }
    }
  }
  __syncthreads();

  for (int o = threadIdx.x; o < num_heads_here * kHeadSize; o += kAttentionThreads) {
    const int g = o / kHeadSize, d = o % kHeadSize;
    float block_max = -FLT_MAX;
    for (int k = 0; k < kGroups; ++k) block_max = fmaxf(block_max, red_m[k][g]);
    float sum_exp = 0.f, sum_out = 0.f;
    for (int k = 0; k < kGroups; ++k) {
      sum_exp += red_l[k][g] * exp2f(red_m[k][g] - block_max);
      sum_out += red_acc[k][g][d];
    }
    const float value = sum_out / sum_exp;  // sum_exp >= 1: the max token contributes 2^0
    if (p.partition_size == 0) {
      out[g * p.out_stride_head + d] = from_float<scalar_t>(value);
    } else {
      const int64_t slot = (int64_t(row) * p.num_heads + head0 + g) * p.max_partitions + partition;
      p.tmp_out[slot * kHeadSize + d] = value;
      if (d == 0) {
        p.max_logits[slot] = block_max;
        p.exp_sums[slot] = sum_exp;
      }
    }
  }
}

}  // namespace fast

// Launchers: nvcc only (the code above also compiles as host C++, see tests/support/cuda_emulation).
#ifdef __CUDACC__
namespace fast {

template <typename scalar_t, int kHeadSize, int kHeads>
void launch(const AttentionParams& p, cudaStream_t stream) {
  attention_fast_kernel<scalar_t, kHeadSize, kHeads>
      <<<attention_grid(p), kAttentionThreads, Layout<scalar_t, kHeadSize, kHeads>::kSmemBytes, stream>>>(p);
}

template <typename scalar_t, int kHeadSize>
void launch_head_size(const AttentionParams& p, cudaStream_t stream) {
  switch (p.heads_per_block) {
    case 1: launch<scalar_t, kHeadSize, 1>(p, stream); break;
    case 2: launch<scalar_t, kHeadSize, 2>(p, stream); break;
    case 4: launch<scalar_t, kHeadSize, 4>(p, stream); break;
    default: launch<scalar_t, kHeadSize, 8>(p, stream); break;
  }
}

}  // namespace fast

// heads_per_block must be 1, 2, 4 or 8 here (paged_attention.cu rounds the group up to one of them).
template <typename scalar_t>
bool launch_attention_fast(const AttentionParams& p, cudaStream_t stream) {
  switch (p.head_size) {
    case 64: fast::launch_head_size<scalar_t, 64>(p, stream); return true;
    case 80: fast::launch_head_size<scalar_t, 80>(p, stream); return true;
    case 96: fast::launch_head_size<scalar_t, 96>(p, stream); return true;
    case 112: fast::launch_head_size<scalar_t, 112>(p, stream); return true;
    case 128: fast::launch_head_size<scalar_t, 128>(p, stream); return true;
    case 256: fast::launch_head_size<scalar_t, 256>(p, stream); return true;
    default: return false;
  }
}
#endif  // __CUDACC__

}  // namespace pagedgen
