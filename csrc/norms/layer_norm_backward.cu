// LayerNorm backward on CUDA: persistent blocks, each walks rows and keeps its
// dgamma/dbeta partial sums per owned column in registers; a second kernel sums the
// per-block partials in a fixed order (deterministic). Also the fused backward's db
// (dy's column sums, the same fixed-order reduction). The kernel choice:
// layernorm_linear_plan (layernorm_linear_plan.h); the grid is sized here.
#include <type_traits>

#include "norms/layernorm_linear_device.cuh"

namespace gpu_puzzles {
namespace {

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * gamma.
// part: [2][gridDim.x][H] partial sums of dy*xhat (dgamma) and dy (dbeta).
// C vectors per thread; R rows per step: the loads of all R rows are issued before
// the one block reduction (2R sums), so a block keeps R rows of traffic in flight.
// gamma is re-read (L1-resident) every step rather than held, to leave the registers
// to the rows. One vector per thread (C == 1): the next step's rows are loaded before
// this step's block reduction, so loads stay in flight through the barriers and the
// stores, where a block (one per SM at 512 threads) would otherwise have none. With
// kCache vectors, or fp64, the second set of rows does not fit the registers. Measured:
// benchmarks/results/layer_norm_variants_h100.txt, lnlinear_prep_variants_h100.txt.
// XN: also write xn = gamma * xhat + beta (the fused backward's dW operand), saving
// that backward a separate pass over x.
// RMS: the mean forced to zero and no beta (rms_norm): dx = rstd * (g - xhat * mean(g * xhat)),
// no dbeta partials (mean, beta may be null).
// dx may be dy (in place: the fused backward's dxn buffer): each element is read by the
// thread that writes it, before it writes it (a prefetch reads rows of later steps
// only); so neither pointer is __restrict__.
// G: dy's and xn's type, T's, or a half type beside a float32 x (the fused backward under
// autocast reads the half GEMM's dxn and writes the half dW operand as they are).
template <typename T, int VEC, int C, int R, bool XN, bool RMS, typename G>
__global__ void __launch_bounds__(C == 1 ? kBwdMaxThreadsNarrow : kBwdMaxThreads)
    ln_bwd_cached(const G* dy, const T* __restrict__ x, const T* __restrict__ gamma, const acc_t<T>* __restrict__ mean,
                  const acc_t<T>* __restrict__ rstd, T* dx, acc_t<T>* __restrict__ part, const T* __restrict__ beta,
                  G* __restrict__ xn, int64_t M, int64_t H) {
  using A = acc_t<T>;
  constexpr bool kPrefetch = C == 1 && sizeof(T) <= 4;  // fp64: the second set spilled (48 bytes at 128 registers)
  __shared__ A sh[64 * R];
  const int64_t nvec = H / VEC;
  A pg[C][VEC], pb[C][VEC];
#pragma unroll
  for (int k = 0; k < C; ++k)
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      pg[k][i] = A(0);
      pb[k][i] = A(0);
    }
  // One step: rows r .. r+R-1 of x and dy and their statistics (rows past M: zero
  // statistics, no loads). A struct, so the prefetched step is taken over by assignment.
  struct Rows {
    T x[R][C][VEC];
    G d[R][C][VEC];
    A mu[R], rs[R];
  };
  auto load_rows = [&](int64_t r, Rows& w) {
#pragma unroll
    for (int j = 0; j < R; ++j) {
      const bool live = r + j < M;  // block-uniform
      if constexpr (RMS)
        w.mu[j] = A(0);
      else
        w.mu[j] = live ? mean[r + j] : A(0);
      w.rs[j] = live ? rstd[r + j] : A(0);
#pragma unroll
      for (int k = 0; k < C; ++k) {
        const int64_t c = threadIdx.x + (int64_t)k * blockDim.x;
        if (live && c < nvec) {
          load_pack<T, VEC>(w.x[j][k], x + (r + j) * H + c * VEC);
          load_pack<G, VEC>(w.d[j][k], dy + (r + j) * H + c * VEC);
        }
      }
    }
  };
  Rows cur;
  auto& xv = cur.x;
  auto& dv = cur.d;
  auto& mu = cur.mu;
  auto& rs = cur.rs;
  const int64_t stride = (int64_t)gridDim.x * R;
  int64_t r0 = (int64_t)blockIdx.x * R;
  if (kPrefetch && r0 < M) load_rows(r0, cur);
  for (; r0 < M; r0 += stride) {
    // This step's gamma vectors, all loaded before any arithmetic (loaded inside the
    // guarded loops below, each vector's arithmetic would wait for its own load). Not
    // held for the whole kernel: that costs registers the rows need.
    T gt[C][VEC];
    for_cached<C>(nvec, [&](int k, int64_t c) { load_pack<T, VEC>(gt[k], gamma + c * VEC); });
    A s[2 * R];
#pragma unroll
    for (int j = 0; j < 2 * R; ++j) s[j] = A(0);
    if (!kPrefetch) load_rows(r0, cur);
#pragma unroll
    for (int j = 0; j < R; ++j) {
      if (r0 + j >= M) break;
      for_cached<C>(nvec, [&](int k, int64_t c) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const A xh = (to_acc<A>(xv[j][k][i]) - mu[j]) * rs[j], d = to_acc<A>(dv[j][k][i]), g = to_acc<A>(gt[k][i]);
          if constexpr (!RMS) s[2 * j] += d * g;
          s[2 * j + 1] += d * g * xh;
          pg[k][i] += d * xh;
          if constexpr (!RMS) pb[k][i] += d;
        }
      });
    }
    Rows next;  // the next step's rows (kPrefetch)
    if (kPrefetch && r0 + stride < M) load_rows(r0 + stride, next);
    block_sum_n<A, 2 * R>(s, sh);
#pragma unroll
    for (int j = 0; j < R; ++j) {
      if (r0 + j >= M) break;
      const A m1 = s[2 * j] / A(H), m2 = s[2 * j + 1] / A(H);
      for_cached<C>(nvec, [&](int k, int64_t c) {
        T o[VEC];
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const A xh = (to_acc<A>(xv[j][k][i]) - mu[j]) * rs[j];
          o[i] = from_acc<T>(rs[j] * (to_acc<A>(dv[j][k][i]) * to_acc<A>(gt[k][i]) - m1 - xh * m2));
        }
        store_pack<T, VEC>(dx + (r0 + j) * H + c * VEC, o);
        if constexpr (XN) {  // the LayerNorm output, as the forward's normalise computes it
          G on[VEC];
          normalise<T, VEC, RMS>(xv[j][k], mu[j], rs[j], gamma, beta, c, on);
          store_pack<G, VEC>(xn + (r0 + j) * H + c * VEC, on);
        }
      });
    }
    if constexpr (kPrefetch) cur = next;
  }
  A* pgr = part + (int64_t)blockIdx.x * H;
  A* pbr = part + ((int64_t)gridDim.x + blockIdx.x) * H;
  for_cached<C>(nvec, [&](int k, int64_t c) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      pgr[c * VEC + i] = pg[k][i];
      if constexpr (!RMS) pbr[c * VEC + i] = pb[k][i];
    }
  });
}

