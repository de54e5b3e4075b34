// Runs the attention kernels of csrc/cuda on the host, for checks on machines without a GPU: one
// std::thread per CUDA thread, a block barrier for __syncthreads and a per-warp exchange for
// __shfl_xor_sync. Blocks run one after another, so one static buffer serves as shared memory.
// It checks the kernels' logic (indexing, masking, softmax merges, split-K); not timing, not the
// memory model, not the launch code (nvcc-only, guarded by __CUDACC__ in the sources).
//
// Include this first, then the kernel sources.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>  // host types: dim3, uint3, uint4, cudaStream_t

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#undef __global__
#define __global__
#undef __device__
#define __device__
#undef __forceinline__
#define __forceinline__ inline
#undef __launch_bounds__
#define __launch_bounds__(...)
#undef __shared__
#define __shared__

#include <atomic>

#define PAGEDGEN_CUDA_EMULATION 1  // kernel_utils.cuh: trap_bad_value() records instead of __trap()

namespace pagedgen_emu {

// Set by a kernel's trap_bad_value() (the GPU would stop there with a trap); read and reset by the
// entry points.
inline std::atomic<bool> trapped{false};
inline void record_trap() { trapped.store(true); }

inline thread_local uint3 thread_idx, block_idx;
inline thread_local dim3 block_dim, grid_dim;

struct BlockSync {
  explicit BlockSync(int threads) : block(threads), slots(threads) {
    for (int w = 0; w < threads / 32; ++w) warps.push_back(std::make_unique<std::barrier<>>(32));
  }
  std::barrier<> block;
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  std::vector<float> slots;  // one per thread, for shuffles
};
inline thread_local BlockSync* block_sync = nullptr;

inline float shfl_xor(float v, int mask) {
  const int t = int(thread_idx.x), warp = t / 32, lane = t % 32;
  block_sync->slots[t] = v;
  block_sync->warps[warp]->arrive_and_wait();
  const float r = block_sync->slots[warp * 32 + (lane ^ mask)];
  block_sync->warps[warp]->arrive_and_wait();
  return r;
}

// Runs kernel() for every thread of every block of a 1-D-block grid (threads a multiple of 32): the
// same `threads` host threads take the blocks in turn, with a barrier between blocks (the kernels
// return early only block-uniformly, so every thread passes the same barriers).
inline void launch(dim3 grid, int threads, const std::function<void()>& kernel) {
  BlockSync sync(threads);
  std::vector<std::thread> pool;
  pool.reserve(threads);
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      thread_idx = uint3{unsigned(t), 0, 0};
      block_dim = dim3(threads);
      grid_dim = grid;
      block_sync = &sync;
      for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
          for (unsigned x = 0; x < grid.x; ++x) {
            block_idx = uint3{x, y, z};
            kernel();
            sync.block.arrive_and_wait();  // the next block reuses shared memory
          }
    });
  for (auto& th : pool) th.join();
}

}  // namespace pagedgen_emu

#define threadIdx pagedgen_emu::thread_idx
#define blockIdx pagedgen_emu::block_idx
#define blockDim pagedgen_emu::block_dim
#define gridDim pagedgen_emu::grid_dim

inline void __syncthreads() { pagedgen_emu::block_sync->block.arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int mask) { return pagedgen_emu::shfl_xor(v, mask); }
template <typename T>
inline T __ldg(const T* p) { return *p; }
inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
using std::max;
using std::min;

// Backing store of dynamic_smem() (kernel_utils.cuh), shared by the threads of the running block.
namespace pagedgen {
alignas(16) inline uint4 pagedgen_dynamic_smem[1 << 14];  // 256 KiB
}
