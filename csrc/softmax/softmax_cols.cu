// Softmax over a non-last dim (inner > 1), columns across inner: threads over
// inner reducing over N with the tile cached in shared memory (inner_kernel),
// and on Hopper a cluster per 128-byte column tile, in registers
// (inner_cluster_fwd_kernel, forward) or staged through shared memory
// (staged_cols_kernel, forward and backward).
#include "common/cp_async.cuh"
#include "common/func_attr.h"
#include "softmax/softmax_kernels.cuh"

namespace gpu_puzzles {
namespace {

using namespace softmax_detail;

// Lanes tx, tx + TX, tx + 2 TX, ... of a warp hold the same V columns: merge their
// (shift, sum) pairs with a butterfly (every lane gets the same bits).
template <int TX, typename A, int V>
__device__ __forceinline__ void lanes_pair_merge(A (&sh)[V], A (&s)[V]) {
#pragma unroll
  for (int k = 0; k < V; ++k)
#pragma unroll
    for (int of = TX; of < 32; of <<= 1) {
      const A m2 = __shfl_xor_sync(0xffffffffu, sh[k], of), s2 = __shfl_xor_sync(0xffffffffu, s[k], of);
      pair_merge(sh[k], s[k], m2, s2);
    }
}

// This thread's V columns from tx * V: the shift M and the multiplier (1 / S, log S for
// log_softmax, S itself in the backward). S == 0 only for a column of all -inf: NaN
// there, as torch.
template <bool BWD, bool LOG, typename A, int TW, int V>
__device__ __forceinline__ void column_scales(const A (&fin)[TW][2], int tx, A (&M)[V], A (&mul)[V]) {
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const A Sk = fin[tx * V + k][1];
    M[k] = fin[tx * V + k][0];
    if constexpr (BWD)
      mul[k] = Sk;
    else
      mul[k] = Sk == A(0) ? A(NAN) : (LOG ? log_a(Sk) : A(1) / Sk);
  }
}

// ---- a non-last dim, forward, on Hopper: a cluster per column tile -------------
// Tile = 8 16-byte vectors across inner (128 bytes of each of the N rows: whole
// cache lines) of one outer index. The cluster's CS blocks split N: block r
// holds rows [r NB, r NB + NB) of the tile, NB <= 32 * 16, in registers (thread
// (tx, ty) holds rows ty, ty + 32, ... of vector tx, 16 loads in flight). Per
// column (shift, sum) pairs are merged over the 4 lanes sharing tx (shuffles),
// the block's 8 warps (shared memory) and the cluster's blocks (distributed
// shared memory, one cluster barrier). x is read once and written once.

template <typename T, bool LOG>
__global__ void __launch_bounds__(kIcThreads, 2)
    inner_cluster_fwd_kernel(const T* __restrict__ a, T* __restrict__ out, int64_t outer, int64_t N, int64_t inner,
                             int64_t tiles, int64_t NB) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using A = acc_t<T>;
  constexpr int V = 16 / sizeof(T);
  constexpr int TW = kIcTx * V;  // tile width in elements
  static_assert(TW <= kIcMaxCols, "tile width");
  __shared__ A red[kIcThreads / 32][TW][2];
  __shared__ A part[2][TW][2];  // [tile parity][column][shift, sum]
  __shared__ A fin[TW][2];      // the cluster's (M, S) per column
  cg::cluster_group cluster = cg::this_cluster();
  const int CS = int(cluster.num_blocks());
  const int tx = threadIdx.x % kIcTx, ty = threadIdx.x / kIcTx, lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int64_t n0 = int64_t(cluster.block_rank()) * NB;
  const int64_t n1 = min(N, n0 + NB);
  const int64_t step = gridDim.x / CS;
  int parity = 0;
  for (int64_t tile = blockIdx.x / CS; tile < outer * tiles; tile += step, parity ^= 1) {  // cluster-uniform
    const int64_t o = tile / tiles;
    const int64_t col = (tile % tiles) * TW + int64_t(tx) * V;
    const bool active = col < inner;  // inner % V == 0: a vector is wholly in or out
    const T* ap = a + o * N * inner + col;
    T* op = out + o * N * inner + col;
    Vec<T, V> r[kIcRows];
#pragma unroll
    for (int j = 0; j < kIcRows; ++j) {
      const int64_t n = n0 + ty + int64_t(j) * kIcTy;
      if (active && n < n1) {
        load_vec(r[j], ap + n * inner);
      } else {
#pragma unroll
        for (int k = 0; k < V; ++k) r[j].e[k] = from_acc<T>(neg_inf<A>());
      }
    }
    A sh[V], s[V];
#pragma unroll
    for (int k = 0; k < V; ++k) {
      A m = neg_inf<A>();
#pragma unroll
      for (int j = 0; j < kIcRows; ++j) m = max_a(m, to_acc<A>(r[j].e[k]));
      sh[k] = m == neg_inf<A>() ? A(0) : m;  // nothing but -inf: empty (sum 0), see pair_merge
      const ExpShift<T> ex(sh[k]);
      A acc = A(0);
#pragma unroll
      for (int j = 0; j < kIcRows; ++j) acc += ex(to_acc<A>(r[j].e[k]));
      s[k] = acc;
    }
#pragma unroll
    for (int j = 0; j < kIcRows; ++j) pin(r[j]);
    lanes_pair_merge<kIcTx>(sh, s);
    if (lane < kIcTx) {
#pragma unroll
      for (int k = 0; k < V; ++k) {
        red[w][tx * V + k][0] = sh[k];
        red[w][tx * V + k][1] = s[k];
      }
    }
    __syncthreads();
    if (threadIdx.x < TW) {
      A bm = A(0), bs = A(0);
      for (int ww = 0; ww < kIcThreads / 32; ++ww) pair_merge(bm, bs, red[ww][threadIdx.x][0], red[ww][threadIdx.x][1]);
      part[parity][threadIdx.x][0] = bm;
      part[parity][threadIdx.x][1] = bs;
    }
    cluster.sync();  // every block's pairs visible (release/acquire); red reads done
    if (threadIdx.x < TW) {
      A M, S;
      cluster_pair(cluster, &part[parity][threadIdx.x][0], CS, M, S);
      fin[threadIdx.x][0] = M;
      fin[threadIdx.x][1] = S;
    }
    __syncthreads();
    A M[V], mul[V];
    column_scales<false, LOG>(fin, tx, M, mul);  // log: (x - M) - log S
    // fin is rewritten only after the next cluster barrier, which every thread
    // reaches after these reads.
    if (active) {
#pragma unroll
      for (int j = 0; j < kIcRows; ++j) {
        const int64_t n = n0 + ty + int64_t(j) * kIcTy;
        if (n < n1) {
          Vec<T, V> y;
#pragma unroll
          for (int k = 0; k < V; ++k) {
            const A x = to_acc<A>(r[j].e[k]);
            y.e[k] = from_acc<T>(LOG ? (x - M[k]) - mul[k] : ExpShift<T>(M[k])(x) * mul[k]);
          }
          __stcs(reinterpret_cast<uint4*>(op + n * inner), y.q[0]);
        }
      }
    }
  }
  cluster.sync();  // no block exits while another may still read its `part`
#endif
}