// Any H: the block's partial rows live in `part` (each column owned by one thread).
// dx may be dy, as in ln_bwd_cached.
template <typename T, bool RMS, typename G>
__global__ void ln_bwd_loop(const G* dy, const T* __restrict__ x, const T* __restrict__ gamma,
                            const acc_t<T>* __restrict__ mean, const acc_t<T>* __restrict__ rstd, T* dx,
                            acc_t<T>* __restrict__ part, const T* __restrict__ beta, G* __restrict__ xn, int64_t M,
                            int64_t H) {
  using A = acc_t<T>;
  __shared__ A sh[64];
  A* pgr = part + (int64_t)blockIdx.x * H;
  A* pbr = part + ((int64_t)gridDim.x + blockIdx.x) * H;
  for (int64_t c = threadIdx.x; c < H; c += blockDim.x) {
    pgr[c] = A(0);
    if constexpr (!RMS) pbr[c] = A(0);
  }
  for (int64_t row = blockIdx.x; row < M; row += gridDim.x) {
    const A mu = RMS ? A(0) : mean[row], rs = rstd[row];
    const T* xr = x + row * H;
    const G* dr = dy + row * H;
    A s1 = 0, s2 = 0;
    for (int64_t c = threadIdx.x; c < H; c += blockDim.x) {
      const A xh = (to_acc<A>(xr[c]) - mu) * rs, d = to_acc<A>(dr[c]), gd = d * to_acc<A>(gamma[c]);
      if constexpr (!RMS) s1 += gd;
      s2 += gd * xh;
      pgr[c] += d * xh;
      if constexpr (!RMS) pbr[c] += d;
    }
    block_sum2(s1, s2, sh);
    const A m1 = s1 / A(H), m2 = s2 / A(H);
    for (int64_t c = threadIdx.x; c < H; c += blockDim.x) {
      const A xh = (to_acc<A>(xr[c]) - mu) * rs;
      dx[row * H + c] = from_acc<T>(rs * (to_acc<A>(dr[c]) * to_acc<A>(gamma[c]) - m1 - xh * m2));
      if (xn != nullptr) {
        G o[1];
        normalise<T, 1, RMS>({xr[c]}, mu, rs, gamma, beta, c, o);
        xn[row * H + c] = o[0];
      }
    }
  }
}

