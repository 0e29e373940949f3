// Depthwise 1D convolution on CUDA: the curriculum's three steps.
//   naive : one thread per output, K global reads each (puzzle 11's first form).
//   tiled : a block loads its tile plus a (K-1) halo into shared memory once.
//   fast  : each lane owns 8 consecutive elements (16-byte loads), takes the
//           halo from its neighbour lane with a warp shuffle (the seed's
//           shuffle_down lesson) and only the warp's edge lane touches memory
//           for it. The backward fuses dx, dw and dbias into one pass.
// Index arithmetic is 64-bit throughout: B*C*L may exceed 2^31.
#include "common/device.cuh"
#include "conv1d/conv1d.h"
#include "conv1d/conv1d_plan.h"

namespace gpu_puzzles {
namespace {

using conv1d::FastPlan;
using conv1d::kE;
using conv1d::kSeg;
using conv1d::kWarps;
constexpr int kTile = 256;  // outputs per block in the tiled path
constexpr unsigned kFull = 0xffffffffu;

static_assert(kConv1dFastMaxK == kE + 1, "fast path halo is one neighbouring chunk");

// ---- fast path -------------------------------------------------------------

// Chunk [i0, i0 + kE) of one row, zero outside [0, L). In the vector form
// L % kE == 0 and the row is 16-byte aligned, so a chunk is wholly in or out.
template <typename T, bool VEC>
__device__ __forceinline__ void load_chunk(acc_t<T> (&v)[kE], const T* __restrict__ row, int64_t i0, int64_t L) {
  using A = acc_t<T>;
  if constexpr (VEC) {
    if (i0 >= 0 && i0 < L) {
      Vec<T, kE> t;
      load_vec(t, row + i0);
#pragma unroll
      for (int k = 0; k < kE; ++k) v[k] = to_acc<A>(t.e[k]);
    } else {
#pragma unroll
      for (int k = 0; k < kE; ++k) v[k] = A(0);
    }
  } else {
#pragma unroll
    for (int k = 0; k < kE; ++k) {
      const int64_t i = i0 + k;
      v[k] = (i >= 0 && i < L) ? to_acc<A>(row[i]) : A(0);
    }
  }
}

template <typename T, bool VEC>
__device__ __forceinline__ void store_chunk(T* __restrict__ row, const acc_t<T> (&v)[kE], int64_t i0, int64_t L) {
  if constexpr (VEC) {
    if (i0 < L) {
      Vec<T, kE> t;
#pragma unroll
      for (int k = 0; k < kE; ++k) t.e[k] = from_acc<T>(v[k]);
      store_vec(row + i0, t);
    }
  } else {
#pragma unroll
    for (int k = 0; k < kE; ++k)
      if (i0 + k < L) row[i0 + k] = from_acc<T>(v[k]);
  }
}

// own = chunk at i0; nb = the neighbouring chunk (DIR > 0: the next one, DIR < 0:
// the previous one), taken from the adjacent lane; the warp's edge lane loads it.
// Every lane of the warp must call this (shuffles), in range or not.
template <typename T, bool VEC, int DIR>
__device__ __forceinline__ void load_window(acc_t<T> (&own)[kE], acc_t<T> (&nb)[kE], const T* __restrict__ row,
                                            int64_t i0, int64_t L, int lane) {
  load_chunk<T, VEC>(own, row, i0, L);
#pragma unroll
  for (int k = 0; k < kE; ++k) nb[k] = DIR > 0 ? __shfl_down_sync(kFull, own[k], 1) : __shfl_up_sync(kFull, own[k], 1);
  if (DIR > 0 ? lane == 31 : lane == 0) load_chunk<T, VEC>(nb, row, i0 + DIR * kE, L);
}

// Window element at offset `idx` (compile-time after unrolling) of the 2*kE
// values [prev, own] (PREV) or [own, next] (NEXT).
template <bool PREV, typename A>
__device__ __forceinline__ A win(const A (&own)[kE], const A (&nb)[kE], int idx) {
  if (PREV) return idx >= kE ? own[idx - kE] : nb[idx];
  return idx < kE ? own[idx] : nb[idx - kE];
}

// y[v] = sum_j window * wr[j]. NEXT form: x[i+v+j]; PREV form: x[i+v-j]
// (the causal form, with wr holding the taps reversed).
template <int KMAX, bool PREV, typename A>
__device__ __forceinline__ void taps(A (&y)[kE], const A (&own)[kE], const A (&nb)[kE], const A (&wr)[KMAX], A init) {
#pragma unroll
  for (int v = 0; v < kE; ++v) {
    A s = init;
#pragma unroll
    for (int j = 0; j < KMAX; ++j) s += win<PREV>(own, nb, PREV ? kE + v - j : v + j) * wr[j];
    y[v] = s;
  }
}

// wr[j] = w[j] (look-ahead) or w[K-1-j] (causal), zero past K.
template <typename T, int KMAX, bool CAUSAL>
__device__ __forceinline__ void load_taps(acc_t<T> (&wr)[KMAX], const T* __restrict__ w, int K) {
#pragma unroll
  for (int j = 0; j < KMAX; ++j) wr[j] = j < K ? to_acc<acc_t<T>>(w[CAUSAL ? K - 1 - j : j]) : acc_t<T>(0);
}

template <typename T, int KMAX, bool CAUSAL, bool VEC>
__global__ void __launch_bounds__(kWarps * 32)
    conv1d_fwd_fast(const T* __restrict__ x, RowStrides xs, const T* __restrict__ w, int64_t ws,
                    const T* __restrict__ bias, T* __restrict__ out, int64_t rows, int64_t C, int64_t L, int K,
                    int64_t segs) {
  using A = acc_t<T>;
  const int lane = threadIdx.x & 31;
  const int64_t gw = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (gw >= rows * segs) return;  // whole warps only
  const int64_t row = gw / segs;
  const int64_t seg = gw - row * segs;
  const int64_t c = row % C;
  const int64_t i0 = seg * kSeg + static_cast<int64_t>(lane) * kE;

  A wr[KMAX];
  load_taps<T, KMAX, CAUSAL>(wr, w + c * ws, K);
  const A b = bias ? to_acc<A>(bias[c]) : A(0);

  A own[kE], nb[kE], y[kE];
  load_window<T, VEC, CAUSAL ? -1 : 1>(own, nb, x + row_offset(xs, row), i0, L, lane);
  taps<KMAX, CAUSAL>(y, own, nb, wr, b);
  store_chunk<T, VEC>(out + row * L, y, i0, L);
}

// One warp per (batch group, channel, segment). It walks the batch group,
// writing dx and accumulating its dw/dbias partials in registers, then stores
// one reduced partial per warp; conv1d_reduce_partials sums them in a fixed
// order, so the result is deterministic.
template <typename T, int KMAX, bool CAUSAL, bool VEC>
__global__ void __launch_bounds__(kWarps * 32)
    conv1d_bwd_fast(const T* __restrict__ dy, RowStrides dys, const T* __restrict__ x, RowStrides xs,
                    const T* __restrict__ w, int64_t ws, T* __restrict__ dx, acc_t<T>* __restrict__ partial, int64_t B,
                    int64_t C, int64_t L, int K, int64_t segs, int64_t bper, int64_t nbg) {
  using A = acc_t<T>;
  const int lane = threadIdx.x & 31;
  const int64_t gw = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (gw >= nbg * C * segs) return;
  const int64_t seg = gw % segs;
  const int64_t c = (gw / segs) % C;
  const int64_t bg = gw / (segs * C);
  const int64_t i0 = seg * kSeg + static_cast<int64_t>(lane) * kE;

  // dx = conv(dy, taps reversed, opposite alignment): the same wr array as the
  // forward, applied in the other window direction.
  A wr[KMAX];
  load_taps<T, KMAX, CAUSAL>(wr, w + c * ws, K);

  A dwp[KMAX];
#pragma unroll
  for (int j = 0; j < KMAX; ++j) dwp[j] = A(0);
  A dbp = A(0);

  const int64_t b_end = (bg + 1) * bper < B ? (bg + 1) * bper : B;
  for (int64_t b = bg * bper; b < b_end; ++b) {
    const int64_t row = b * C + c;
    A gown[kE], gnb[kE], xown[kE], xnb[kE], g[kE];
    load_window<T, VEC, CAUSAL ? 1 : -1>(gown, gnb, dy + row_offset(dys, row), i0, L, lane);
    load_window<T, VEC, CAUSAL ? -1 : 1>(xown, xnb, x + row_offset(xs, row), i0, L, lane);
    taps<KMAX, !CAUSAL>(g, gown, gnb, wr, A(0));
    store_chunk<T, VEC>(dx + row * L, g, i0, L);
#pragma unroll
    for (int v = 0; v < kE; ++v) {
      dbp += gown[v];
#pragma unroll
      for (int j = 0; j < KMAX; ++j) dwp[j] += gown[v] * win<CAUSAL>(xown, xnb, CAUSAL ? kE + v - j : v + j);
    }
  }

#pragma unroll
  for (int j = 0; j < KMAX; ++j) dwp[j] = warp_sum(dwp[j]);
  dbp = warp_sum(dbp);
  if (lane == 0) {
    A* p = partial + gw * (K + 1);
#pragma unroll
    for (int j = 0; j < KMAX; ++j)
      if (j < K) p[CAUSAL ? K - 1 - j : j] = dwp[j];
    p[K] = dbp;
  }
}

// dw[c, :] and dbias[c] from the per-warp partials of channel c.
template <typename T>
__global__ void conv1d_reduce_partials(const acc_t<T>* __restrict__ partial, T* __restrict__ dw, T* __restrict__ dbias,
                                       int64_t C, int K, int64_t segs, int64_t nbg) {
  using A = acc_t<T>;
  constexpr int kMaxOut = kConv1dFastMaxK + 1;
  __shared__ A red[kMaxOut][32];
  const int64_t c = blockIdx.x;
  A s[kMaxOut];
#pragma unroll
  for (int j = 0; j < kMaxOut; ++j) s[j] = A(0);
  for (int64_t t = threadIdx.x; t < nbg * segs; t += blockDim.x) {
    const int64_t bg = t / segs, seg = t - bg * segs;
    const A* p = partial + ((bg * C + c) * segs + seg) * (K + 1);
#pragma unroll
    for (int j = 0; j < kMaxOut; ++j)
      if (j <= K) s[j] += p[j];
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
  for (int j = 0; j < kMaxOut; ++j) {
    A v = warp_sum(s[j]);
    if (lane == 0) red[j][warp] = v;
  }
  __syncthreads();
  if (threadIdx.x <= K) {
    A v = A(0);
    for (int i = 0; i < static_cast<int>(blockDim.x >> 5); ++i) v += red[threadIdx.x][i];
    if (threadIdx.x < K)
      dw[c * K + threadIdx.x] = from_acc<T>(v);
    else if (dbias)
      dbias[c] = from_acc<T>(v);
  }
}

// ---- tiled path: shared-memory tile with halo ------------------------------

template <typename T>
__global__ void __launch_bounds__(kTile)
    conv1d_fwd_tiled(const T* __restrict__ x, RowStrides xs, const T* __restrict__ w, int64_t ws,
                     const T* __restrict__ bias, T* __restrict__ out, int64_t C, int64_t L, int K, int shift,
                     int64_t tiles) {
  using A = acc_t<T>;
  extern __shared__ unsigned char smem_raw[];
  A* sx = reinterpret_cast<A*>(smem_raw);
  A* sw = sx + (kTile + K - 1);
  const int64_t row = blockIdx.x / tiles;
  const int64_t t0 = (blockIdx.x - row * tiles) * kTile;
  const int64_t c = row % C;
  const T* xr = x + row_offset(xs, row);
  for (int s = threadIdx.x; s < kTile + K - 1; s += kTile) {
    const int64_t i = t0 - shift + s;
    sx[s] = (i >= 0 && i < L) ? to_acc<A>(xr[i]) : A(0);
  }
  for (int j = threadIdx.x; j < K; j += kTile) sw[j] = to_acc<A>(w[c * ws + j]);
  __syncthreads();
  const int64_t i = t0 + threadIdx.x;
  if (i < L) {
    A s = bias ? to_acc<A>(bias[c]) : A(0);
    for (int j = 0; j < K; ++j) s += sx[threadIdx.x + j] * sw[j];
    out[row * L + i] = from_acc<T>(s);
  }
}

// ---- naive path: one thread per output -------------------------------------

template <typename T>
__global__ void conv1d_fwd_naive(const T* __restrict__ x, RowStrides xs, const T* __restrict__ w, int64_t ws,
                                 const T* __restrict__ bias, T* __restrict__ out, int64_t n, int64_t C, int64_t L,
                                 int K, int shift) {
  using A = acc_t<T>;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < n;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = idx / L, i = idx - row * L, c = row % C;
    const T* xr = x + row_offset(xs, row);
    A s = bias ? to_acc<A>(bias[c]) : A(0);
    for (int j = 0; j < K; ++j) {
      const int64_t p = i - shift + j;
      if (p >= 0 && p < L) s += to_acc<A>(xr[p]) * to_acc<A>(w[c * ws + j]);
    }
    out[idx] = from_acc<T>(s);
  }
}

// dw[c, j] (j < K) or dbias[c] (j == K): one block reduces over (b, i).
template <typename T>
__global__ void conv1d_dw_generic(const T* __restrict__ dy, RowStrides dys, const T* __restrict__ x, RowStrides xs,
                                  T* __restrict__ dw, T* __restrict__ dbias, int64_t B, int64_t C, int64_t L, int K,
                                  int shift) {
  using A = acc_t<T>;
  __shared__ A red[32];
  const int64_t c = blockIdx.x / (K + 1);
  const int j = static_cast<int>(blockIdx.x % (K + 1));
  A s = A(0);
  for (int64_t t = threadIdx.x; t < B * L; t += blockDim.x) {
    const int64_t b = t / L, i = t - b * L;
    const A g = to_acc<A>(dy[row_offset(dys, b * C + c) + i]);
    if (j == K) {
      s += g;
    } else {
      const int64_t p = i - shift + j;
      if (p >= 0 && p < L) s += g * to_acc<A>(x[row_offset(xs, b * C + c) + p]);
    }
  }
  s = warp_sum(s);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    A v = A(0);
    for (int i = 0; i < static_cast<int>(blockDim.x >> 5); ++i) v += red[i];
    if (j < K)
      dw[c * K + j] = from_acc<T>(v);
    else if (dbias)
      dbias[c] = from_acc<T>(v);
  }
}

// Calls f(KMAX, CAUSAL, VEC) as compile-time constants: the plan's kmax and vec.
template <typename F>
void dispatch_fast(const FastPlan& p, bool causal, F&& f) {
  auto with_kmax = [&](auto causal_c, auto vec_c) {
    if (p.kmax == 4)
      f(std::integral_constant<int, 4>{}, causal_c, vec_c);
    else
      f(std::integral_constant<int, kConv1dFastMaxK>{}, causal_c, vec_c);
  };
  if (causal) {
    if (p.vec)
      with_kmax(std::true_type{}, std::true_type{});
    else
      with_kmax(std::true_type{}, std::false_type{});
  } else {
    if (p.vec)
      with_kmax(std::false_type{}, std::true_type{});
    else
      with_kmax(std::false_type{}, std::false_type{});
  }
}

}  // namespace