// ---- a non-last dim, on Hopper: staged column tiles, persistent (cols=staged)
// Forward and backward. Tile = 8 16-byte vectors across inner (128 bytes of each
// of the N rows) of one outer index; the cluster's CS blocks split N, block r
// owning rows [r NB, r NB + NB), NB = 32 R; thread (tx, ty) copies rows ty,
// ty + 32, ... of vector tx (and dy's) into its own shared-memory slots with
// cp.async, `stages` tiles ahead, and reads them back itself (no cross-thread
// hazard on the slots; a slot is refilled after the thread's last read of it).
// A grid of the resident clusters loops over tiles, so the next tiles' loads
// overlap this one's reductions, cluster barrier and stores. Per column: the
// forward merges (shift, sum) pairs, the backward sums dy y (log: dy), over the
// 4 lanes sharing tx (shuffles), the 8 warps (shared memory) and the cluster's
// blocks (distributed shared memory, one cluster barrier, rank order).

template <typename T>
__device__ __forceinline__ acc_t<T> exp_shift(acc_t<T> x, acc_t<T> sh) {
  return ExpShift<T>(sh)(x);
}

template <typename T, bool BWD, bool LOG>
__global__ void __launch_bounds__(kScThreads)
    staged_cols_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out, int64_t outer, int64_t N,
                       int64_t inner, int64_t tiles, int R, int stages) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using A = acc_t<T>;
  constexpr int V = 16 / sizeof(T);
  constexpr int TW = kScTx * V;  // tile width in elements
  constexpr int ARR = BWD ? 2 : 1;
  extern __shared__ __align__(16) unsigned char sc_raw[];
  uint4* buf = reinterpret_cast<uint4*>(sc_raw);
  __shared__ A red[kScThreads / 32][TW][2];
  __shared__ A part[2][TW][2];  // [tile parity][column][shift, sum]
  __shared__ A fin[TW][2];      // the cluster's (M, S) per column (backward: S only)
  cg::cluster_group cluster = cg::this_cluster();
  const int CS = int(cluster.num_blocks());
  const int tid = int(threadIdx.x), tx = tid % kScTx, ty = tid / kScTx, lane = tid & 31, w = tid >> 5;
  const int64_t NB = int64_t(R) * kScTy;
  const int64_t n0 = int64_t(cluster.block_rank()) * NB;
  const int64_t n1 = min(N, n0 + NB);
  // Rows of this thread in the block's range: ty + 32 j < n1 - n0, j < R.
  const int cnt = n1 - n0 > ty ? int(min(int64_t(R), (n1 - n0 - ty + kScTy - 1) / kScTy)) : 0;
  const int64_t step = gridDim.x / CS, first = blockIdx.x / CS, total = outer * tiles;
  auto slot = [&](int st, int q, int j) { return &buf[((st * ARR + q) * R + j) * kScThreads + tid]; };
  auto issue = [&](int64_t tile, int st) {
    if (tile < total) {
      const int64_t o = tile / tiles, col = (tile % tiles) * TW + int64_t(tx) * V;
      if (col < inner) {  // inner % V == 0: a vector is wholly in or out
        const int64_t base = o * N * inner + col;
        for (int j = 0; j < cnt; ++j) {
          const int64_t off = base + (n0 + ty + int64_t(j) * kScTy) * inner;
          cp_async16(slot(st, 0, j), a + off);
          if constexpr (BWD) cp_async16(slot(st, 1, j), b + off);
        }
      }
    }
    cp_async_commit();  // empty groups too: every thread counts the same groups
  };
  for (int st = 0; st < stages; ++st) issue(first + int64_t(st) * step, st);
  int parity = 0, st = 0;
  for (int64_t tile = first; tile < total; tile += step, parity ^= 1) {  // cluster-uniform
    if (stages >= 3)
      cp_async_wait<2>();
    else if (stages == 2)
      cp_async_wait<1>();
    else
      cp_async_wait<0>();
    const int64_t o = tile / tiles, col = (tile % tiles) * TW + int64_t(tx) * V;
    const bool active = col < inner;
    const int my = active ? cnt : 0;
    A sh[V], s[V];
#pragma unroll
    for (int k = 0; k < V; ++k) {
      sh[k] = A(0);
      s[k] = A(0);
    }
    if constexpr (!BWD) {
      A m[V];
#pragma unroll
      for (int k = 0; k < V; ++k) m[k] = neg_inf<A>();
      for (int j = 0; j < my; ++j) {
        Vec<T, V> r;
        r.q[0] = *slot(st, 0, j);
#pragma unroll
        for (int k = 0; k < V; ++k) m[k] = max_a(m[k], to_acc<A>(r.e[k]));
      }
#pragma unroll
      for (int k = 0; k < V; ++k) sh[k] = m[k] == neg_inf<A>() ? A(0) : m[k];  // nothing but -inf: empty
      for (int j = 0; j < my; ++j) {
        Vec<T, V> r;
        r.q[0] = *slot(st, 0, j);
#pragma unroll
        for (int k = 0; k < V; ++k) s[k] += exp_shift<T>(to_acc<A>(r.e[k]), sh[k]);
      }
      lanes_pair_merge<kScTx>(sh, s);
    } else {
      for (int j = 0; j < my; ++j) {
        Vec<T, V> y, g;
        y.q[0] = *slot(st, 0, j);
        g.q[0] = *slot(st, 1, j);
#pragma unroll
        for (int k = 0; k < V; ++k) s[k] += LOG ? to_acc<A>(g.e[k]) : to_acc<A>(g.e[k]) * to_acc<A>(y.e[k]);
      }
#pragma unroll
      for (int k = 0; k < V; ++k) {  // a fixed order: every lane of the 4 gets the same bits
        const A s8 = s[k] + __shfl_xor_sync(0xffffffffu, s[k], 8);
        s[k] = s8 + __shfl_xor_sync(0xffffffffu, s8, 16);
      }
    }
    if (lane < kScTx) {
#pragma unroll
      for (int k = 0; k < V; ++k) {
        red[w][tx * V + k][0] = sh[k];
        red[w][tx * V + k][1] = s[k];
      }
    }
    __syncthreads();
    if (tid < TW) {
      A bm = A(0), bs = A(0);
      for (int ww = 0; ww < kScThreads / 32; ++ww) {
        if constexpr (BWD)
          bs += red[ww][tid][1];
        else
          pair_merge(bm, bs, red[ww][tid][0], red[ww][tid][1]);
      }
      part[parity][tid][0] = bm;
      part[parity][tid][1] = bs;
    }
    cluster.sync();  // every block's pairs visible (release/acquire); red reads done
    if (tid < TW) {
      A M, S;
      cluster_pair<BWD>(cluster, &part[parity][tid][0], CS, M, S);
      fin[tid][0] = M;
      fin[tid][1] = S;
    }
    __syncthreads();
    A M[V], mul[V];
    column_scales<BWD, LOG>(fin, tx, M, mul);
    // fin is rewritten only after the next cluster barrier, which every thread
    // reaches after these reads.
    if (active) {
      T* op = out + o * N * inner + col;
      for (int j = 0; j < my; ++j) {
        Vec<T, V> y, r;
        r.q[0] = *slot(st, 0, j);
        if constexpr (BWD) {
          Vec<T, V> g;
          g.q[0] = *slot(st, 1, j);
#pragma unroll
          for (int k = 0; k < V; ++k) {
            const A yv = to_acc<A>(r.e[k]), gv = to_acc<A>(g.e[k]);
            y.e[k] = from_acc<T>(LOG ? gv - exp_a(yv) * mul[k] : yv * (gv - mul[k]));
          }
        } else {
#pragma unroll
          for (int k = 0; k < V; ++k) {
            const A x = to_acc<A>(r.e[k]);
            y.e[k] = from_acc<T>(LOG ? (x - M[k]) - mul[k] : exp_shift<T>(x, M[k]) * mul[k]);
          }
        }
        __stcs(reinterpret_cast<uint4*>(op + (n0 + ty + int64_t(j) * kScTy) * inner), y.q[0]);
      }
    }
    // The stores above consumed every value this thread read from stage `st`
    // (in-order issue): its slots may be refilled.
    issue(tile + int64_t(stages) * step, st);
    st = st + 1 == stages ? 0 : st + 1;
  }
  cp_async_wait<0>();
  cluster.sync();  // no block exits while another may still read its `part`
