// Argument checks of the ops that have a kernel per device (schemas in csrc/ops.cpp): written once,
// called first by the CPU kernel (csrc/cpu/*.cpp) and the CUDA kernel (csrc/cuda/*.cu) of each op,
// before either reads a pointer. A bad call therefore raises the same RuntimeError (TORCH_CHECK,
// "<op>: <argument> must ..., got ...") on both devices, and the CPU tests run the checks the CUDA op
// runs (tests/ops/test_ops_checks.py, also through the CUDA kernel's own entry when it is built).
//
// Each function checks what the tensors' metadata tells, in this order: ranks, sizes and how the
// arguments' sizes fit together, dtypes, strides the kernels assume, size limits, and last the
// devices (`kernel`: the device type of the kernel calling; every tensor must be on one device of
// that type, swap_blocks' and copy_blocks' mappings excepted, see below). No value inside a tensor
// is read here. Values are checked where they can be read without a device sync:
//   * CPU kernels read them on the host and raise: block ids outside the cache, slots past the
//     cache, seq_lens outside [0, block-table capacity], query_start_loc not running from 0 to
//     num_tokens or decreasing, block_mapping pairs outside the caches;
//   * CUDA kernels leave them on the GPU and guard in the kernel (csrc/cuda/kernel_utils.cuh):
//     paged_attention stops with a trap on a block id outside the cache (the launch fails, the
//     CUDA context is lost, like a failed device-side assertion in PyTorch), clamps each row's span
//     to the block table and gives zeros to rows past query_start_loc[num_seqs]; reshape_and_cache
//     skips slots past the cache and copy_blocks pairs outside it (a CUDA block_mapping; a CPU one
//     is checked on the host and raises). swap_blocks reads its mapping on the host and raises.
//
// Defined in op_checks.cpp, compiled by the host C++ compiler like the CPU kernels: the CUDA
// sources only call these functions.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <initializer_list>
#include <utility>

namespace pagedgen::checks {

// Sizes of a checked paged_attention call.
struct AttentionSizes {
  int64_t num_tokens, num_heads, head_size;                  // query, out: [num_tokens, num_heads, head_size]
  int64_t num_blocks, block_size, num_kv_heads;              // caches: [num_blocks, block_size, num_kv_heads, head_size]
  int64_t num_seqs, max_blocks_per_seq;                      // block_tables: [num_seqs, max_blocks_per_seq]
};

// out, query [num_tokens, num_heads, head_size] (out has query's sizes; any strides); key_cache,
// value_cache [num_blocks, block_size, num_kv_heads, head_size] contiguous, block_size, head_size and
// num_kv_heads > 0, num_heads % num_kv_heads == 0; one float dtype (float32, float16, bfloat16) for
// out, query and the caches; block_tables [num_seqs, max_blocks_per_seq] int32 (any strides);
// seq_lens [num_seqs] and query_start_loc [num_seqs + 1] int32; sliding_window >= 0; rows need a
// sequence (num_seqs == 0 only with num_tokens == 0); out without internal overlap and sharing no
// memory with the other arguments (writable_output); sizes fit the kernels' int32 indices.
// query_start_loc[num_seqs] must equal num_tokens (a value: the CPU kernel raises; the CUDA kernel
// gives zeros to rows past it; the engine never passes such rows: CUDA-graph padding rows are
// sequences of seq_len 0, see pagedgen/worker/cuda_graphs.py).
// The CUDA kernel also needs: query's and out's head_size dimension contiguous, block_tables' rows
// contiguous, seq_lens and query_start_loc contiguous (the CPU kernel reads through every stride).
AttentionSizes paged_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                               const at::Tensor& value_cache, const at::Tensor& block_tables,
                               const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t sliding_window,
                               c10::DeviceType kernel);
// The same for paged_attention_quantized: key_cache / value_cache of int8, float8_e4m3fn or
// float8_e5m2 codes (one dtype), key_scales / value_scales [num_blocks, block_size, num_kv_heads]
// bfloat16, contiguous; out and query of one float dtype.
AttentionSizes paged_attention_quantized(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                                         const at::Tensor& value_cache, const at::Tensor& key_scales,
                                         const at::Tensor& value_scales, const at::Tensor& block_tables,
                                         const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                         int64_t sliding_window, c10::DeviceType kernel);

// key, value [num_tokens, num_kv_heads, head_size] of one float dtype (any strides); key_cache,
// value_cache [num_blocks, block_size, num_kv_heads, head_size] contiguous, of one float dtype (the
// keys are converted to it); slot_mapping [num_tokens] int64 contiguous. All on one device.
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                       const at::Tensor& value_cache, const at::Tensor& slot_mapping, c10::DeviceType kernel);

