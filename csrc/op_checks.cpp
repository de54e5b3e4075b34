// The argument checks shared by the CPU and CUDA kernels (declared and explained in op_checks.h).
#include "op_checks.h"

#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <climits>
#include <initializer_list>
#include <utility>

namespace pagedgen::checks {
namespace {

const char* kernel_name(c10::DeviceType kernel) { return kernel == c10::DeviceType::CUDA ? "CUDA" : "CPU"; }

bool is_float(at::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; }

// Every named tensor on `device`, which must be of the kernel's device type.
void same_device(const char* op, c10::DeviceType kernel, const at::Device& device,
                 std::initializer_list<std::pair<const char*, const at::Tensor*>> tensors) {
  TORCH_CHECK(device.type() == kernel, op, " (", kernel_name(kernel), " kernel): tensors must be on a ",
              kernel_name(kernel), " device, got ", device);
  for (const auto& [name, t] : tensors)
    TORCH_CHECK(t->device() == device, op, ": all tensors must be on one device, got ", name, " on ", t->device(),
                " and the others on ", device);
}

// A block mapping's metadata: [num_pairs, 2] int64.
void block_mapping_meta(const char* op, const at::Tensor& block_mapping) {
  TORCH_CHECK(block_mapping.dim() == 2 && block_mapping.size(1) == 2, op,
              ": block_mapping must be [num_pairs, 2] (src, dst), got ", block_mapping.sizes());
  TORCH_CHECK(block_mapping.scalar_type() == at::kLong, op, ": block_mapping must be int64, got ",
              block_mapping.scalar_type());
  TORCH_CHECK(block_mapping.size(0) < INT_MAX, op, ": block_mapping has too many pairs (", block_mapping.size(0), ")");
}

// The bytes [begin, end) a tensor with non-negative strides spans (numel > 0).
std::pair<const char*, const char*> span(const at::Tensor& t) {
  int64_t last = 0;  // offset of the last element, in elements
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * std::max<int64_t>(t.stride(d), 0);
  const char* begin = static_cast<const char*>(t.const_data_ptr());
  return {begin, begin + (last + 1) * t.element_size()};
}

// Whether a and b may share memory: ATen's answer, or where it cannot tell (strided tensors), whether
// the byte ranges they span in one storage intersect.
bool may_overlap(const at::Tensor& a, const at::Tensor& b) {
  const at::MemOverlapStatus status = at::get_overlap_status(a, b);
  if (status != at::MemOverlapStatus::TooHard) return status != at::MemOverlapStatus::No;
  if (!a.has_storage() || !b.has_storage() || !a.storage().is_alias_of(b.storage())) return false;
  const auto [a_begin, a_end] = span(a);
  const auto [b_begin, b_end] = span(b);
  return a_begin < b_end && b_begin < a_end;
}

}  // namespace

void writable_output(const char* op, const char* name, const at::Tensor& out,
                     std::initializer_list<std::pair<const char*, const at::Tensor*>> inputs) {
  TORCH_CHECK(at::has_internal_overlap(out) != at::MemOverlap::Yes, op, ": ", name,
              " must not overlap itself (two elements at one address), got strides ", out.strides(), " for sizes ",
              out.sizes());
  for (const auto& [input, t] : inputs)
    TORCH_CHECK(out.numel() == 0 || t->numel() == 0 || !may_overlap(out, *t), op, ": ", name,
                " must not overlap ", input, " (they share memory)");
}

namespace {
// paged_attention's checks, and paged_attention_quantized's with codes = true (key_cache and
// value_cache then hold 1-byte codes, checked by the caller, instead of the query's dtype).
AttentionSizes attention_sizes(const char* op, const at::Tensor& out, const at::Tensor& query,
                               const at::Tensor& key_cache, const at::Tensor& value_cache,
                               const at::Tensor& block_tables, const at::Tensor& seq_lens,
                               const at::Tensor& query_start_loc, int64_t sliding_window, c10::DeviceType kernel,
                               bool codes) {
  const bool cuda = kernel == c10::DeviceType::CUDA;
  // ranks and sizes
  TORCH_CHECK(query.dim() == 3, op, ": query must be [num_tokens, num_heads, head_size], got ", query.sizes());
  TORCH_CHECK(out.sizes() == query.sizes(), op, ": out ", out.sizes(), " must match query ", query.sizes());
  TORCH_CHECK(key_cache.dim() == 4, op, ": key_cache must be [num_blocks, block_size, num_kv_heads, head_size], got ",
              key_cache.sizes());
  TORCH_CHECK(value_cache.sizes() == key_cache.sizes(), op, ": value_cache ", value_cache.sizes(),
              " must match key_cache ", key_cache.sizes());
  AttentionSizes s{};
  s.num_tokens = query.size(0), s.num_heads = query.size(1), s.head_size = query.size(2);
  s.num_blocks = key_cache.size(0), s.block_size = key_cache.size(1), s.num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == s.head_size, op, ": key_cache head_size ", key_cache.size(3),
              " != query head_size ", s.head_size);
  TORCH_CHECK(s.block_size > 0 && s.head_size > 0, op, ": block_size (", s.block_size, ") and head_size (",
              s.head_size, ") must be positive");
  TORCH_CHECK(s.num_kv_heads > 0 && s.num_heads % s.num_kv_heads == 0, op, ": num_heads (", s.num_heads,
              ") must be a multiple of num_kv_heads (", s.num_kv_heads, ")");
  TORCH_CHECK(block_tables.dim() == 2, op, ": block_tables must be [num_seqs, max_blocks_per_seq], got ",
              block_tables.sizes());
  s.num_seqs = block_tables.size(0), s.max_blocks_per_seq = block_tables.size(1);
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == s.num_seqs, op, ": seq_lens must be [num_seqs=", s.num_seqs,
              "], got ", seq_lens.sizes());
  TORCH_CHECK(query_start_loc.dim() == 1 && query_start_loc.size(0) == s.num_seqs + 1, op,
              ": query_start_loc must be [num_seqs + 1=", s.num_seqs + 1, "], got ", query_start_loc.sizes());
  TORCH_CHECK(s.num_seqs > 0 || s.num_tokens == 0, op, ": ", s.num_tokens,
              " query rows but no sequence (block_tables has 0 rows)");
  TORCH_CHECK(sliding_window >= 0 && sliding_window < INT_MAX, op, ": sliding_window must be in [0, ", INT_MAX,
              ") (0: none), got ", sliding_window);
  // dtypes
  const at::ScalarType dtype = query.scalar_type();
  TORCH_CHECK(is_float(dtype), op, ": query dtype must be float32, float16 or bfloat16, got ", dtype);
  if (codes) {
    TORCH_CHECK(out.scalar_type() == dtype, op, ": out and query must share one dtype, got ", out.scalar_type(), " and ",
                dtype);
  } else {
    TORCH_CHECK(out.scalar_type() == dtype && key_cache.scalar_type() == dtype && value_cache.scalar_type() == dtype,
                op, ": out, query, key_cache and value_cache must share one dtype, got ", out.scalar_type(), ", ", dtype,
                ", ", key_cache.scalar_type(), ", ", value_cache.scalar_type());
  }
  TORCH_CHECK(block_tables.scalar_type() == at::kInt, op, ": block_tables must be int32, got ",
              block_tables.scalar_type());
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt, op, ": seq_lens must be int32, got ", seq_lens.scalar_type());
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt, op, ": query_start_loc must be int32, got ",
              query_start_loc.scalar_type());
  // strides
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), op,
              ": key_cache and value_cache must be contiguous");
  if (cuda) {
    TORCH_CHECK(query.stride(2) == 1 || s.head_size == 1, op,
                ": query must be contiguous in its head_size dimension on CUDA, got strides ", query.strides());
    TORCH_CHECK(out.stride(2) == 1 || s.head_size == 1, op,
                ": out must be contiguous in its head_size dimension on CUDA, got strides ", out.strides());
    TORCH_CHECK(block_tables.stride(1) == 1 || s.max_blocks_per_seq <= 1, op,
                ": block_tables rows must be contiguous on CUDA, got strides ", block_tables.strides());
    TORCH_CHECK(seq_lens.is_contiguous() && query_start_loc.is_contiguous(), op,
                ": seq_lens and query_start_loc must be contiguous on CUDA");
  }
  // memory the kernels write
  writable_output(op, "out", out,
                  {{"query", &query}, {"key_cache", &key_cache}, {"value_cache", &value_cache},
                   {"block_tables", &block_tables}, {"seq_lens", &seq_lens}, {"query_start_loc", &query_start_loc}});
  // size limits (the CUDA kernels index rows, sequences, heads and positions with int32)
  TORCH_CHECK(s.num_tokens < INT_MAX && s.num_seqs < INT_MAX && s.max_blocks_per_seq * s.block_size < INT_MAX &&
                  s.num_heads < 65536,
              op, ": sizes out of range (num_tokens ", s.num_tokens, ", num_seqs ", s.num_seqs,
              ", max_blocks_per_seq * block_size ", s.max_blocks_per_seq * s.block_size, ", num_heads ", s.num_heads,
              ")");
  // devices
  same_device(op, kernel, query.device(),
              {{"out", &out}, {"key_cache", &key_cache}, {"value_cache", &value_cache},
               {"block_tables", &block_tables}, {"seq_lens", &seq_lens}, {"query_start_loc", &query_start_loc}});
  return s;
}
}  // namespace