#endif
}

// ---- a non-last dim: columns over inner -------------------------------------
// Block (TC, TY) owns TC adjacent columns of one outer index; thread (tx, ty)
// walks n = ty, ty + TY, ... of column tx, so each warp reads whole 16/32-byte
// row segments. With CACHE the tile (N x TC, and dy's for the backward) stays in
// dynamic shared memory between the statistics pass and the write pass.
template <typename T, bool BWD, bool CACHE>
__global__ void __launch_bounds__(kInnerThreads)
    inner_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out, int64_t outer, int64_t N,
                 int64_t inner, int64_t tiles, bool log) {
  using A = acc_t<T>;
  __shared__ A st[2][kInnerThreads];
  extern __shared__ __align__(16) unsigned char cache_raw[];
  const int TC = blockDim.x, TY = blockDim.y, tx = threadIdx.x, ty = threadIdx.y;
  T* ca = reinterpret_cast<T*>(cache_raw);
  T* cb = ca + N * TC;
  for (int64_t blk = blockIdx.x; blk < outer * tiles; blk += gridDim.x) {
    const int64_t o = blk / tiles, col = (blk % tiles) * TC + tx;
    const bool active = col < inner;
    const T* ap = a + o * N * inner + col;
    const T* bp = BWD ? b + o * N * inner + col : nullptr;
    A m = neg_inf<A>(), s = A(0);
    if (active) {
      int64_t n = ty;
      // Four independent loads in flight per thread before the dependent math.
      for (; n + 3 * TY < N; n += 4 * TY) {
        A va[4], vb[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const T x = ap[(n + u * TY) * inner];
          if (CACHE) ca[(n + u * TY) * TC + tx] = x;
          va[u] = to_acc<A>(x);
          if constexpr (BWD) {
            const T g = bp[(n + u * TY) * inner];
            if (CACHE) cb[(n + u * TY) * TC + tx] = g;
            vb[u] = to_acc<A>(g);
          }
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          if constexpr (BWD)
            s += log ? vb[u] : va[u] * vb[u];
          else
            online_add(m, s, va[u]);
        }
      }
      for (; n < N; n += TY) {
        const T x = ap[n * inner];
        if (CACHE) ca[n * TC + tx] = x;
        if constexpr (BWD) {
          const T g = bp[n * inner];
          if (CACHE) cb[n * TC + tx] = g;
          s += log ? to_acc<A>(g) : to_acc<A>(x) * to_acc<A>(g);
        } else {
          online_add(m, s, to_acc<A>(x));
        }
      }
    }
    const int tid = ty * TC + tx;
    st[0][tid] = m;
    st[1][tid] = s;
    __syncthreads();
    if (ty == 0) {  // column tx's TY partials, in a fixed order
      for (int j = 1; j < TY; ++j) {
        if constexpr (BWD)
          s += st[1][j * TC + tx];
        else
          online_merge(m, s, st[0][j * TC + tx], st[1][j * TC + tx]);
      }
      st[0][tx] = m;
      st[1][tx] = s;
    }
    __syncthreads();
    m = st[0][tx];
    s = st[1][tx];
    __syncthreads();  // st is rewritten for the next tile
    if (active) {
      const A sub = log ? log_a(s) : A(0);
      const A mul = A(1) / s;
      T* op = out + o * N * inner + col;
      for (int64_t n = ty; n < N; n += TY) {
        const A x = to_acc<A>(CACHE ? ca[n * TC + tx] : ap[n * inner]);
        A r;
        if constexpr (BWD) {
          const A g = to_acc<A>(CACHE ? cb[n * TC + tx] : bp[n * inner]);
          r = log ? g - exp_a(x) * s : x * (g - s);
        } else {
          r = log ? x - m - sub : exp_a(x - m) * mul;
        }
        op[n * inner] = from_acc<T>(r);
      }
    }
    // The cache is written again only by this same thread (same n, tx) in the
    // next tile, after the barriers above: no cross-thread hazard.
  }
}

