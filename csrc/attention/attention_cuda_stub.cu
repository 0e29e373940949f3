// TEMPORARY stub, drop at merge: the fused kernels live in attention_cuda.cu
// (branch attn-cuda). Until then these definitions let the attn branch link;
// every call reports cudaErrorNotSupported.
#include "attention/attention.h"

namespace gpu_puzzles {

int64_t attention_backward_workspace_bytes(const AttentionBwdArgs&) { return 0; }

LaunchStatus attention_forward_cuda(const AttentionFwdArgs&, cudaStream_t) {
  return static_cast<LaunchStatus>(cudaErrorNotSupported);
}

LaunchStatus attention_backward_cuda(const AttentionBwdArgs&, void*, cudaStream_t) {
  return static_cast<LaunchStatus>(cudaErrorNotSupported);
}

}  // namespace gpu_puzzles
