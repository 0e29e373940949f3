// Interface between rotary.cpp (host checks) and the kernels: rotary_cpu.cpp and the
// torch-free rotary_cuda.cu (at::Tensor is only declared here).
// Rotary position embedding as transformers applies it: out = x * cos + rotate_half(x) * sin
// over the first R elements of each row (rotate_half(x) = cat(-x[R/2:R], x[:R/2])), the
// rest of the row copied (partial rotary, R < D).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/dtype.h"

#ifdef __CUDACC__
#define GP_ROTARY_HD __host__ __device__ __forceinline__
#else
#define GP_ROTARY_HD inline
#endif

namespace at {
class Tensor;
}

namespace gpu_puzzles {

// A tensor as rows (n0, n1, n2) of elements, each row unit-stride: row (i0, i1, i2) starts
// i0 * s0 + i1 * s1 + i2 * s2 elements from the base. cos and sin are read through the
// strides of their broadcast over q's (or k's) rows, 0 where they broadcast.
struct RotaryRows {
  int64_t n1 = 1, n2 = 1;
  int64_t s0 = 0, s1 = 0, s2 = 0;
};

// The three row indices of row r of a tensor with rows (., x.n1, x.n2).
struct RowIndex {
  int64_t i0, i1, i2;
};
GP_ROTARY_HD RowIndex row_index(const RotaryRows& x, int64_t r) {
  const int64_t i2 = r % x.n2, q = r / x.n2;
  return {q / x.n1, q % x.n1, i2};
}
GP_ROTARY_HD int64_t row_start(const RotaryRows& s, const RowIndex& i) {
  return i.i0 * s.s0 + i.i1 * s.s1 + i.i2 * s.s2;
}

// One tensor of the pair: its rows, cos's and sin's strides over them, and the contiguous
// output.
struct RotaryOperand {
  const void* x;          // q or k (forward), their output's gradient (backward)
  void* out;              // contiguous, x's shape
  RotaryRows xr, cr, sr;  // x, cos, sin
  int64_t rows;
};

// forward: out = x * cos + rotate_half(x) * sin; backward (x is the output's gradient):
// out = x * cos + rotate_half^T(x * sin), the transpose of the forward's linear map.
struct RotaryArgs {
  RotaryOperand op[2];  // q, k
  const void* cos;
  const void* sin;
  int64_t D;  // row width of q and k
  int64_t R;  // rotated width: cos.size(-1), even, <= D
  bool backward;
  DType in, cs, out;  // x's, cos/sin's and out's element types
};

// CPU kernel: the same arguments (pointers to CPU memory).
void rotary_cpu_kernel(const RotaryArgs& a);

LaunchStatus rotary_cuda(const RotaryArgs& a, int dev, cudaStream_t stream);

}  // namespace gpu_puzzles