template <typename T, bool BWD>
auto staged_cols_kernel_for(bool log) {
  return log ? staged_cols_kernel<T, BWD, true> : staged_cols_kernel<T, BWD, false>;
}

template <typename T, bool BWD>
cudaError_t launch_inner(const SoftmaxArgs& a, const Plan& p, cudaStream_t st) {
  const auto [A_, B_, O] = typed_ptrs<T>(a);
  const int64_t tiles = cdiv(a.inner, p.threads);
  const dim3 block(p.threads, kInnerThreads / p.threads);
  const unsigned g = grid_for(a.outer * tiles);
  if (p.cache) {
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e == cudaSuccess) e = set_smem<inner_kernel<T, BWD, true>>(dev, size_t(p.smem));
    if (e != cudaSuccess) return e;
    inner_kernel<T, BWD, true><<<g, block, size_t(p.smem), st>>>(A_, B_, O, a.outer, a.N, a.inner, tiles, a.log);
  } else {
    inner_kernel<T, BWD, false><<<g, block, 0, st>>>(A_, B_, O, a.outer, a.N, a.inner, tiles, a.log);
  }
  return cudaGetLastError();
}

template <typename T, bool BWD>
cudaError_t launch_cols_typed(const SoftmaxArgs& a, const Plan& p, cudaStream_t st) {
  const auto [A_, B_, O] = typed_ptrs<T>(a);
  constexpr int V = 16 / sizeof(T);
  const int64_t N = a.N;
  switch (p.kind) {
    case Kind::Inner:
      return launch_inner<T, BWD>(a, p, st);
    case Kind::InnerCluster: {
      if constexpr (!BWD && sizeof(T) <= 4) {
        const int64_t tw = kIcTx * V, tiles = cdiv(a.inner, tw);
        const int64_t NB = cdiv(N, p.S);
        const int64_t clusters = std::min<int64_t>(a.outer * tiles, kMaxGrid / kClusterMax);
        cudaLaunchConfig_t cfg{};
        cfg.gridDim = dim3(unsigned(clusters * p.S));
        cfg.blockDim = dim3(unsigned(kIcThreads));
        cfg.stream = st;
        cudaLaunchAttribute attr[1] = {cluster_attr(p.S)};
        cfg.attrs = attr;
        cfg.numAttrs = 1;
        return cudaLaunchKernelEx(&cfg, a.log ? inner_cluster_fwd_kernel<T, true> : inner_cluster_fwd_kernel<T, false>,
                                  A_, O, a.outer, N, a.inner, tiles, NB);
      }
      return cudaErrorInvalidValue;  // forward, 2- and 4-byte types only
    }
    case Kind::StagedCols: {
      if constexpr (sizeof(T) <= 4) {
        const int64_t tiles = cdiv(a.inner, int64_t(kScTx) * V);
        return launch_staged(staged_cols_kernel_for<T, BWD>(a.log), p, a.outer * tiles, st, A_, B_, O, a.outer, N,
                             a.inner, tiles, p.ch, p.stages);
      }
      return cudaErrorInvalidValue;  // 2- and 4-byte types only
    }
    default:
      return cudaErrorInvalidValue;  // not a kernel of this file
  }
}

}  // namespace

namespace softmax_detail {

cudaError_t launch_cols(const SoftmaxArgs& a, const Plan& p, cudaStream_t st, bool bwd) {
  return dispatch_typed(
      a, bwd, [&](auto tag, auto bwd_c) { return launch_cols_typed<decltype(tag), decltype(bwd_c)::value>(a, p, st); });
}

const void* inner_cluster_kernel_handle() {
  return reinterpret_cast<const void*>(inner_cluster_fwd_kernel<float, false>);
}

const void* staged_cols_kernel_handle(DType dt, bool log, bool bwd) {
  return dispatch_dtype(dt, [&](auto tag) -> const void* {
    using T = decltype(tag);
    if constexpr (sizeof(T) > 4) {
      return nullptr;
    } else {
      return bwd ? reinterpret_cast<const void*>(staged_cols_kernel_for<T, true>(log))
                 : reinterpret_cast<const void*>(staged_cols_kernel_for<T, false>(log));
    }
  });
}

}  // namespace softmax_detail
}  // namespace gpu_puzzles
