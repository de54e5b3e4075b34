// Fast-path attention kernels for __half (all head sizes x query heads per block); see attention_fast.cuh.
#include "attention_fast.cuh"

namespace pagedgen {
template bool launch_attention_fast<__half>(const AttentionParams& p, cudaStream_t stream);
}  // namespace pagedgen