AttentionSizes paged_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                               const at::Tensor& value_cache, const at::Tensor& block_tables,
                               const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t sliding_window,
                               c10::DeviceType kernel) {
  return attention_sizes("paged_attention", out, query, key_cache, value_cache, block_tables, seq_lens,
                         query_start_loc, sliding_window, kernel, false);
}

AttentionSizes paged_attention_quantized(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                                         const at::Tensor& value_cache, const at::Tensor& key_scales,
                                         const at::Tensor& value_scales, const at::Tensor& block_tables,
                                         const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                         int64_t sliding_window, c10::DeviceType kernel) {
  const char* op = "paged_attention_quantized";
  const at::ScalarType ct = key_cache.scalar_type();
  TORCH_CHECK(ct == at::kChar || ct == at::kFloat8_e4m3fn || ct == at::kFloat8_e5m2, op,
              ": key_cache must hold int8, float8_e4m3fn or float8_e5m2 codes, got ", ct);
  TORCH_CHECK(value_cache.scalar_type() == ct, op, ": value_cache must have key_cache's dtype ", ct, ", got ",
              value_cache.scalar_type());
  const AttentionSizes s = attention_sizes(op, out, query, key_cache, value_cache, block_tables, seq_lens,
                                           query_start_loc, sliding_window, kernel, true);
  const auto check_scales = [&](const char* name, const at::Tensor& t) {
    TORCH_CHECK(t.sizes() == key_cache.sizes().slice(0, 3), op, ": ", name, " ", t.sizes(),
                " must be key_cache's [num_blocks, block_size, num_kv_heads] ", key_cache.sizes().slice(0, 3));
    TORCH_CHECK(t.scalar_type() == at::kBFloat16, op, ": ", name, " must be bfloat16, got ", t.scalar_type());
    TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
  };
  check_scales("key_scales", key_scales);
  check_scales("value_scales", value_scales);
  writable_output(op, "out", out, {{"key_scales", &key_scales}, {"value_scales", &value_scales}});
  same_device(op, kernel, query.device(), {{"key_scales", &key_scales}, {"value_scales", &value_scales}});
  return s;
}

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                       const at::Tensor& value_cache, const at::Tensor& slot_mapping, c10::DeviceType kernel) {
  const char* op = "reshape_and_cache";
  TORCH_CHECK(key_cache.dim() == 4, op, ": key_cache must be [num_blocks, block_size, num_kv_heads, head_size], got ",
              key_cache.sizes());
  TORCH_CHECK(value_cache.sizes() == key_cache.sizes(), op, ": value_cache ", value_cache.sizes(),
              " must match key_cache ", key_cache.sizes());
  TORCH_CHECK(key.dim() == 3 && key.size(1) == key_cache.size(2) && key.size(2) == key_cache.size(3), op,
              ": key must be [num_tokens, num_kv_heads=", key_cache.size(2), ", head_size=", key_cache.size(3),
              "], got ", key.sizes(), " (it does not fit key_cache ", key_cache.sizes(), ")");
  TORCH_CHECK(value.sizes() == key.sizes(), op, ": value ", value.sizes(), " must match key ", key.sizes());
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0), op,
              ": slot_mapping must be [num_tokens=", key.size(0), "], got ", slot_mapping.sizes());
  TORCH_CHECK(is_float(key_cache.scalar_type()) && value_cache.scalar_type() == key_cache.scalar_type(), op,
              ": key_cache and value_cache must share one dtype, float32, float16 or bfloat16, got ",
              key_cache.scalar_type(), " and ", value_cache.scalar_type());
  TORCH_CHECK(is_float(key.scalar_type()) && value.scalar_type() == key.scalar_type(), op,
              ": key and value must share one dtype, float32, float16 or bfloat16, got ", key.scalar_type(), " and ",
              value.scalar_type());
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, op, ": slot_mapping must be int64, got ",
              slot_mapping.scalar_type());
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), op,
              ": key_cache and value_cache must be contiguous");
  TORCH_CHECK(slot_mapping.is_contiguous(), op, ": slot_mapping must be contiguous");
  TORCH_CHECK(key.size(0) < INT_MAX && key.size(1) * key.size(2) < INT_MAX, op, ": sizes out of range (key ",
              key.sizes(), ")");
  same_device(op, kernel, key_cache.device(),
              {{"key", &key}, {"value", &value}, {"value_cache", &value_cache}, {"slot_mapping", &slot_mapping}});
}