// key_cache, value_cache [num_blocks, ...] of one shape and dtype, contiguous, on one device;
// block_mapping [num_pairs, 2] int64 on the CPU, or (CUDA kernel) on the caches' device.
void copy_blocks(const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& block_mapping,
                 c10::DeviceType kernel);

// src [num_src_blocks, ...] and dst [num_dst_blocks, ...] of one block shape and dtype, contiguous;
// block_mapping [num_pairs, 2] int64. CPU kernel: all three on the CPU. CUDA kernel: src or dst on
// a CUDA device, the other on the CPU or a CUDA device; block_mapping on the CPU or on the device of
// src or dst.
void swap_blocks(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& block_mapping,
                 c10::DeviceType kernel);

// The values of a block mapping read on the host: pairs [num_pairs, 2] (src, dst) with
// 0 <= src < num_src and 0 <= dst < num_dst.
void block_mapping_values(const char* op, const int64_t* pairs, int64_t num_pairs, int64_t num_src, int64_t num_dst);

// The most top logprobs logprob_topk's kernels keep per row (vLLM's default max_logprobs); more go to
// the PyTorch reference (pagedgen/ops/__init__.py).
inline constexpr int kMaxLogprobTopK = 20;

// logprob_topk: logits [R, V] float32 / bfloat16 / float16 with V >= 1 and contiguous rows (any row
// stride); token_ids [R] int64 (any stride); 0 <= k_max <= min(V, kMaxLogprobTopK); out
// [R, 3 + 2 * k_max] float64 with contiguous rows, overlapping neither input (writable_output); V
// below 2^31; all on one device of the kernel's type. The token ids' values ([0, V)) are the
// kernel's to check.
void logprob_topk(const at::Tensor& out, const at::Tensor& logits, const at::Tensor& token_ids, int64_t k_max,
                  c10::DeviceType kernel);

// A tensor an op writes (`name`, e.g. "out"): no two of its elements at one address (an `out` made by
// as_strided or expand with a zero stride; at::has_internal_overlap), and no memory shared with any
// of `inputs` (the kernels read their inputs after writing `out`, so neither an alias of an input
// nor a partial overlap is safe; at::get_overlap_status, and where that cannot tell, the address
// ranges the two span in one storage). Raises "<op>: <name> must not overlap ...". Used by
// paged_attention (here), rms_norm, fused_add_rms_norm and silu_and_mul (csrc/cpu/).
void writable_output(const char* op, const char* name, const at::Tensor& out,
                     std::initializer_list<std::pair<const char*, const at::Tensor*>> inputs);

// Sizes of a checked int4_linear call.
struct Int4LinearSizes {
  int64_t M, N, K;       // input [M, K], out [M, N]
  int64_t panels, groups;  // weight [panels, K, 8]; weight_scale, weight_zero [panels, groups, 16]
};

// int4 W4A16 (pagedgen/layers/quant_int4.py): input [M, K] float32 / bfloat16 / float16 with contiguous
// rows; out [M, N] of input's dtype, contiguous rows that do not overlap each other or input;
// group_size >= 1; weight [ceil(N / 16), K, 8] uint8 contiguous; weight_scale [ceil(N / 16),
// ceil(K / group_size), 16] float32 and weight_zero of the same shape, uint8, both contiguous; bias
// [N] float32 / bfloat16 / float16 or undefined. All on one device of the kernel's type.
Int4LinearSizes int4_linear(const at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                            const at::Tensor& weight_scale, const at::Tensor& weight_zero, int64_t group_size,
                            const c10::optional<at::Tensor>& bias, c10::DeviceType kernel);

// Sizes of a checked fp8_linear call.
struct Fp8LinearSizes {
  int64_t M, N, K;         // input [M, K], out [M, N]
  int64_t panels, blocks;  // weight [panels, K, 16]; weight_scale [N] (blocks 1) or [N, blocks]
};

// FP8 W8A16 (pagedgen/layers/quant_fp8.py): input, out and bias as int4_linear's; block_k >= 0; weight
// [ceil(N / 16), K, 16] float8_e4m3fn contiguous; weight_scale [N] float32 (block_k 0: per output
// channel) or [N, ceil(K / block_k)] float32, contiguous. All on one device of the kernel's type. The
// codes' values (no NaN: 0x7f, 0xff) and the scales' (scale * 2^8 finite) are the loader's to check.
Fp8LinearSizes fp8_linear(const at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                          const at::Tensor& weight_scale, int64_t block_k, const c10::optional<at::Tensor>& bias,
                          c10::DeviceType kernel);

// The generic CUDA attention kernel's shared memory for this head size against the device's limit.
void attention_shared_memory(int64_t head_size, size_t bytes, int64_t limit);

}  // namespace pagedgen::checks
