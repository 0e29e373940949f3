// Interface between conv1d.cpp (host checks) and the kernels: conv1d_cpu.cpp,
// and the torch-free conv1d_cuda.cu (at::Tensor is only declared here).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/dtype.h"
#include "common/row_strides.h"

namespace at {
class Tensor;
}

namespace gpu_puzzles {

// CPU kernels (conv1d_cpu.cpp) on contiguous tensors of one floating dtype:
// x and out (..., L), weight (C, K) or (K,), bias (C,) or undefined; the
// rows of x cycle through the C channels. out, dx, dw and db are written whole.
void conv1d_forward_cpu_kernel(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                               const at::Tensor& out, bool causal);
void conv1d_backward_cpu_kernel(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
                                const at::Tensor& dx, const at::Tensor& dw, const at::Tensor& db, bool causal);

enum class Conv1dAlgo : int { Fast = 1, Tiled = 2, Naive = 3 };

// Widest kernel the fast path handles (halo fits in one neighbouring chunk).
constexpr int kConv1dFastMaxK = 9;
// The tiled path keeps TILE + K - 1 inputs and K taps in shared memory.
constexpr int kConv1dTiledMaxK = 2048;

// Depthwise conv over (B, C, L) rows (x: row b * C + c at row_offset(xs, b * C + c), so
// views such as one half of xz.chunk(2, dim=1) are read in place; out contiguous) with
// weights (C, K) whose rows start every w_stride elements.
// out[b,c,i] = bias[c] + sum_j x[b,c,i-shift+j] * w[c,j], zero outside [0, L);
// shift = 0 is the seed's look-ahead form, shift = K-1 the causal form.
struct Conv1dArgs {
  const void* x;
  const void* w;
  const void* bias;  // may be null
  void* out;
  int64_t B, C, L;
  int K;
  bool causal;
  DType dtype;
  RowStrides xs;
  int64_t w_stride;
};

LaunchStatus conv1d_forward_cuda(const Conv1dArgs& a, Conv1dAlgo algo, cudaStream_t stream);

// Workspace the fast backward needs, in elements of the accumulate type
// (float, or double for float64).
int64_t conv1d_backward_fast_workspace(int64_t B, int64_t C, int64_t L, int K);

// Fused fast backward: dx, dw and dbias in one pass over dy and x.
// `workspace` holds conv1d_backward_fast_workspace(...) accumulate-type elements.
// dy and x are read through their row strides, w through w_stride; dx is contiguous.
LaunchStatus conv1d_backward_fast_cuda(const void* dy, RowStrides dys, const void* x, RowStrides xs, const void* w,
                                       int64_t w_stride, void* dx, void* dw, void* dbias, void* workspace, int64_t B,
                                       int64_t C, int64_t L, int K, bool causal, DType dtype, cudaStream_t stream);

// dw and dbias by one block per (channel, tap): the path for any K.
LaunchStatus conv1d_weight_grad_generic_cuda(const void* dy, RowStrides dys, const void* x, RowStrides xs, void* dw,
                                             void* dbias, int64_t B, int64_t C, int64_t L, int K, bool causal,
                                             DType dtype, cudaStream_t stream);

}  // namespace gpu_puzzles