LaunchStatus conv1d_forward_cuda(const Conv1dArgs& a, Conv1dAlgo algo, cudaStream_t stream) {
  const int64_t rows = a.B * a.C;
  if (rows == 0 || a.L == 0) return 0;
  const int shift = a.causal ? a.K - 1 : 0;
  dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    const T* x = static_cast<const T*>(a.x);
    const T* w = static_cast<const T*>(a.w);
    const T* bias = static_cast<const T*>(a.bias);
    T* out = static_cast<T*>(a.out);
    if (algo == Conv1dAlgo::Fast) {
      const void* ptrs[2] = {a.x, a.out};
      const FastPlan p =
          conv1d::fast_plan(a.B, a.C, a.L, a.K, conv1d::vec_ok(ptrs, 2, &a.xs, 1, a.L, sizeof(T)), false);
      const unsigned blocks = ceil_div_u(rows * p.segs, kWarps);
      dispatch_fast(p, a.causal, [&](auto kmax, auto causal_c, auto vec_c) {
        conv1d_fwd_fast<T, decltype(kmax)::value, decltype(causal_c)::value, decltype(vec_c)::value>
            <<<blocks, kWarps * 32, 0, stream>>>(x, a.xs, w, a.w_stride, bias, out, rows, a.C, a.L, a.K, p.segs);
      });
    } else if (algo == Conv1dAlgo::Tiled) {
      const int64_t tiles = (a.L + kTile - 1) / kTile;
      const size_t smem = sizeof(A) * (kTile + 2 * a.K - 1);
      if (smem > 48 * 1024)
        cudaFuncSetAttribute(conv1d_fwd_tiled<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
      conv1d_fwd_tiled<T><<<static_cast<unsigned>(rows * tiles), kTile, smem, stream>>>(
          x, a.xs, w, a.w_stride, bias, out, a.C, a.L, a.K, shift, tiles);
    } else {
      const int64_t n = rows * a.L;
      const int64_t blocks = (n + 255) / 256;
      conv1d_fwd_naive<T><<<static_cast<unsigned>(blocks < (1 << 20) ? blocks : (1 << 20)), 256, 0, stream>>>(
          x, a.xs, w, a.w_stride, bias, out, n, a.C, a.L, a.K, shift);
    }
  });
  return static_cast<LaunchStatus>(cudaGetLastError());
}