void copy_blocks(const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& block_mapping,
                 c10::DeviceType kernel) {
  const char* op = "copy_blocks";
  TORCH_CHECK(key_cache.dim() >= 1, op, ": key_cache must be [num_blocks, ...], got a scalar");
  TORCH_CHECK(value_cache.sizes() == key_cache.sizes(), op, ": value_cache ", value_cache.sizes(),
              " must match key_cache ", key_cache.sizes());
  block_mapping_meta(op, block_mapping);
  TORCH_CHECK(value_cache.scalar_type() == key_cache.scalar_type(), op, ": value_cache dtype ",
              value_cache.scalar_type(), " != key_cache dtype ", key_cache.scalar_type());
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), op,
              ": key_cache and value_cache must be contiguous");
  same_device(op, kernel, key_cache.device(), {{"value_cache", &value_cache}});
  TORCH_CHECK(block_mapping.is_cpu() || block_mapping.device() == key_cache.device(), op,
              ": block_mapping must be on the CPU or on the caches' device ", key_cache.device(), ", got ",
              block_mapping.device());
}

void swap_blocks(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& block_mapping,
                 c10::DeviceType kernel) {
  const char* op = "swap_blocks";
  TORCH_CHECK(src.dim() >= 1 && src.dim() == dst.dim() && src.sizes().slice(1) == dst.sizes().slice(1), op,
              ": src ", src.sizes(), " and dst ", dst.sizes(), " must have the same block shape");
  block_mapping_meta(op, block_mapping);
  TORCH_CHECK(src.scalar_type() == dst.scalar_type(), op, ": src dtype ", src.scalar_type(), " != dst dtype ",
              dst.scalar_type());
  TORCH_CHECK(src.is_contiguous() && dst.is_contiguous(), op, ": src and dst must be contiguous");
  if (kernel == c10::DeviceType::CPU) {
    same_device(op, kernel, src.device(), {{"dst", &dst}, {"block_mapping", &block_mapping}});
    return;
  }
  TORCH_CHECK(src.is_cuda() || dst.is_cuda(), op, " (CUDA kernel): src or dst must be on a CUDA device, got ",
              src.device(), " and ", dst.device());
  TORCH_CHECK((src.is_cuda() || src.is_cpu()) && (dst.is_cuda() || dst.is_cpu()), op,
              ": src and dst must be on the CPU or a CUDA device, got ", src.device(), " and ", dst.device());
  TORCH_CHECK(block_mapping.is_cpu() || block_mapping.device() == src.device() ||
                  block_mapping.device() == dst.device(),
              op, ": block_mapping must be on the CPU or on the device of src or dst, got ", block_mapping.device());
}

