// Torch-free interface between softmax.cpp (ATen side), the CUDA files and the CPU
// kernels (softmax_cpu.cpp). Every tensor is viewed as (outer, N, inner), N the
// reduced dim; outputs are contiguous, inputs contiguous except the CUDA rows
// (inner == 1) of the auto algorithm, whose rows may sit at any strides (RowStrides).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/cpu_isa.h"
#include "common/dtype.h"
#include "common/row_strides.h"
#include "softmax/softmax_plan.h"  // SoftmaxTuning

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
  bool log;  // log_softmax instead of softmax
  DType dtype;
  SoftmaxTuning tune;  // softmax_tuning(), filled by the caller
  // Row starts of a and b (common/row_strides.h; inner == 1 only: the CPU and the
  // other CUDA paths take contiguous inputs, {1, N, 0}); `out` is always contiguous.
  RowStrides la, lb;
};

// Bytes of scratch the launch needs (the split path for very long rows keeps
// per-chunk partial statistics there); 0 when none.
int64_t softmax_workspace_bytes(const SoftmaxArgs& a, SoftmaxAlgo algo, bool backward);

// CPU kernels (softmax_cpu.cpp, one copy per SIMD level: call through GP_CPU_CALL).
// Every algorithm runs the same CPU kernel; `tune` is ignored. N >= 1, outer * inner >= 1.
GP_CPU_DECLARE(void, softmax_forward_cpu, const SoftmaxArgs& a)
GP_CPU_DECLARE(void, softmax_backward_cpu, const SoftmaxArgs& a)

LaunchStatus softmax_forward_cuda(const SoftmaxArgs& a, SoftmaxAlgo algo, void* workspace, cudaStream_t stream);
LaunchStatus softmax_backward_cuda(const SoftmaxArgs& a, SoftmaxAlgo algo, void* workspace, cudaStream_t stream);

}  // namespace gpu_puzzles
