// Torch-free interface between cross_entropy.cpp (ATen side), the CUDA kernels
// (cross_entropy_cuda.cu) and the CPU kernels (cross_entropy_cpu.cpp).
// Logits are rows of V classes, row r at row_offset(ls, r) elements from the base with
// unit innermost stride (views such as logits[:, :-1, :] are read in place); targets
// one per row, at row_offset(ts, r). Statistics are in the accumulate type A: float,
// double for float64 logits.
// softcap c > 0 (0: off) soft-caps every logit first, z = c * tanh(x / c) (Gemma 2's
// final logits): the loss, lse and softmax are those of z, and the gradient carries
// dz/dx = 1 - tanh(x / c)^2.
#pragma once
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>

#include "common/cpu_isa.h"
#include "common/dtype.h"
#include "common/row_strides.h"

namespace gpu_puzzles {

struct CeFwdArgs {
  const void* logits;
  RowStrides ls;
  const void* target;  // int64 (target64) or int32
  bool target64;
  RowStrides ts;
  void* loss;  // (rows,) A: lse - logit[target]; 0 for an ignored row, NaN for a target outside [0, V)
  void* lse;   // (rows,) A: log-sum-exp of the row; 0 for an ignored row (not computed)
  int64_t rows, V, ignore_index;
  DType dtype;
  int threads;  // CUDA block size (cross_entropy_plan)
  // Optional (CUDA): the gradient of each non-ignored row written over the logits
  // themselves right after its lse, as the backward would with scale[0] (A) -- the fused
  // op's chunks, whose logits are not needed afterwards; the row is re-read from L2.
  bool grad_in_place = false;
  const void* scale = nullptr;
  double softcap = 0;
};

// grad[r, j] = (exp(logit[r, j] - lse[r]) - (j == target[r])) * scale[per_row ? r : 0] (times dz/dx
// with a softcap); zero rows
// for ignored targets; a target outside [0, V) gets no one-hot term (never indexed).
// grad may be the logits themselves (in place: same pointer, grad_stride matching a
// one-level ls); otherwise row r of grad starts at r * grad_stride.
struct CeBwdArgs {
  const void* logits;
  RowStrides ls;
  const void* target;
  bool target64;
  RowStrides ts;
  const void* lse;    // (rows,) A
  const void* scale;  // A, device (CUDA) or host memory (CPU) alike with the tensors
  bool scale_per_row;
  void* grad;
  int64_t grad_stride;
  int64_t rows, V, ignore_index;
  DType dtype;
  int threads;
  double softcap = 0;
};

// One block, fixed order (deterministic), on CUDA: the count of non-ignored targets n and
//   loss mode  (loss_rows set):  out (logits' dtype, 0-d) = sum(loss_rows) / n (mean) or the sum;
//   scale mode (loss_rows null): out (A, 0-d) = g / n (mean) or g, g = *grad_loss (logits'
//                                dtype) or 1 when grad_loss is null.
// Replaces the handful of small ATen kernels (ne, sum, sum, div, cast) of the same math.
struct CeReduceArgs {
  const void* loss_rows;  // (rows,) A
  const void* target;
  bool target64;
  RowStrides ts;
  int64_t rows, ignore_index;
  bool mean;
  const void* grad_loss;
  void* out;
  DType dtype;
};
LaunchStatus cross_entropy_reduce_cuda(const CeReduceArgs& a, cudaStream_t stream);

// CPU kernels (float / double only: the host converts half types), one copy per SIMD level.
GP_CPU_DECLARE(void, cross_entropy_forward_cpu, const CeFwdArgs& a)
GP_CPU_DECLARE(void, cross_entropy_backward_cpu, const CeBwdArgs& a)

LaunchStatus cross_entropy_forward_cuda(const CeFwdArgs& a, cudaStream_t stream);
LaunchStatus cross_entropy_backward_cuda(const CeBwdArgs& a, cudaStream_t stream);

}  // namespace gpu_puzzles