void block_mapping_values(const char* op, const int64_t* pairs, int64_t num_pairs, int64_t num_src, int64_t num_dst) {
  for (int64_t i = 0; i < num_pairs; ++i) {
    TORCH_CHECK(pairs[2 * i] >= 0 && pairs[2 * i] < num_src, op, ": block_mapping[", i, "] source block ",
                pairs[2 * i], " is outside [0, ", num_src, ")");
    TORCH_CHECK(pairs[2 * i + 1] >= 0 && pairs[2 * i + 1] < num_dst, op, ": block_mapping[", i,
                "] destination block ", pairs[2 * i + 1], " is outside [0, ", num_dst, ")");
  }
}

void logprob_topk(const at::Tensor& out, const at::Tensor& logits, const at::Tensor& token_ids, int64_t k_max,
                  c10::DeviceType kernel) {
  const char* op = "logprob_topk";
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) >= 1, op, ": logits must be [num_rows, vocab] with vocab >= 1, got ",
              logits.sizes());
  const int64_t R = logits.size(0), V = logits.size(1);
  TORCH_CHECK(token_ids.dim() == 1 && token_ids.size(0) == R, op, ": token_ids must be [", R, "] (one per row), got ",
              token_ids.sizes());
  TORCH_CHECK(k_max >= 0 && k_max <= std::min<int64_t>(V, kMaxLogprobTopK), op, ": k_max must be in [0, ",
              std::min<int64_t>(V, kMaxLogprobTopK), "] (at most the vocab and ", kMaxLogprobTopK, "), got ", k_max);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == R && out.size(1) == 3 + 2 * k_max, op, ": out must be [", R, ", ",
              3 + 2 * k_max, "] (3 + 2 * k_max columns), got ", out.sizes());
  TORCH_CHECK(is_float(logits.scalar_type()), op, ": dtype must be float32, bfloat16 or float16, got ",
              logits.scalar_type());
  TORCH_CHECK(token_ids.scalar_type() == at::kLong, op, ": token_ids must be int64, got ", token_ids.scalar_type());
  TORCH_CHECK(out.scalar_type() == at::kDouble, op, ": out must be float64, got ", out.scalar_type());
  TORCH_CHECK((logits.stride(1) == 1 || V == 1) && out.stride(1) == 1, op, ": logits and out must have contiguous rows, got strides ",
              logits.strides(), " and ", out.strides());
  TORCH_CHECK(V <= INT_MAX, op, ": vocab must be below 2^31, got ", V);
  same_device(op, kernel, logits.device(), {{"out", &out}, {"token_ids", &token_ids}});
  writable_output(op, "out", out, {{"logits", &logits}, {"token_ids", &token_ids}});
}