// out[j][c] = sum_b part[j][b][c], b in a fixed order. Block (32, 8), grid (ceil(H/32), J):
// J = 2 for dgamma and dbeta; J = 1 (dbeta unused) for the fused backward's db.
template <typename T>
__global__ void ln_bwd_reduce(const acc_t<T>* __restrict__ part, T* __restrict__ dgamma, T* __restrict__ dbeta,
                              int64_t G, int64_t H) {
  using A = acc_t<T>;
  __shared__ A sh[8][33];
  const int64_t c = (int64_t)blockIdx.x * 32 + threadIdx.x;
  const A* p = part + (int64_t)blockIdx.y * G * H;
  A s = 0;
  if (c < H)
    for (int64_t b = threadIdx.y; b < G; b += 8) s += p[b * H + c];
  sh[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < H) {
    A t = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) t += sh[j][threadIdx.x];
    (blockIdx.y == 0 ? dgamma : dbeta)[c] = from_acc<T>(t);
  }
}

// The fused backward's db[n] = sum_m dy[m,n]: fp32 partials part[chunk][N], then a
// fixed-order sum (ln_bwd_reduce): deterministic. A block is kColTx x kColTy threads:
// column vector tile blockIdx % gx (one VEC-vector per thread), the rows chunk, chunk +
// chunks, ... of chunk blockIdx / gx, kColUnroll rows' loads in flight per thread.
// Interleaved chunks make all blocks sweep dy together, from the last row down: the
// backward runs this after its dW GEMM, which read dy's rows in increasing order, so
// the sweep starts on the rows still in L2 (benchmarks/results/lnlinear_prep_variants_h100.txt).
constexpr int kColTx = 64, kColTy = 4, kColUnroll = 8, kColChunks = 64;

template <typename T, int VEC>
__global__ void __launch_bounds__(kColTx* kColTy)
    layernorm_linear_colsum(const T* __restrict__ dy, acc_t<T>* __restrict__ part, int64_t gx, int64_t chunks,
                            int64_t M, int64_t N) {
  using A = acc_t<T>;
  __shared__ A sh[kColTy][kColTx * VEC + 1];
  const int tx = threadIdx.x % kColTx, ty = threadIdx.x / kColTx;
  const int64_t cv = (int64_t)(blockIdx.x % gx) * kColTx + tx;  // column vector of this thread
  const int64_t chunk = blockIdx.x / gx;
  const int64_t step = chunks * kColTy;
  auto row = [&](int64_t l) { return M - 1 - l; };  // l-th row from the end
  A acc[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) acc[i] = 0;
  if (cv * VEC < N) {
    int64_t l = chunk + chunks * ty;
    for (; l + (kColUnroll - 1) * step < M; l += kColUnroll * step) {
      T q[kColUnroll][VEC];
#pragma unroll
      for (int u = 0; u < kColUnroll; ++u) load_pack<T, VEC, Ld::kStream>(q[u], dy + row(l + u * step) * N + cv * VEC);
#pragma unroll
      for (int u = 0; u < kColUnroll; ++u)
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[i] += to_acc<A>(q[u][i]);
    }
    for (; l < M; l += step) {
      T q[VEC];
      load_pack<T, VEC, Ld::kStream>(q, dy + row(l) * N + cv * VEC);
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[i] += to_acc<A>(q[i]);
    }
  }
#pragma unroll
  for (int i = 0; i < VEC; ++i) sh[ty][tx * VEC + i] = acc[i];
  __syncthreads();
  for (int c = threadIdx.x; c < kColTx * VEC; c += kColTx * kColTy) {
    const int64_t col = (int64_t)(blockIdx.x % gx) * kColTx * VEC + c;
    if (col < N) {
      A s = 0;
#pragma unroll
      for (int y = 0; y < kColTy; ++y) s += sh[y][c];
      part[chunk * N + col] = s;
    }
  }
}

