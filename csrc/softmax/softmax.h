// Torch-free interface between softmax.cpp (ATen side) and softmax_cuda.cu.
// Every tensor is contiguous and viewed as (outer, N, inner), N the reduced dim.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/dtype.h"

namespace gpu_puzzles {

// Auto: the fastest kernel for the shape. The other three are the curriculum's
// steps, kept for the notebook; they run one block per row over a contiguous
// last dim (the host moves another dim last first):
//   Tree    : the seed's shared-memory tree reduction, three passes (max, sum, write);
//   Shuffle : warp-shuffle block reduction, three passes;
//   Online  : single-pass running (max, sum), then one write pass.
enum class SoftmaxAlgo : int { Auto = 0, Tree = 1, Shuffle = 2, Online = 3 };

struct SoftmaxArgs {
  const void* a;  // forward: x;     backward: y (the forward's output)
  const void* b;  // forward: null;  backward: dy
  void* out;      // forward: y;     backward: dx
  int64_t outer, N, inner;
  bool log;       // log_softmax instead of softmax
  DType dtype;
};

// Bytes of scratch the launch needs (the split path for very long rows keeps
// per-chunk partial statistics there); 0 when none.
int64_t softmax_workspace_bytes(const SoftmaxArgs& a, SoftmaxAlgo algo, bool backward);

LaunchStatus softmax_forward_cuda(const SoftmaxArgs& a, SoftmaxAlgo algo, void* workspace, cudaStream_t stream);
LaunchStatus softmax_backward_cuda(const SoftmaxArgs& a, SoftmaxAlgo algo, void* workspace, cudaStream_t stream);

}  // namespace gpu_puzzles