void attention_shared_memory(int64_t head_size, size_t bytes, int64_t limit) {
  TORCH_CHECK(bytes <= size_t(limit), "paged_attention: head_size ", head_size, " needs ", bytes,
              " bytes of shared memory in the generic CUDA kernel, the device allows ", limit);
}

}  // namespace pagedgen::checks

namespace pagedgen::checks {

namespace {

// The activations' side of a W-only linear (int4_linear, fp8_linear): input [M, K] float32 / bfloat16 /
// float16 with contiguous rows, out [M, N] of input's dtype with contiguous rows that do not overlap
// each other, bias [N] of a float dtype or undefined. Returns N (out's columns).
int64_t w_only_activations(const char* op, const at::Tensor& out, const at::Tensor& input, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.dim() == 2, op, ": input must be [M, K], got ", input.sizes());
  TORCH_CHECK(out.dim() == 2 && out.size(0) == input.size(0), op, ": out must be [", input.size(0), ", N], got ", out.sizes());
  const int64_t M = input.size(0), K = input.size(1), N = out.size(1);
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, op, ": bias must be [", N, "], got ", bias->sizes());
  TORCH_CHECK(is_float(input.scalar_type()), op, ": input must be float32, bfloat16 or float16, got ", input.scalar_type());
  TORCH_CHECK(out.scalar_type() == input.scalar_type(), op, ": out must be ", input.scalar_type(), ", got ", out.scalar_type());
  if (has_bias) TORCH_CHECK(is_float(bias->scalar_type()), op, ": bias must be float32, bfloat16 or float16, got ", bias->scalar_type());
  TORCH_CHECK(input.stride(1) == 1 || K <= 1, op, ": input rows must be contiguous, got strides ", input.strides());
  TORCH_CHECK((out.stride(1) == 1 || N <= 1) && (M <= 1 || out.stride(0) >= N), op,
              ": out rows must be contiguous and not overlap, got strides ", out.strides());
  return N;
}

// A W-only weight in panels of 16 outputs: [ceil(N / 16), K, row] (`what`: its codes). Returns the panels.
int64_t w_only_panels(const char* op, const at::Tensor& weight, int64_t N, int64_t K, int64_t row, const char* what) {
  const int64_t P = (N + 15) / 16;
  TORCH_CHECK(weight.dim() == 3 && weight.size(0) == P && weight.size(1) == K && weight.size(2) == row, op,
              ": weight must be [", P, ", ", K, ", ", row, "] (", what, " in panels of 16 outputs) for N = ", N, ", K = ", K,
              ", got ", weight.sizes());
  return P;
}