// All backward kernels have one signature; f gets KernelTag<kernel>, so the grid's
// occupancy query and the launch name the kernel in this one place.
template <auto K>
struct KernelTag {
  static constexpr auto kernel = K;
};

template <typename T, bool RMS, typename G, class F>
auto with_bwd_kernel(const Plan& p, bool xn, F&& f) {
  if (p.rows == Rows::kLoop) return f(KernelTag<&ln_bwd_loop<T, RMS, G>>{});
  const bool narrow = p.rows == Rows::kBlockNarrow;
  auto pick = [&](auto vec_c, auto xn_c) {
    constexpr int VEC = decltype(vec_c)::value ? vec_of<T>() : 1;
    constexpr bool XN = decltype(xn_c)::value;
    return narrow ? f(KernelTag<&ln_bwd_cached<T, VEC, 1, kBwdRowsNarrow, XN, RMS, G>>{})
                  : f(KernelTag<&ln_bwd_cached<T, VEC, kCache, kBwdRowsWide, XN, RMS, G>>{});
  };
  using Y = std::true_type;
  using N = std::false_type;
  if (p.vec) return xn ? pick(Y{}, Y{}) : pick(Y{}, N{});
  return xn ? pick(N{}, Y{}) : pick(N{}, N{});
}

// The plan's kernel and a persistent grid of as many blocks as fit on the GPU at once
// (one wave), at most M; blocks = 0 and the error when a device query fails.
template <typename T, bool RMS, typename G>
Plan bwd_plan(int64_t M, int64_t H, bool aligned, bool xn, int64_t& blocks, cudaError_t& err) {
  const Plan p = layernorm_linear_plan(Stage::kBackward, H, vec_of<T>(), aligned);
  blocks = 0;
  const int sms = current_sm_count(err);
  if (err != cudaSuccess) return p;
  int dev = 0;
  err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return p;
  // Cached per device and kernel: every backward call sizes its grid with it.
  int per_sm = with_bwd_kernel<T, RMS, G>(
      p, xn, [&](auto k) { return blocks_per_sm<decltype(k)::kernel>(dev, p.threads, err); });
  if (err != cudaSuccess) return p;
  per_sm = per_sm > 1 ? per_sm : 1;
  int64_t g = (int64_t)per_sm * sms;
  // At least ~16 rows per block, so the partial sums stay a small part of the traffic.
  const int64_t by_rows = (M + 15) / 16 > sms ? (M + 15) / 16 : sms;
  g = g < by_rows ? g : by_rows;
  // The cached kernel's blocks take R rows per step: no block without a row.
  const int64_t R = p.rows == Rows::kBlockNarrow ? kBwdRowsNarrow : kBwdRowsWide;
  const int64_t steps = p.rows != Rows::kLoop ? (M + R - 1) / R : M;
  blocks = steps < g ? steps : g;
  return p;
}

}  // namespace

LaunchStatus layer_norm_backward_blocks(int64_t M, int64_t H, DType dtype, DType grad_dtype, bool xn, int64_t& blocks,
                                        Norm norm) {
  blocks = 0;
  if (!mixed_pair_ok(dtype, grad_dtype)) return cudaErrorNotSupported;
  // The workspace is sized for the vector plan; the scalar plan never needs more blocks
  // than it (fewer registers), but take the larger of the two to be safe.
  cudaError_t err = cudaSuccess;
  auto run = [&](auto tag, auto grad_tag, auto rms_c) -> int64_t {
    using T = decltype(tag);
    using G = decltype(grad_tag);
    constexpr bool R = decltype(rms_c)::value;
    int64_t a = 0, b = 0;
    bwd_plan<T, R, G>(M, H, true, xn, a, err);
    if (err == cudaSuccess) bwd_plan<T, R, G>(M, H, false, xn, b, err);
    return a > b ? a : b;
  };
  blocks = dispatch_dtype(dtype, [&](auto tag) -> int64_t {
    return with_out_dtype(tag, grad_dtype, [&](auto g) -> int64_t {
      return norm == Norm::kRms ? run(tag, g, std::true_type{}) : run(tag, g, std::false_type{});
    });
  });
  return err;
}

