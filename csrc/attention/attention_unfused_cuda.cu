// The curriculum's attention chain on the GPU: a tiled transpose and a tiled
// matmul, both through shared memory (puzzles 14 and 17). Deliberately the
// teaching kernels, with the S x S scores in global memory: the notebook compares
// them with the fused kernels. Batched over blockIdx.z (looped past 65535).
#include <cmath>

#include "attention/attention_unfused.h"
#include "common/device.cuh"

namespace gpu_puzzles {
namespace {

constexpr int kTile = 32;  // transpose tile edge
constexpr int kRows = 8;   // transpose threads in y; each covers kTile / kRows rows

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

// One 64x64 output tile per block of 16x16 threads, each thread a 4x4 register
// block (rows ty + 16i, columns tx + 16j); A and B tiles of depth 16 staged in
// shared memory along K (the puzzle-14 tiled matmul, register-blocked so that a
// shared-memory read feeds 4 FMAs instead of 1). A is stored k-major so both
// operands are read along a row of shared memory (broadcast or consecutive).
constexpr int kMT = 64;  // output tile edge
constexpr int kKT = 16;  // K depth per stage
constexpr int kTh = 16;  // threads per tile edge
constexpr int kPer = 4;  // outputs per thread per dim (kMT / kTh)
constexpr int kThreads = kTh * kTh;

template <typename T>
__global__ void __launch_bounds__(kThreads)
    matmul_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ c, int64_t B, int64_t M, int64_t N,
                  int64_t K, acc_t<T> alpha, bool causal) {
  using A = acc_t<T>;
  __shared__ T As[kKT][kMT + 1];  // As[k][m]
  __shared__ T Bs[kKT][kMT];      // Bs[k][n]
  const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * kTh + tx;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kMT, n0 = static_cast<int64_t>(blockIdx.x) * kMT;
  // A tile entirely above the diagonal is all -inf: skip its K loop (uniform per block).
  const bool all_masked = causal && n0 > m0 + kMT - 1;
  const T zero = from_acc<T, A>(A(0));
  for (int64_t z = blockIdx.z; z < B; z += gridDim.z) {  // uniform per block: barriers stay convergent
    const T* az = a + z * M * K;
    const T* bz = b + z * K * N;
    T* cz = c + z * M * N;
    A acc[kPer][kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i)
#pragma unroll
      for (int j = 0; j < kPer; ++j) acc[i][j] = A(0);
    if (!all_masked) {
      for (int64_t k0 = 0; k0 < K; k0 += kKT) {
#pragma unroll
        for (int e = 0; e < kMT * kKT / kThreads; ++e) {
          const int idx = tid + e * kThreads;
          const int r = idx / kKT, kk = idx % kKT;  // A: 16 consecutive k per row
          const int64_t am = m0 + r, ak = k0 + kk;
          As[kk][r] = (am < M && ak < K) ? az[am * K + ak] : zero;
          const int bkk = idx / kMT, col = idx % kMT;  // B: 64 consecutive columns per k
          const int64_t bk = k0 + bkk, bn = n0 + col;
          Bs[bkk][col] = (bk < K && bn < N) ? bz[bk * N + bn] : zero;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < kKT; ++kk) {
          A av[kPer], bv[kPer];
#pragma unroll
          for (int i = 0; i < kPer; ++i) av[i] = to_acc<A>(As[kk][ty + i * kTh]);
#pragma unroll
          for (int j = 0; j < kPer; ++j) bv[j] = to_acc<A>(Bs[kk][tx + j * kTh]);
#pragma unroll
          for (int i = 0; i < kPer; ++i)
#pragma unroll
            for (int j = 0; j < kPer; ++j) acc[i][j] += av[i] * bv[j];
        }
        __syncthreads();  // the next stage overwrites the tiles
      }
    }
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int64_t m = m0 + ty + i * kTh;
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        const int64_t n = n0 + tx + j * kTh;
        if (m < M && n < N) {
          cz[m * N + n] = (causal && n > m) ? from_acc<T, A>(-INFINITY) : from_acc<T, A>(alpha * acc[i][j]);
        }
      }
    }
  }
}

bool grid_fits(int64_t M, int64_t N, int64_t tile) {
  return (M + tile - 1) / tile <= 65535 && (N + tile - 1) / tile <= 2147483647LL;
}

// launch(T{}, grid, block) over tile x tile output tiles of B (M, N) matrices: grid.x
// along N, grid.y along M, grid.z the batch (the kernels loop past 65535).
template <typename F>
LaunchStatus launch_tiled(int64_t B, int64_t M, int64_t N, int64_t tile, dim3 block, DType dt, F&& launch) {
  if (B == 0 || M == 0 || N == 0) return 0;
  if (!grid_fits(M, N, tile)) return static_cast<LaunchStatus>(cudaErrorInvalidConfiguration);
  const dim3 grid(ceil_div_u(N, tile), ceil_div_u(M, tile), static_cast<unsigned>(B < 65535 ? B : 65535));
  dispatch_dtype(dt, [&](auto tag) { launch(tag, grid, block); });
  return static_cast<LaunchStatus>(cudaGetLastError());
}

}  // namespace

LaunchStatus transpose_last2_cuda(const void* x, void* out, int64_t B, int64_t M, int64_t N, DType dt,
                                  cudaStream_t stream) {
  return launch_tiled(B, M, N, kTile, dim3(kTile, kRows), dt, [&](auto tag, dim3 grid, dim3 block) {
    using T = decltype(tag);
    transpose_kernel<T><<<grid, block, 0, stream>>>(static_cast<const T*>(x), static_cast<T*>(out), B, M, N);
  });
}

LaunchStatus matmul_cuda(const void* a, const void* b, void* c, int64_t B, int64_t M, int64_t N, int64_t K,
                         double alpha, bool causal_mask, DType dt, cudaStream_t stream) {
  return launch_tiled(B, M, N, kMT, dim3(kTh, kTh), dt, [&](auto tag, dim3 grid, dim3 block) {
    using T = decltype(tag);
    matmul_kernel<T><<<grid, block, 0, stream>>>(static_cast<const T*>(a), static_cast<const T*>(b), static_cast<T*>(c),
                                                 B, M, N, K, static_cast<acc_t<T>>(alpha), causal_mask);
  });
}

}  // namespace gpu_puzzles
