// The KV-cache movers on CUDA: reshape_and_cache (new tokens into their slots), copy_blocks
// (copy-on-write inside one layer's cache) and swap_blocks (GPU <-> CPU, swap preemption).
// Cache layout: [num_blocks, block_size, num_kv_heads, head_size], contiguous (csrc/ops.cpp).
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <cstdint>

#include "../op_checks.h"
#include "kernel_utils.cuh"

namespace pagedgen {
namespace {

// One block per token: key/value row t ([num_kv_heads, head_size], any strides) -> cache slot
// slot_mapping[t]. With a contiguous cache, slot s = block * block_size + offset is row s of the
// cache seen as [num_blocks * block_size, num_kv_heads * head_size]. Negative slots are padding;
// slots >= num_slots (a bad value the host cannot see without a sync) are skipped too: nothing is
// written outside the cache.
struct Strides {
  int64_t token, head, elem;
};
template <typename cache_t, typename in_t>
__global__ void reshape_and_cache_kernel(const in_t* __restrict__ key, const in_t* __restrict__ value,
                                         cache_t* __restrict__ key_cache, cache_t* __restrict__ value_cache,
                                         const int64_t* __restrict__ slot_mapping, int64_t num_slots, Strides ks,
                                         Strides vs, int num_kv_heads, int head_size) {
  const int64_t t = blockIdx.x;
  const int64_t slot = slot_mapping[t];
  if (slot < 0 || slot >= num_slots) return;  // padding (out-of-range slots are skipped too)
  const int row = num_kv_heads * head_size;
  cache_t* k_dst = key_cache + slot * row;
  cache_t* v_dst = value_cache + slot * row;
  const in_t* k_src = key + t * ks.token;
  const in_t* v_src = value + t * vs.token;
  for (int i = threadIdx.x; i < row; i += blockDim.x) {
    const int64_t h = i / head_size, d = i % head_size;
    k_dst[i] = from_float<cache_t>(to_float(k_src[h * ks.head + d * ks.elem]));
    v_dst[i] = from_float<cache_t>(to_float(v_src[h * vs.head + d * vs.elem]));
  }
}

// One block per (pair, cache): grid (num_pairs, 2), y = 0 key cache, y = 1 value cache.
// A block of the cache is block_vecs elements of vec_t (uint4 when its bytes allow, else char).
template <typename vec_t>
__global__ void copy_blocks_kernel(vec_t* key_cache, vec_t* value_cache, const int64_t* __restrict__ block_mapping,
                                   int64_t num_blocks, int64_t block_vecs) {
  const int64_t src = block_mapping[2 * int64_t(blockIdx.x)], dst = block_mapping[2 * int64_t(blockIdx.x) + 1];
  if (src < 0 || src >= num_blocks || dst < 0 || dst >= num_blocks) return;  // see copy_blocks
  vec_t* cache = blockIdx.y == 0 ? key_cache : value_cache;
  const vec_t* from = cache + src * block_vecs;
  vec_t* to = cache + dst * block_vecs;
  for (int64_t i = threadIdx.x; i < block_vecs; i += blockDim.x) to[i] = from[i];
}

// The float dtypes (the shared checks allow no other).
template <typename F>
void dispatch_dtype(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat: f(float{}); break;
    case at::kHalf: f(__half{}); break;
    default: f(__nv_bfloat16{}); break;
  }
}

}  // namespace