LaunchStatus layer_norm_backward_cuda(const void* dy, const void* x, const void* gamma, const void* mean,
                                      const void* rstd, void* dx, void* dgamma, void* dbeta, void* workspace, int64_t M,
                                      int64_t H, DType dtype, DType grad_dtype, cudaStream_t stream, const void* beta,
                                      void* xn, Norm norm) {
  if (M == 0 || H == 0) return cudaSuccess;  // the host zero-fills dgamma/dbeta for M == 0
  if (!mixed_pair_ok(dtype, grad_dtype) || (grad_dtype != dtype && dx == dy)) return cudaErrorNotSupported;
  cudaError_t err = cudaSuccess;
  auto run = [&](auto tag, auto grad_tag, auto rms_c) {
    using T = decltype(tag);
    using G = decltype(grad_tag);
    constexpr bool R = decltype(rms_c)::value;
    using A = acc_t<T>;
    const G* dyp = static_cast<const G*>(dy);
    const T *xp = static_cast<const T*>(x), *gp = static_cast<const T*>(gamma);
    const A *mp = static_cast<const A*>(mean), *rp = static_cast<const A*>(rstd);
    T* dxp = static_cast<T*>(dx);
    A* part = static_cast<A*>(workspace);
    const T* bp = static_cast<const T*>(beta);
    G* xnp = static_cast<G*>(xn);
    const bool aligned = xn ? all_aligned({dy, x, gamma, dx, beta, xn}) : all_aligned({dy, x, gamma, dx});
    int64_t blocks = 0;
    const Plan p = bwd_plan<T, R, G>(M, H, aligned, xn != nullptr, blocks, err);
    if (err != cudaSuccess) return 0;
    const unsigned grid = static_cast<unsigned>(blocks);
    with_bwd_kernel<T, R, G>(p, xn != nullptr, [&](auto k) {
      constexpr auto kernel = decltype(k)::kernel;
      kernel<<<grid, p.threads, 0, stream>>>(dyp, xp, gp, mp, rp, dxp, part, bp, xnp, M, H);
      return 0;
    });
    // RMS: dgamma only (no dbeta partials).
    ln_bwd_reduce<T><<<dim3(ceil_div_u(H, 32), R ? 1 : 2), dim3(32, 8), 0, stream>>>(part, static_cast<T*>(dgamma),
                                                                                     static_cast<T*>(dbeta), blocks, H);
    return 0;
  };
  dispatch_dtype(dtype, [&](auto tag) {
    return with_out_dtype(tag, grad_dtype, [&](auto g) {
      return norm == Norm::kRms ? run(tag, g, std::true_type{}) : run(tag, g, std::false_type{});
    });
  });
  return err != cudaSuccess ? err : cudaGetLastError();
}

int64_t layernorm_linear_bias_grad_workspace(int64_t M, int64_t N) { return (M < kColChunks ? M : kColChunks) * N; }

LaunchStatus layernorm_linear_bias_grad_cuda(const void* dy, void* db, void* workspace, int64_t M, int64_t N,
                                             DType dtype, cudaStream_t stream) {
  if (N == 0) return cudaSuccess;
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    constexpr int V = vec_of<T>();
    A* part = static_cast<A*>(workspace);
    const int64_t chunks = M < kColChunks ? M : kColChunks;
    auto launch = [&](auto kernel, int vec) {
      const int64_t gx = (N / vec + kColTx - 1) / kColTx;  // column tiles of kColTx vectors
      kernel<<<static_cast<unsigned>(gx * chunks), kColTx * kColTy, 0, stream>>>(static_cast<const T*>(dy), part, gx,
                                                                                 chunks, M, N);
    };
    if (M > 0) {
      if (N % V == 0 && all_aligned({dy}))
        launch(layernorm_linear_colsum<T, V>, V);
      else
        launch(layernorm_linear_colsum<T, 1>, 1);
    }
    // The partials' fixed-order sum: the LayerNorm backward's reducer, one output row (db);
    // M == 0 sums nothing (db = 0). Eight rows of threads per column: one thread with 64
    // serial loads per column is latency-bound.
    ln_bwd_reduce<T>
        <<<dim3(ceil_div_u(N, 32), 1), dim3(32, 8), 0, stream>>>(part, static_cast<T*>(db), nullptr, chunks, N);
    return 0;
  });
  return cudaGetLastError();
}

}  // namespace gpu_puzzles
