// LayerNorm forward on CUDA: a row is held in registers (16-byte loads, all issued
// before any sum), so mean and variance are an exact two-pass in fp32 (fp64 for
// float64) at one read of x: a warp per row for short rows, a block per row for longer
// ones; rows too long for registers, or unaligned, use a looping kernel that re-reads x.
// The kernel choice: layernorm_linear_plan (layernorm_linear_plan.h). RMS (template flag):
// the same kernels with the mean forced to zero and no beta (rms_norm).
#include <type_traits>

#include "norms/layernorm_linear_device.cuh"

namespace gpu_puzzles {
namespace {

template <typename T, int VEC, bool RMS, typename O>
__global__ void __launch_bounds__(kFwdMaxThreads)
    ln_fwd_cached(const T* __restrict__ x, const T* __restrict__ gamma, const T* __restrict__ beta, O* __restrict__ y,
                  acc_t<T>* __restrict__ mean, acc_t<T>* __restrict__ rstd, int64_t M, int64_t H, double eps) {
  __shared__ acc_t<T> sh[64];
  for (int64_t row = blockIdx.x; row < M; row += gridDim.x)
    ln_row_cached<T, VEC, RMS, O>(row, x, gamma, beta, y, mean, rstd, H, eps, sh);
}

// Short rows (at most 32 * kCache vectors: H <= 1024 in bf16): one warp per row,
// kWarpRows rows per block, the row in registers, warp shuffles only (no barrier,
// no shared memory). The block-per-row kernel would run one-warp blocks here, and
// the SM's 32-block limit would cap it at half occupancy, halving the loads in
// flight. Same arithmetic as ln_row_cached (pivot shift, exact two-pass).

template <typename T, int VEC, bool RMS, typename O>
__global__ void __launch_bounds__(32 * kWarpRows, 6)
    ln_fwd_warp(const T* __restrict__ x, const T* __restrict__ gamma, const T* __restrict__ beta, O* __restrict__ y,
                acc_t<T>* __restrict__ mean, acc_t<T>* __restrict__ rstd, int64_t M, int64_t H, double eps) {
  using A = acc_t<T>;
  const int lane = threadIdx.x & 31;
  const int64_t nvec = H / VEC;
  // row is warp-uniform: every lane of a warp runs the same iterations (full-mask shuffles).
  for (int64_t row = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); row < M;
       row += (int64_t)gridDim.x * (blockDim.x >> 5)) {
    T v[kCache][VEC];
    A mu, rs;
    warp_row_stats<false, T, VEC, kCache, RMS>(x + row * H, v, lane, nvec, H, eps, mu, rs);
    if (lane == 0) {
      if constexpr (!RMS) mean[row] = mu;
      rstd[row] = rs;
    }
    if (y != nullptr) {
#pragma unroll
      for (int k = 0; k < kCache; ++k) {
        const int64_t c = lane + (int64_t)k * 32;
        if (c < nvec) {
          O o[VEC];
          normalise<T, VEC, RMS>(v[k], mu, rs, gamma, beta, c, o);
          store_pack<O, VEC>(y + row * H + c * VEC, o);
        }
      }
    }
  }
}

// Any H: three passes over the row (the later ones mostly hit L1/L2).
template <typename T, int VEC, bool RMS, typename O>
__global__ void ln_fwd_loop(const T* __restrict__ x, const T* __restrict__ gamma, const T* __restrict__ beta,
                            O* __restrict__ y, acc_t<T>* __restrict__ mean, acc_t<T>* __restrict__ rstd, int64_t M,
                            int64_t H, double eps) {
  using A = acc_t<T>;
  __shared__ A sh[64];
  const int64_t nvec = H / VEC;
  for (int64_t row = blockIdx.x; row < M; row += gridDim.x) {
    const T* xr = x + row * H;
    A mu1 = A(0);
    if constexpr (!RMS) {
      const A pivot = to_acc<A>(xr[0]);  // see ln_row_cached
      A s = 0, unused = 0;
      for (int64_t c = threadIdx.x; c < nvec; c += blockDim.x) {
        T v[VEC];
        load_pack<T, VEC>(v, xr + c * VEC);
        sum_shifted<T, VEC>(v, pivot, s);
      }
      block_sum2(s, unused, sh);
      mu1 = pivot + s / A(H);
    }
    A q = 0, e = 0;  // second pass about mu1 (finish_stats)
    for (int64_t c = threadIdx.x; c < nvec; c += blockDim.x) {
      T v[VEC];
      load_pack<T, VEC>(v, xr + c * VEC);
      sum_centred<T, VEC, RMS>(v, mu1, e, q);
    }
    A mu, rs;
    finish_block_row<A, RMS>(mu1, e, q, H, eps, row, mean, rstd, sh, mu, rs);
    if (y != nullptr) {
      for (int64_t c = threadIdx.x; c < nvec; c += blockDim.x) {
        T v[VEC];
        O o[VEC];
        load_pack<T, VEC>(v, xr + c * VEC);
        normalise<T, VEC, RMS>(v, mu, rs, gamma, beta, c, o);
        store_pack<O, VEC>(y + row * H + c * VEC, o);
      }
    }
  }
}

}  // namespace

LaunchStatus layer_norm_forward_cuda(const void* x, const void* gamma, const void* beta, void* y, void* mean,
                                     void* rstd, int64_t M, int64_t H, double eps, DType dtype, cudaStream_t stream,
                                     Norm norm, DType out) {
  if (M == 0) return cudaSuccess;
  if (!mixed_pair_ok(dtype, out)) return cudaErrorNotSupported;
  auto run = [&](auto tag, auto out_tag, auto rms_c) {
    constexpr bool R = decltype(rms_c)::value;
    using T = decltype(tag);
    using O = decltype(out_tag);
    using A = acc_t<T>;
    constexpr int V = vec_of<T>();
    const T *xp = static_cast<const T*>(x), *gp = static_cast<const T*>(gamma), *bp = static_cast<const T*>(beta);
    O* yp = static_cast<O*>(y);
    A *mp = static_cast<A*>(mean), *rp = static_cast<A*>(rstd);
    const Plan p = layernorm_linear_plan(Stage::kForward, H, V, all_aligned({x, gamma, beta, y}));
    auto launch = [&](auto kernel, unsigned grid) {
      kernel<<<grid, p.threads, 0, stream>>>(xp, gp, bp, yp, mp, rp, M, H, eps);
    };
    switch (p.rows) {
      case Rows::kWarp: {
        const unsigned grid = row_grid((M + kWarpRows - 1) / kWarpRows);
        p.vec ? launch(ln_fwd_warp<T, V, R, O>, grid) : launch(ln_fwd_warp<T, 1, R, O>, grid);
        break;
      }
      case Rows::kBlock:
        p.vec ? launch(ln_fwd_cached<T, V, R, O>, row_grid(M)) : launch(ln_fwd_cached<T, 1, R, O>, row_grid(M));
        break;
      default:
        p.vec ? launch(ln_fwd_loop<T, V, R, O>, row_grid(M)) : launch(ln_fwd_loop<T, 1, R, O>, row_grid(M));
    }
    return 0;
  };
  dispatch_dtype(dtype, [&](auto tag) {
    return with_out_dtype(tag, out, [&](auto o) {
      return norm == Norm::kRms ? run(tag, o, std::true_type{}) : run(tag, o, std::false_type{});
    });
  });
  return cudaGetLastError();
}

}  // namespace gpu_puzzles
