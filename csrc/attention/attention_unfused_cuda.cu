// The curriculum's attention chain on the GPU: a tiled transpose and a tiled
// matmul, both through shared memory (puzzles 14 and 17). Deliberately the
// teaching kernels, with the S x S scores in global memory: the notebook compares
// them with the fused kernels. Batched over blockIdx.z (looped past 65535).
#include <cmath>

#include "attention/attention_unfused.h"
#include "common/device.cuh"

namespace gpu_puzzles {
namespace {

constexpr int kTile = 32;  // tile edge
constexpr int kRows = 8;   // threads in y; each thread covers kTile / kRows rows

// Load a 32x32 tile with coalesced reads along N, write it transposed with
// coalesced writes along M; the +1 column keeps the transposed reads conflict-free.
template <typename T>
__global__ void transpose_kernel(const T* __restrict__ x, T* __restrict__ out, int64_t B, int64_t M, int64_t N) {
  __shared__ T tile[kTile][kTile + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kTile, n0 = static_cast<int64_t>(blockIdx.x) * kTile;
  for (int64_t z = blockIdx.z; z < B; z += gridDim.z) {  // uniform per block: barriers stay convergent
    const T* xz = x + z * M * N;
    T* oz = out + z * M * N;
#pragma unroll
    for (int r = ty; r < kTile; r += kRows) {
      const int64_t m = m0 + r, n = n0 + tx;
      if (m < M && n < N) tile[r][tx] = xz[m * N + n];
    }
    __syncthreads();
#pragma unroll
    for (int r = ty; r < kTile; r += kRows) {
      const int64_t n = n0 + r, m = m0 + tx;  // out row n, column m
      if (n < N && m < M) oz[n * M + m] = tile[tx][r];
    }
    __syncthreads();  // the next batch item reuses the tile
  }
}

// One 32x32 output tile per block, 32x8 threads, 4 outputs per thread; A and B
// tiles staged in shared memory along K (the puzzle-14 tiled matmul).
template <typename T>
__global__ void matmul_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ c, int64_t B,
                              int64_t M, int64_t N, int64_t K, acc_t<T> alpha, bool causal) {
  using A = acc_t<T>;
  __shared__ T As[kTile][kTile + 1];
  __shared__ T Bs[kTile][kTile + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kTile, n0 = static_cast<int64_t>(blockIdx.x) * kTile;
  // A tile entirely above the diagonal is all -inf: skip its K loop (uniform per block).
  const bool all_masked = causal && n0 > m0 + kTile - 1;
  const T zero = from_acc<T, A>(A(0));
  for (int64_t z = blockIdx.z; z < B; z += gridDim.z) {
    const T* az = a + z * M * K;
    const T* bz = b + z * K * N;
    T* cz = c + z * M * N;
    A acc[kTile / kRows];
#pragma unroll
    for (int i = 0; i < kTile / kRows; ++i) acc[i] = A(0);
    if (!all_masked) {
      for (int64_t k0 = 0; k0 < K; k0 += kTile) {
#pragma unroll
        for (int i = 0; i < kTile / kRows; ++i) {
          const int r = ty + i * kRows;
          const int64_t am = m0 + r, ak = k0 + tx, bk = k0 + r, bn = n0 + tx;
          As[r][tx] = (am < M && ak < K) ? az[am * K + ak] : zero;
          Bs[r][tx] = (bk < K && bn < N) ? bz[bk * N + bn] : zero;
        }
        __syncthreads();
#pragma unroll 8
        for (int kk = 0; kk < kTile; ++kk) {
          const A bv = to_acc<A>(Bs[kk][tx]);
#pragma unroll
          for (int i = 0; i < kTile / kRows; ++i) acc[i] += to_acc<A>(As[ty + i * kRows][kk]) * bv;
        }
        __syncthreads();
      }
    }
#pragma unroll
    for (int i = 0; i < kTile / kRows; ++i) {
      const int64_t m = m0 + ty + i * kRows, n = n0 + tx;
      if (m < M && n < N) {
        cz[m * N + n] = (causal && n > m) ? from_acc<T, A>(-INFINITY) : from_acc<T, A>(alpha * acc[i]);
      }
    }
  }
}

bool grid_fits(int64_t M, int64_t N) {
  return (M + kTile - 1) / kTile <= 65535 && (N + kTile - 1) / kTile <= 2147483647LL;
}

}  // namespace

LaunchStatus transpose_last2_cuda(const void* x, void* out, int64_t B, int64_t M, int64_t N, DType dt,
                                  cudaStream_t stream) {
  if (B == 0 || M == 0 || N == 0) return 0;
  if (!grid_fits(M, N)) return static_cast<LaunchStatus>(cudaErrorInvalidConfiguration);
  const dim3 grid(ceil_div_u(N, kTile), ceil_div_u(M, kTile), static_cast<unsigned>(B < 65535 ? B : 65535));
  const dim3 block(kTile, kRows);
  dispatch_dtype(dt, [&](auto tag) {
    using T = decltype(tag);
    transpose_kernel<T><<<grid, block, 0, stream>>>(static_cast<const T*>(x), static_cast<T*>(out), B, M, N);
  });
  return static_cast<LaunchStatus>(cudaGetLastError());
}

LaunchStatus matmul_cuda(const void* a, const void* b, void* c, int64_t B, int64_t M, int64_t N, int64_t K,
                         double alpha, bool causal_mask, DType dt, cudaStream_t stream) {
  if (B == 0 || M == 0 || N == 0) return 0;
  if (!grid_fits(M, N)) return static_cast<LaunchStatus>(cudaErrorInvalidConfiguration);
  const dim3 grid(ceil_div_u(N, kTile), ceil_div_u(M, kTile), static_cast<unsigned>(B < 65535 ? B : 65535));
  const dim3 block(kTile, kRows);
  dispatch_dtype(dt, [&](auto tag) {
    using T = decltype(tag);
    matmul_kernel<T><<<grid, block, 0, stream>>>(static_cast<const T*>(a), static_cast<const T*>(b),
                                                 static_cast<T*>(c), B, M, N, K,
                                                 static_cast<acc_t<T>>(alpha), causal_mask);
  });
  return static_cast<LaunchStatus>(cudaGetLastError());
}

}  // namespace gpu_puzzles
