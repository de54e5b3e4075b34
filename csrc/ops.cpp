// Op schemas of pagedgen._C: each op is defined once here and implemented per device in
// csrc/cpu/*.cpp (CPU) and csrc/cuda/*.cu (CUDA). Python reaches them as torch.ops.pagedgen.*
// through pagedgen/ops/, which also holds the plain PyTorch reference of every op.
//
// Layouts shared by all ops (one layer's cache):
//   key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size]
//   slot_mapping:           [num_tokens] int64, slot = block_id * block_size + offset; < 0 = padding
//   block_tables:           [num_seqs, max_blocks_per_seq] int32, logical block -> physical block
//   seq_lens:               [num_seqs] int32, context length of each sequence after this step
//   query_start_loc:        [num_seqs + 1] int32, the sequences' first query rows (0 ... num_tokens)
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(pagedgen, m) {
  // Write key/value [num_tokens, num_kv_heads, head_size] into their cache slots.
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping) -> ()");
  // Varlen attention of prefill chunks and decode rows: out/query [num_tokens, num_heads, head_size].
  // Rows query_start_loc[s] .. query_start_loc[s + 1] - 1 are the new tokens of sequence s, at
  // positions seq_lens[s] - q_len .. seq_lens[s] - 1 (q_len = their count, their keys and values
  // already in the cache); a row at position p attends over the positions <= p of its sequence,
  // through block_tables[s], and with sliding_window > 0 only over (p - sliding_window, p]
  // (transformers' Mistral/Qwen2 mask). A row at a negative position (seq_lens[s] < q_len, e.g. a
  // padding sequence with seq_len 0) gets zeros. num_heads % num_kv_heads == 0 (GQA).
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale, int sliding_window) -> ()");
  // Bidirectional (non-causal) attention over packed sequences, the encoders' (no KV cache): rows
  // cu_seqlens[s] .. cu_seqlens[s + 1] - 1 of query [num_tokens, num_heads, head_size] and of key, value
  // [num_tokens, num_kv_heads, head_size] are sequence s; out[t, h] = softmax(scale q[t, h] . k[u, h'])
  // weighted sum of v[u, h'] over the rows u of t's sequence, h' = h / (num_heads / num_kv_heads)
  // (GQA). Any strides (views of a fused qkv output); cu_seqlens [num_seqs + 1] int32 from 0 to
  // num_tokens, non-decreasing; float32 arithmetic, rounded once to out's dtype (= query's). A row's
  // bits depend on its own sequence only. A CPU kernel only (csrc/cpu/varlen_attention.cpp).
  m.def("varlen_attention(Tensor(a!) out, Tensor query, Tensor key, Tensor value, Tensor cu_seqlens, float scale) -> ()");
  // Copy whole blocks inside one layer's cache: block_mapping [num_pairs, 2] int64 (src, dst).
  m.def("copy_blocks(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor block_mapping) -> ()");
  // Copy whole blocks between two caches of the same shape on different devices (swap out / in):
  // block_mapping [num_pairs, 2] int64 (src block in src, dst block in dst).
  m.def("swap_blocks(Tensor src, Tensor(a!) dst, Tensor block_mapping) -> ()");

  // The model's small per-token layers, fused (one pass over the rows instead of several ATen ops).
  // CPU kernels only: on other devices pagedgen/ops runs their PyTorch reference.
  // RMSNorm of input [num_tokens, hidden] into out, as transformers' LlamaRMSNorm.
  m.def("rms_norm(Tensor(a!) out, Tensor input, Tensor weight, float epsilon) -> ()");
  // residual += input, then input = RMSNorm(residual): the residual add before a norm.
  m.def("fused_add_rms_norm(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float epsilon) -> ()");
  // Rotary position embedding (rotate-half) of query [num_tokens, num_heads, head_size] and key
  // [num_tokens, num_kv_heads, head_size] in place; cos, sin: [max_positions, head_size] float32.
  m.def("rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor cos, Tensor sin) -> ()");
  // out [num_tokens, d] = silu(input[:, :d]) * input[:, d:].
  m.def("silu_and_mul(Tensor(a!) out, Tensor input) -> ()");
  // residual = input + residual (in the model dtype), then input = LayerNorm(residual) with float32
  // statistics (torch.nn.LayerNorm's); weight and bias [hidden], both or neither (OPT's
  // elementwise_affine=False).
  m.def("fused_add_layer_norm(Tensor(a!) input, Tensor(b!) residual, Tensor? weight, Tensor? bias, float epsilon) -> ()");

  // out [M, N] = input [M, K] @ W^T (+ bias [N]), W [N, K] given as panels of 16 output features:
  // weight [ceil(N / 16), K, 16] with weight[p, k, j] = W[16 p + j, k] (zeros past N). Each output is
  // a float32 sum over k in order, then + bias, rounded to out's dtype (= input's): a row's bits never
  // depend on the other rows. A CPU kernel only (built with AVX2 + FMA).
  m.def("packed_linear(Tensor(a!) out, Tensor input, Tensor weight, Tensor? bias) -> ()");
  // The same product for bf16 input and weights on AVX512-BF16 CPUs: W given as bf16 pairs in panels
  // of 16 outputs, weight [ceil(N / 16), ceil(K / 2), 16, 2] with weight[p, q, j, t] = W[16 p + j, 2 q + t]
  // (zeros past N and K); each output is a float32 sum over the pairs in order (vdpbf16ps), then + bias,
  // rounded once to out's bf16: a row's bits never depend on the other rows. A CPU kernel only (built
  // with AVX512-BF16).
  m.def("packed_linear_bf16(Tensor(a!) out, Tensor input, Tensor weight, Tensor? bias) -> ()");
  // The same product with AMX tiles (tdpbf16ps; csrc/cpu/linear_amx.cpp), same weight layout and
  // checks; raises on a CPU without AMX. Batch-invariant by construction (its bits need not be
  // packed_linear_bf16's). Opt-in (PAGEDGEN_CPU_MATMUL=amx); in the amx level only (setup.py).
  m.def("packed_linear_bf16_amx(Tensor(a!) out, Tensor input, Tensor weight, Tensor? bias) -> ()");
  // Its tile loop on an emulation of the AMX tiles in plain C++ (any CPU; slow): tests the packing.
  m.def("packed_linear_bf16_amx_emulated(Tensor(a!) out, Tensor input, Tensor weight, Tensor? bias) -> ()");
  // W8A8 int8 (issue 46): out [M, N] (input's dtype) from input [M, K] (float32/bf16/fp16) quantized per row
  // to int8 (dynamic: max |x| / 127; or the static input_scale [1] float32), the int8 weight as pairs in
  // panels of 16 outputs, [ceil(N / 16), ceil(K / 2), 16, 2] with weight[p, q, j, t] = W[16 p + j, 2 q + t]
  // (zeros past N and K), exact int32 sums, then float32 acc * x_scale[m] * weight_scale[n] (+ bias[n]),
  // rounded once: a row's bits never depend on the other rows. A CPU kernel only (AVX2; reference elsewhere).
  m.def("int8_linear(Tensor(a!) out, Tensor input, Tensor weight, Tensor weight_scale, Tensor? input_scale, Tensor? bias) -> ()");
  // The same product (same arguments, checks and bits, for every M) with AMX-INT8 tiles (tdpbssd;
  // csrc/cpu/linear_amx.cpp, csrc/cpu/linear_int8_amx.h); raises on a CPU without AMX-INT8 and in builds
  // of a level below amx. pagedgen.layers.matmul.int8_linear picks it from INT8_AMX_MIN_ROWS rows.
  m.def("int8_linear_amx(Tensor(a!) out, Tensor input, Tensor weight, Tensor weight_scale, Tensor? input_scale, Tensor? bias) -> ()");
  // Its tile loop on an emulation of the AMX tiles in plain C++ (any CPU with AVX2; slow): the same bits.
  m.def("int8_linear_amx_emulated(Tensor(a!) out, Tensor input, Tensor weight, Tensor weight_scale, Tensor? input_scale, Tensor? bias) -> ()");
  // Multi-LoRA (issue 48; punica's SGMV shrink and expand in one op, vLLM's add_lora_linear): out [M, N]
  // (input's dtype) += each row's adapter delta, for input [M, K] (float32/bf16/fp16) whose row m has the
  // adapter slot slots[m] (int32 [M]; -1: none, the row is left as it is). lora_a [S, K, P R] holds each
  // slot's A transposed, its P parts side by side (lora_a[s, k, p R + i] = A_p[i, k]); lora_b [S, R, N]
  // (lora_a's dtype, float32/bf16/fp16) each slot's scaled B transposed, lora_b[s, i, n] = scale B_p[n -
  // off_p, i] for n in output slice p, the slices' sizes output_slices (P of them, summing to N). Row m:
  // h = x[m] @ lora_a[s] in float32 (a sum over k in order), out[m, n] += h[p R : (p + 1) R] @ lora_b[s, :, n]
  // (a sum over i in order), rounded once: a row's bits never depend on the other rows. A CPU kernel
  // only (built with AVX2 + FMA; slots read on the host and checked).
  m.def("add_lora_linear(Tensor(a!) out, Tensor input, Tensor lora_a, Tensor lora_b, Tensor slots, int[] output_slices) -> ()");
  // int4 W4A16 (issue 46; GPTQ / AWQ / compressed-tensors pack-quantized): out [M, N] (input's dtype) =
  // input [M, K] (float32/bf16/fp16) @ W^T + bias, W[n, k] = float32(q[n, k] - z[n, g]) * s[n, g] with
  // g = k / group_size; the 4-bit codes in panels of 16 outputs, weight [ceil(N / 16), K, 8] uint8 with
  // weight[p, k, b] = q[16 p + b, k] | q[16 p + b + 8, k] << 4 (zeros past N), weight_scale
  // [ceil(N / 16), ceil(K / group_size), 16] float32 and weight_zero of that shape, uint8. Each output a
  // float32 sum over k in order, then + bias, rounded once: a row's bits never depend on the other rows.
  // A CPU kernel only (AVX2; reference elsewhere). Checks: csrc/op_checks.h.
  m.def("int4_linear(Tensor(a!) out, Tensor input, Tensor weight, Tensor weight_scale, Tensor weight_zero, int group_size, Tensor? bias) -> ()");
  // FP8 W8A16 (issue 46; FP8 checkpoints, online quantization="fp8"): out [M, N] (input's dtype) = input
  // [M, K] (float32/bf16/fp16) @ W^T + bias, W[n, k] = float32(code[n, k]) * weight_scale[n] (block_k 0:
  // per output channel, weight_scale [N]) or * weight_scale[n, k / block_k] (block-wise, [N, ceil(K /
  // block_k)]), float32; the float8_e4m3fn codes in panels of 16 outputs, weight [ceil(N / 16), K, 16] with
  // weight[p, k, j] = code[16 p + j, k] (zeros past N; no NaN codes). Each output a float32 sum over k in
  // order, then + bias, rounded once: a row's bits never depend on the other rows. A CPU kernel only
  // (AVX2 + F16C; reference elsewhere). Checks: csrc/op_checks.h.
  m.def("fp8_linear(Tensor(a!) out, Tensor input, Tensor weight, Tensor weight_scale, int block_k, Tensor? bias) -> ()");
  // True when the CPU has AMX-TILE and AMX-BF16 and the OS enables the tile state (cpuid, xgetbv).
  m.def("cpu_has_amx() -> bool");
  // True when the CPU has AMX-TILE and AMX-INT8 and the OS enables the tile state (cpuid, xgetbv).
  m.def("cpu_has_amx_int8() -> bool");
  // The levels of CPU kernels this CPU and OS can run, lowest first: a prefix of ["avx2", "avx512_bf16",
  // "amx"] (csrc/cpu_features.cpp, in this baseline module).
  m.def("cpu_supported_isa() -> str[]");
  // What the CPU kernels loaded were compiled for: [level, instruction sets...] (csrc/cpu/module.cpp,
  // one per build pagedgen._C_cpu_<level>; pagedgen/ops/isa.py loads one).
  m.def("cpu_kernel_isa() -> str[]");

  // The sampler's greedy tokens: out [num_rows] int64 = logits.max(dim=-1).indices of logits
  // [num_rows, vocab] (the first maximal index; NaN counts as the maximum). A CPU kernel only.
  m.def("argmax(Tensor(a!) out, Tensor logits) -> ()");

  // The sampler's logprobs (vLLM's, of the raw logits): for each row r of logits [num_rows, vocab]
  // and its chosen token token_ids[r] (int64), out [num_rows, 3 + 2 * k_max] float64 = (the token,
  // its logprob logit - logsumexp(row) in float32, its rank: how many logits are >= its logit, then
  // the k_max largest logprobs by value descending, ties by lowest token id, then their token ids).
  // 0 <= k_max <= min(vocab, 20). A row's result depends on that row only. A CPU kernel only.
  m.def("logprob_topk(Tensor(a!) out, Tensor logits, Tensor token_ids, int k_max) -> ()");

  // The read of the 1-byte KV cache (kv_cache_dtype int8 / fp8, pagedgen/ops/kv_quant.py): out[u] =
  // codes[blocks[u]] dequantized, float(code) * float(scale) rounded to out's dtype; out [num_out,
  // block_size, num_kv_heads, head_size] float, codes [num_blocks, ...] int8 / float8, scales
  // [num_blocks, block_size, num_kv_heads] bf16, blocks [num_out] int64. A CPU kernel only.
  m.def("kv_dequantize_blocks(Tensor(a!) out, Tensor codes, Tensor scales, Tensor blocks) -> ()");
  // The write of the 1-byte KV cache: each token's key and value rows (per KV head) quantized with
  // their own scale into slot slot_mapping[t] (< 0: skipped), bitwise kv_quant.quantize: key, value
  // [num_tokens, num_kv_heads, head_size] float, caches [num_blocks, block_size, num_kv_heads,
  // head_size] int8 / float8, scales [num_blocks, block_size, num_kv_heads] bf16. A CPU kernel only.
  m.def(
      "reshape_and_cache_quantized(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor(c!) key_scales, Tensor(d!) value_scales, Tensor slot_mapping) -> ()");
  // paged_attention over the 1-byte KV cache, read by the kernel itself: key_cache / value_cache
  // [num_blocks, block_size, num_kv_heads, head_size] int8 / float8 codes, key_scales / value_scales
  // [num_blocks, block_size, num_kv_heads] bf16; float32 attention over the values float(code) *
  // float(scale) (each token's scale applied to its scores and weights: q . k = s_k (q . code)).
  // Other arguments as paged_attention's; every block id a row reads is checked before any work.
  // A CPU kernel only.
  m.def(
      "paged_attention_quantized(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor key_scales, Tensor value_scales, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, "
      "float scale, int sliding_window) -> ()");
}

// A bare module init so that `import pagedgen._C` loads the library (and runs the registrations). This
// baseline module holds the schemas, csrc/cpu_features.cpp and the CUDA kernels, compiled without
// -march; the CPU kernels are in the modules pagedgen._C_cpu_<level> (setup.py, pagedgen/ops/isa.py).
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
