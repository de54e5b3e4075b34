// Device helpers shared by the attention kernels: element conversion, 16-byte vectors, warp and
// block reductions, and the token -> cache-row address of a block table.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

namespace pagedgen {

constexpr unsigned kFullMask = 0xffffffffu;

// The running kernel's dynamic shared memory (16-byte aligned). Every kernel here takes its shared
// memory through this one declaration, sized at launch.
template <typename T>
__device__ __forceinline__ T* dynamic_smem() {
  extern __shared__ uint4 pagedgen_dynamic_smem[];
  return reinterpret_cast<T*>(pagedgen_dynamic_smem);
}

// Element <-> float.
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// A 16-byte vector of scalar_t: kVecSize<scalar_t> elements, loaded as one uint4.
template <typename scalar_t>
constexpr int kVecSize = 16 / int(sizeof(scalar_t));

__device__ __forceinline__ uint4 load_vec(const void* ptr) { return __ldg(reinterpret_cast<const uint4*>(ptr)); }

// Unpacks a 16-byte vector into kVecSize<scalar_t> floats.
template <typename scalar_t>
__device__ __forceinline__ void unpack(const uint4& v, float* f);
template <>
__device__ __forceinline__ void unpack<float>(const uint4& v, float* f) {
  f[0] = __uint_as_float(v.x);
  f[1] = __uint_as_float(v.y);
  f[2] = __uint_as_float(v.z);
  f[3] = __uint_as_float(v.w);
}
template <>
__device__ __forceinline__ void unpack<__half>(const uint4& v, float* f) {
  const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __half22float2(h[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}
template <>
__device__ __forceinline__ void unpack<__nv_bfloat16>(const uint4& v, float* f) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __bfloat1622float2(h[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) x = fmaxf(x, __shfl_xor_sync(kFullMask, x, m));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) x += __shfl_xor_sync(kFullMask, x, m);
  return x;
}

// Max / sum over the whole block; every thread gets the result. `scratch` holds one float per warp
// and may be reused right after the call returns (the call ends with a barrier).
template <bool kIsMax>
__device__ __forceinline__ float block_reduce(float x, float* scratch) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, num_warps = blockDim.x / 32;
  x = kIsMax ? warp_max(x) : warp_sum(x);
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  float r = kIsMax ? -FLT_MAX : 0.f;
  for (int w = 0; w < num_warps; ++w) r = kIsMax ? fmaxf(r, scratch[w]) : r + scratch[w];
  __syncthreads();
  return r;
}

// What query row `row` attends to (attention_params.cuh): its sequence, and the span [lo, hi) of
// positions (hi = position + 1, clamped to what the block table can address: the bound is not
// checked on the host, which would need a device sync). An empty span (lo >= hi) for a row at a
// negative position, or a row past query_start_loc[num_seqs]: its output is zeros.
struct RowSpan {
  int seq, lo, hi;
};
__device__ __forceinline__ RowSpan row_span(const int* query_start_loc, const int* seq_lens, int num_seqs, int row,
                                            int sliding_window, int max_blocks_per_seq, int block_size) {
  RowSpan r{0, 0, 0};
  if (num_seqs <= 0 || row >= __ldg(query_start_loc + num_seqs)) return r;
  int a = 0, b = num_seqs - 1;  // the last sequence whose first row is <= row (empty ones come before it)
  while (a < b) {
    const int mid = (a + b + 1) / 2;
    if (__ldg(query_start_loc + mid) <= row) a = mid; else b = mid - 1;
  }
  const int first = __ldg(query_start_loc + a), q_len = __ldg(query_start_loc + a + 1) - first;
  const int pos = __ldg(seq_lens + a) - q_len + (row - first);
  const int64_t cap = int64_t(max_blocks_per_seq) * block_size;
  r.seq = a;
  r.hi = pos < 0 ? 0 : int(pos + 1 < cap ? pos + 1 : cap);
  r.lo = sliding_window > 0 && pos - sliding_window + 1 > 0 ? pos - sliding_window + 1 : 0;
  return r;
}

// A value the host could not check without a device sync is bad (a block id outside the cache):
// stop before it is used. On the GPU a trap: the launch fails ("unspecified launch failure" at the
// next synchronising call) and the CUDA context is lost, as after a failed device-side assertion in
// PyTorch; no memory outside the cache is touched. Under the host emulation (tests/support/cuda_emulation)
// the trap is recorded and the caller goes on with a safe value.
__device__ __forceinline__ void trap_bad_value() {
#if defined(__CUDA_ARCH__)
  __trap();
#elif defined(PAGEDGEN_CUDA_EMULATION)
  pagedgen_emu::record_trap();
#endif
}

// Element offset of token `t`'s row for KV head `kv_head` in a cache
// [num_blocks, block_size, num_kv_heads, head_size]: block_table[t / block_size] is the physical
// block, t % block_size the slot inside it. A physical block outside [0, num_blocks) traps.
__device__ __forceinline__ int64_t token_offset(const int* block_table, int t, int block_size, int block_size_log2,
                                                int64_t num_blocks, int64_t kv_token_stride, int64_t kv_head_offset) {
  int logical, slot;
  if (block_size_log2 >= 0) {
    logical = t >> block_size_log2;
    slot = t & (block_size - 1);
  } else {
    logical = t / block_size;
    slot = t - logical * block_size;
  }
  int64_t physical = __ldg(block_table + logical);
  if (physical < 0 || physical >= num_blocks) {
    trap_bad_value();
    physical = 0;  // emulation only: the GPU stopped above
  }
  return (physical * block_size + slot) * kv_token_stride + kv_head_offset;
}

}  // namespace pagedgen
