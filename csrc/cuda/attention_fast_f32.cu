// Fast-path attention kernels for float (all head sizes x query heads per block); see attention_fast.cuh.
#include "attention_fast.cuh"

namespace pagedgen {
template bool launch_attention_fast<float>(const AttentionParams& p, cudaStream_t stream);
}  // namespace pagedgen