// The W-only op's tensors (out, then `weights`) on one device of the kernel's type, out writable.
void w_only_devices(const char* op, c10::DeviceType kernel, const at::Tensor& out, const c10::optional<at::Tensor>& bias,
                    std::initializer_list<std::pair<const char*, const at::Tensor*>> others) {
  same_device(op, kernel, out.device(), others);
  if (bias.has_value() && bias->defined()) same_device(op, kernel, out.device(), {{"bias", &*bias}});
  writable_output(op, "out", out, others);
}

}  // namespace

Int4LinearSizes int4_linear(const at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                            const at::Tensor& weight_scale, const at::Tensor& weight_zero, int64_t group_size,
                            const c10::optional<at::Tensor>& bias, c10::DeviceType kernel) {
  const char* op = "int4_linear";
  const int64_t N = w_only_activations(op, out, input, bias);
  TORCH_CHECK(group_size >= 1, op, ": group_size must be >= 1, got ", group_size);
  const int64_t M = input.size(0), K = input.size(1), G = K == 0 ? 0 : (K + group_size - 1) / group_size;
  const int64_t P = w_only_panels(op, weight, N, K, 8, "4-bit codes");
  TORCH_CHECK(weight_scale.dim() == 3 && weight_scale.size(0) == P && weight_scale.size(1) == G && weight_scale.size(2) == 16,
              op, ": weight_scale must be [", P, ", ", G, ", 16] for group_size ", group_size, ", got ", weight_scale.sizes());
  TORCH_CHECK(weight_zero.sizes() == weight_scale.sizes(), op, ": weight_zero must be [", P, ", ", G, ", 16], got ",
              weight_zero.sizes());
  TORCH_CHECK(weight.scalar_type() == at::kByte, op, ": weight must be uint8, got ", weight.scalar_type());
  TORCH_CHECK(weight_scale.scalar_type() == at::kFloat, op, ": weight_scale must be float32, got ", weight_scale.scalar_type());
  TORCH_CHECK(weight_zero.scalar_type() == at::kByte, op, ": weight_zero must be uint8, got ", weight_zero.scalar_type());
  TORCH_CHECK(weight.is_contiguous() && weight_scale.is_contiguous() && weight_zero.is_contiguous(), op,
              ": weight, weight_scale and weight_zero must be contiguous");
  w_only_devices(op, kernel, out, bias,
                 {{"input", &input}, {"weight", &weight}, {"weight_scale", &weight_scale}, {"weight_zero", &weight_zero}});
  return {M, N, K, P, G};
}

Fp8LinearSizes fp8_linear(const at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                          const at::Tensor& weight_scale, int64_t block_k, const c10::optional<at::Tensor>& bias,
                          c10::DeviceType kernel) {
  const char* op = "fp8_linear";
  const int64_t N = w_only_activations(op, out, input, bias);
  TORCH_CHECK(block_k >= 0, op, ": block_k must be >= 0 (0: one scale per output channel), got ", block_k);
  const int64_t M = input.size(0), K = input.size(1), B = block_k == 0 ? 1 : (K + block_k - 1) / block_k;
  const int64_t P = w_only_panels(op, weight, N, K, 16, "FP8 codes");
  if (block_k == 0) {
    TORCH_CHECK(weight_scale.dim() == 1 && weight_scale.size(0) == N, op, ": weight_scale must be [", N,
                "] (per output channel, block_k 0), got ", weight_scale.sizes());
  } else {
    TORCH_CHECK(weight_scale.dim() == 2 && weight_scale.size(0) == N && weight_scale.size(1) == B, op,
                ": weight_scale must be [", N, ", ", B, "] for block_k ", block_k, ", got ", weight_scale.sizes());
  }
  TORCH_CHECK(weight.scalar_type() == at::kFloat8_e4m3fn, op, ": weight must be float8_e4m3fn, got ", weight.scalar_type());
  TORCH_CHECK(weight_scale.scalar_type() == at::kFloat, op, ": weight_scale must be float32, got ", weight_scale.scalar_type());
  TORCH_CHECK(weight.is_contiguous() && weight_scale.is_contiguous(), op, ": weight and weight_scale must be contiguous");
  w_only_devices(op, kernel, out, bias, {{"input", &input}, {"weight", &weight}, {"weight_scale", &weight_scale}});
  return {M, N, K, P, B};
}

}  // namespace pagedgen::checks