int64_t conv1d_backward_fast_workspace(int64_t B, int64_t C, int64_t L, int K) {
  const FastPlan p = conv1d::fast_plan(B, C, L, K, false, true);  // vec does not change the split
  return p.nbg * C * p.segs * (K + 1);
}

LaunchStatus conv1d_backward_fast_cuda(const void* dy, RowStrides dys, const void* x, RowStrides xs, const void* w,
                                       int64_t w_stride, void* dx, void* dw, void* dbias, void* workspace, int64_t B,
                                       int64_t C, int64_t L, int K, bool causal, DType dtype, cudaStream_t stream) {
  if (C == 0) return 0;
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    A* partial = static_cast<A*>(workspace);
    const void* ptrs[3] = {dy, x, dx};
    const RowStrides strided[2] = {dys, xs};
    const FastPlan p = conv1d::fast_plan(B, C, L, K, conv1d::vec_ok(ptrs, 3, strided, 2, L, sizeof(T)), true);
    if (B > 0 && L > 0) {
      const unsigned blocks = ceil_div_u(p.nbg * C * p.segs, kWarps);
      dispatch_fast(p, causal, [&](auto kmax, auto causal_c, auto vec_c) {
        conv1d_bwd_fast<T, decltype(kmax)::value, decltype(causal_c)::value, decltype(vec_c)::value>
            <<<blocks, kWarps * 32, 0, stream>>>(static_cast<const T*>(dy), dys, static_cast<const T*>(x), xs,
                                                 static_cast<const T*>(w), w_stride, static_cast<T*>(dx), partial, B, C,
                                                 L, K, p.segs, p.bper, p.nbg);
      });
    } else {
      cudaMemsetAsync(partial, 0, sizeof(A) * p.nbg * C * p.segs * (K + 1), stream);
    }
    conv1d_reduce_partials<T><<<static_cast<unsigned>(C), 128, 0, stream>>>(
        partial, static_cast<T*>(dw), static_cast<T*>(dbias), C, K, p.segs, p.nbg);
  });
  return static_cast<LaunchStatus>(cudaGetLastError());
}

LaunchStatus conv1d_weight_grad_generic_cuda(const void* dy, RowStrides dys, const void* x, RowStrides xs, void* dw,
                                             void* dbias, int64_t B, int64_t C, int64_t L, int K, bool causal,
                                             DType dtype, cudaStream_t stream) {
  if (C == 0) return 0;
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    conv1d_dw_generic<T><<<static_cast<unsigned>(C * (K + 1)), 256, 0, stream>>>(
        static_cast<const T*>(dy), dys, static_cast<const T*>(x), xs, static_cast<T*>(dw), static_cast<T*>(dbias), B, C,
        L, K, causal ? K - 1 : 0);
  });
  return static_cast<LaunchStatus>(cudaGetLastError());
}

}  // namespace gpu_puzzles