// Writes key/value [num_tokens, num_kv_heads, head_size] into their cache slots; slot_mapping
// [num_tokens] int64 on the caches' device, a negative slot is padding and is skipped. key and value
// may be strided views (e.g. slices of a fused qkv projection), and are converted to the cache
// dtype. Slots must be < num_blocks * block_size (larger ones are skipped: checking them on the host
// would need a device sync; the CPU kernel raises).
void reshape_and_cache(const at::Tensor& key,          // [num_tokens, num_kv_heads, head_size]
                       const at::Tensor& value,        // [num_tokens, num_kv_heads, head_size]
                       const at::Tensor& key_cache,    // [num_blocks, block_size, num_kv_heads, head_size]
                       const at::Tensor& value_cache,  // [num_blocks, block_size, num_kv_heads, head_size]
                       const at::Tensor& slot_mapping) {  // [num_tokens] int64
  checks::reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, c10::DeviceType::CUDA);
  const int64_t num_tokens = key.size(0), num_kv_heads = key.size(1), head_size = key.size(2);
  if (num_tokens == 0 || num_kv_heads * head_size == 0) return;

  const c10::cuda::CUDAGuard guard(key_cache.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(key_cache.get_device()).stream();
  const int64_t row = num_kv_heads * head_size;
  const int threads = row >= 512 ? 512 : int((row + 31) / 32 * 32);
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  const Strides ks{key.stride(0), key.stride(1), key.stride(2)}, vs{value.stride(0), value.stride(1), value.stride(2)};
  dispatch_dtype(key_cache.scalar_type(), [&](auto cache_zero) {
    using cache_t = decltype(cache_zero);
    dispatch_dtype(key.scalar_type(), [&](auto in_zero) {
      using in_t = decltype(in_zero);
      reshape_and_cache_kernel<cache_t, in_t><<<unsigned(num_tokens), threads, 0, stream>>>(
          static_cast<const in_t*>(key.data_ptr()), static_cast<const in_t*>(value.data_ptr()),
          static_cast<cache_t*>(key_cache.data_ptr()), static_cast<cache_t*>(value_cache.data_ptr()),
          slot_mapping.data_ptr<int64_t>(), num_slots, ks, vs, int(num_kv_heads), int(head_size));
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Copies whole blocks inside one layer's cache (copy-on-write): key_cache[dst] = key_cache[src] and
// value_cache[dst] = value_cache[src] for each (src, dst) row of block_mapping [num_pairs, 2] int64.
// block_mapping may be on any device: a CPU mapping is bounds-checked on the host, then copied to
// the caches' GPU (asynchronously when it is pinned); a CUDA mapping is used where it is, without a
// host sync, and pairs out of range are skipped by the kernel. Pairs run in parallel: no dst may be
// another pair's src (the block manager's copy-on-write never asks for that).
void copy_blocks(const at::Tensor& key_cache,      // [num_blocks, block_size, num_kv_heads, head_size]
                 const at::Tensor& value_cache,    // [num_blocks, block_size, num_kv_heads, head_size]
                 const at::Tensor& block_mapping) {  // [num_pairs, 2] int64 (src, dst)
  checks::copy_blocks(key_cache, value_cache, block_mapping, c10::DeviceType::CUDA);
  const int64_t num_pairs = block_mapping.size(0), num_blocks = key_cache.size(0);
  if (!block_mapping.is_cuda()) {
    const at::Tensor host = block_mapping.contiguous();
    checks::block_mapping_values("copy_blocks", host.data_ptr<int64_t>(), num_pairs, num_blocks, num_blocks);
  }
  if (num_pairs == 0 || key_cache.numel() == 0) return;

  const c10::cuda::CUDAGuard guard(key_cache.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(key_cache.get_device()).stream();
  const at::Tensor mapping = block_mapping.to(key_cache.device(), /*non_blocking=*/true).contiguous();
  const int64_t block_bytes = key_cache.numel() / num_blocks * key_cache.element_size();
  const bool wide = block_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(key_cache.data_ptr()) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(value_cache.data_ptr()) % 16 == 0;
  const dim3 grid(unsigned(num_pairs), 2);
  if (wide) {
    copy_blocks_kernel<uint4><<<grid, 256, 0, stream>>>(static_cast<uint4*>(key_cache.data_ptr()),
                                                        static_cast<uint4*>(value_cache.data_ptr()),
                                                        mapping.data_ptr<int64_t>(), num_blocks, block_bytes / 16);
  } else {
    copy_blocks_kernel<char><<<grid, 256, 0, stream>>>(static_cast<char*>(key_cache.data_ptr()),
                                                       static_cast<char*>(value_cache.data_ptr()),
                                                       mapping.data_ptr<int64_t>(), num_blocks, block_bytes);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Copies whole blocks between two caches of the same block shape: dst[d] = src[s] for each (s, d)
// row of block_mapping [num_pairs, 2] int64. One of src / dst is on a GPU, the other on the CPU
// (swap out: GPU -> CPU, swap in: CPU -> GPU) or on a GPU (device to device, peers included).
//
// Dispatch: the dispatcher picks the kernel of the highest-priority backend among all tensor
// arguments, and CUDA outranks CPU, so a call with one CUDA and one CPU tensor lands here; this
// function therefore serves both directions. (A call with CPU tensors only goes to the CPU kernel.)
// block_mapping is read on the host: pass it on the CPU (a CUDA mapping is copied back, a sync).
// The copies are cudaMemcpyAsync calls on the GPU side's current stream, one per run of consecutive
// pairs: with pinned CPU memory they are asynchronous (synchronise that stream before reading a CPU
// dst or reusing a CPU src); with pageable memory CUDA makes them synchronous.
void swap_blocks(const at::Tensor& src,             // [num_src_blocks, ...]
                 const at::Tensor& dst,             // [num_dst_blocks, ...] same trailing shape, written
                 const at::Tensor& block_mapping) {  // [num_pairs, 2] int64 (src block, dst block)
  checks::swap_blocks(src, dst, block_mapping, c10::DeviceType::CUDA);
  const int64_t num_pairs = block_mapping.size(0), num_src = src.size(0), num_dst = dst.size(0);
  const at::Tensor host = block_mapping.to(at::kCPU).contiguous();
  const int64_t* pairs = host.data_ptr<int64_t>();
  checks::block_mapping_values("swap_blocks", pairs, num_pairs, num_src, num_dst);
  if (num_pairs == 0 || src.numel() == 0) return;

  const at::Device gpu = src.is_cuda() ? src.device() : dst.device();
  const c10::cuda::CUDAGuard guard(gpu);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(gpu.index()).stream();
  const bool peer = src.is_cuda() && dst.is_cuda() && src.get_device() != dst.get_device();
  const cudaMemcpyKind kind = src.is_cuda() ? (dst.is_cuda() ? cudaMemcpyDeviceToDevice : cudaMemcpyDeviceToHost)
                                            : cudaMemcpyHostToDevice;
  const int64_t block_bytes = src.numel() / num_src * src.element_size();
  const char* src_ptr = static_cast<const char*>(src.data_ptr());
  char* dst_ptr = static_cast<char*>(dst.data_ptr());
  for (int64_t i = 0; i < num_pairs;) {
    int64_t run = 1;  // pairs i .. i + run - 1 move consecutive blocks to consecutive blocks
    while (i + run < num_pairs && pairs[2 * (i + run)] == pairs[2 * i] + run &&
           pairs[2 * (i + run) + 1] == pairs[2 * i + 1] + run)
      ++run;
    const char* from = src_ptr + pairs[2 * i] * block_bytes;
    char* to = dst_ptr + pairs[2 * i + 1] * block_bytes;
    if (peer) {
      C10_CUDA_CHECK(cudaMemcpyPeerAsync(to, dst.get_device(), from, src.get_device(), run * block_bytes, stream));
    } else {
      C10_CUDA_CHECK(cudaMemcpyAsync(to, from, run * block_bytes, kind, stream));
    }
    i += run;
  }
}

TORCH_LIBRARY_IMPL(pagedgen, CUDA, m) {
  m.impl("reshape_and_cache", &reshape_and_cache);
  m.impl("copy_blocks", &copy_blocks);
  m.impl("swap_blocks", &swap_blocks);
}

}  // namespace pagedgen
