// Embedding on CUDA: the curriculum's two grids, forward and backward.
//   coalesced : a group of G lanes (G <= 32, a power of two) owns one token row
//               and walks it in 16-byte vectors, kU vectors per lane in flight;
//               consecutive lanes touch consecutive 16-byte words of one row, so
//               every warp request is whole cache lines. Small E packs several
//               rows into a warp instead of idling lanes.
//   2d        : the seed's 16x16 blocks, x over tokens, y over the embedding
//               dimension. A warp is 16 tokens x 2 columns: 16 different rows,
//               2 elements each, i.e. 16 scattered sectors per request.
// Backward (coalesced): indices are sorted on the host (stable), then
//   mark  : [start, end) of each valid key's run in the sorted order;
//   tiles : the sorted entries in tiles of kEmbTile; a group sums its tile's
//           grad rows run by run, writing a run that is the whole segment
//           straight into grad_weight and a run cut by a tile edge into a
//           per-tile partial (head or tail slot);
//   rows  : every other grad_weight row: zeros for untouched rows, or the
//           partials of a segment spanning tiles, added in tile order.
// Every output element is written exactly once and every sum runs in a fixed
// order, so the result is bit-identical run to run, with no (V, E) fp32 buffer.
// Index arithmetic is 64-bit throughout.
#include "common/device.cuh"
#include "embedding/embedding.h"
#include "embedding/embedding_plan.h"

namespace gpu_puzzles {
namespace {

using embedding::kThreads;
using embedding::kU;
using embedding::Plan;

// ---- N-element access: one 16-byte vector (N * sizeof(T) == 16) or a scalar (N == 1)

template <typename T, int N>
__device__ __forceinline__ void load_n(T (&r)[N], const T* __restrict__ p) {
  if constexpr (N == 1) {
    r[0] = p[0];
  } else {
    Vec<T, N> v;
    load_vec(v, p);
#pragma unroll
    for (int j = 0; j < N; ++j) r[j] = v.e[j];
  }
}

template <typename T, int N>
__device__ __forceinline__ void store_n(T* __restrict__ p, const T (&r)[N]) {
  if constexpr (N == 1) {
    p[0] = r[0];
  } else {
    Vec<T, N> v;
#pragma unroll
    for (int j = 0; j < N; ++j) v.e[j] = r[j];
    store_vec(p, v);
  }
}

template <typename T>
__device__ __forceinline__ T zero_of() {
  return from_acc<T>(acc_t<T>(0));
}

unsigned blocks_for(int64_t units, int lg) {
  const int64_t per_block = kThreads >> lg;
  const int64_t b = (units + per_block - 1) / per_block;
  // Kernels loop grid-stride, so capping the grid is safe.
  return static_cast<unsigned>(b < (int64_t(1) << 30) ? b : (int64_t(1) << 30));
}

__device__ __forceinline__ bool valid_key(int64_t v, int64_t V, int64_t pad) { return v >= 0 && v < V && v != pad; }

// ---- forward ---------------------------------------------------------------

template <typename T, typename I, int N>
__global__ void __launch_bounds__(kThreads)
    emb_fwd(const I* __restrict__ idx, RowStrides is, const T* __restrict__ w, int64_t ws, T* __restrict__ out,
            int64_t ntok, int64_t V, int64_t nvec, int lg, int64_t chunks) {
  const int G = 1 << lg;
  const int lane = threadIdx.x & (G - 1);
  const int64_t per_block = kThreads >> lg;
  const int64_t units = ntok * chunks;
  for (int64_t unit = blockIdx.x * per_block + (threadIdx.x >> lg); unit < units;
       unit += static_cast<int64_t>(gridDim.x) * per_block) {
    const int64_t t = unit / chunks;
    const int64_t c = unit - t * chunks;
    const int64_t v = static_cast<int64_t>(idx[row_offset(is, t)]);
    const bool ok = v >= 0 && v < V;  // the seed's rule: out of range -> zero row
    const T* src = w + (ok ? v : 0) * ws;
    T* dst = out + t * nvec * N;
    const int64_t s0 = c * G * kU + lane;
    T r[kU][N];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int64_t s = s0 + u * G;
      if (s < nvec) {
        if (ok) {
          load_n<T, N>(r[u], src + s * N);
        } else {
#pragma unroll
          for (int j = 0; j < N; ++j) r[u][j] = zero_of<T>();
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int64_t s = s0 + u * G;
      if (s < nvec) store_n<T, N>(dst + s * N, r[u]);
    }
  }
}

// The seed's 2D kernel, kept faithful: one element per thread, threadIdx.x
// over tokens (the fast-varying index inside a warp), threadIdx.y over columns.
template <typename T, typename I>
__global__ void __launch_bounds__(256) emb_fwd_2d(const I* __restrict__ idx, RowStrides is, const T* __restrict__ w,
                                                  int64_t ws, T* __restrict__ out, int64_t ntok, int64_t V, int64_t E) {
  const int64_t tok = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (tok >= ntok) return;
  const int64_t v = static_cast<int64_t>(idx[row_offset(is, tok)]);
  const bool ok = v >= 0 && v < V;
  for (int64_t e = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; e < E;
       e += static_cast<int64_t>(gridDim.y) * blockDim.y)
    out[tok * E + e] = ok ? w[v * ws + e] : zero_of<T>();
}

// ---- backward: sorted segments ----------------------------------------------

__global__ void emb_bwd_mark(const int64_t* __restrict__ key, int64_t* __restrict__ seg, int64_t ntok, int64_t V,
                             int64_t pad) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < ntok;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t v = key[i];
    if (!valid_key(v, V, pad)) continue;
    if (i == 0 || key[i - 1] != v) seg[2 * v] = i;
    if (i == ntok - 1 || key[i + 1] != v) seg[2 * v + 1] = i + 1;
  }
}

template <typename T, int N>
__device__ __forceinline__ void zero_acc(acc_t<T> (&acc)[kU][N]) {
#pragma unroll
  for (int u = 0; u < kU; ++u)
#pragma unroll
    for (int j = 0; j < N; ++j) acc[u][j] = acc_t<T>(0);
}

template <typename T, int N>
__device__ __forceinline__ void store_acc_row(T* __restrict__ row, const acc_t<T> (&acc)[kU][N], int64_t s0, int G,
                                              int64_t nvec) {
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const int64_t s = s0 + u * G;
    if (s < nvec) {
      T r[N];
#pragma unroll
      for (int j = 0; j < N; ++j) r[j] = from_acc<T>(acc[u][j]);
      store_n<T, N>(row + s * N, r);
    }
  }
}

// Flush the run [a, b) of key v found in tile [i0, i1): the whole segment goes
// to grad_weight; a piece of a longer segment goes to the tile's head slot
// (run starts at the tile's first entry, segment began earlier) or tail slot.
template <typename T, int N>
__device__ __forceinline__ void flush_run(int64_t v, int64_t a, int64_t b, int64_t i0, int64_t k,
                                          const int64_t* __restrict__ seg, acc_t<T>* __restrict__ part,
                                          T* __restrict__ gw, const acc_t<T> (&acc)[kU][N], int64_t s0, int G,
                                          int64_t nvec) {
  const int64_t s = seg[2 * v], e = seg[2 * v + 1];
  if (s == a && e == b) {
    store_acc_row<T, N>(gw + v * nvec * N, acc, s0, G, nvec);
    return;
  }
  const int64_t slot = (a == i0 && s < a) ? 2 * k : 2 * k + 1;
  acc_t<T>* prow = part + slot * nvec * N;
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const int64_t sl = s0 + u * G;
    if (sl < nvec)
#pragma unroll
      for (int j = 0; j < N; ++j) prow[sl * N + j] = acc[u][j];
  }
}

template <typename T, int N>
__global__ void __launch_bounds__(kThreads)
    emb_bwd_tiles(const T* __restrict__ g, RowStrides gs, const int64_t* __restrict__ key,
                  const int64_t* __restrict__ pos, const int64_t* __restrict__ seg, acc_t<T>* __restrict__ part,
                  T* __restrict__ gw, int64_t ntok, int64_t V, int64_t pad, int64_t nvec, int lg, int64_t chunks,
                  int64_t tiles) {
  using A = acc_t<T>;
  const int G = 1 << lg;
  const int lane = threadIdx.x & (G - 1);
  const int64_t per_block = kThreads >> lg;
  const int64_t units = tiles * chunks;
  for (int64_t unit = blockIdx.x * per_block + (threadIdx.x >> lg); unit < units;
       unit += static_cast<int64_t>(gridDim.x) * per_block) {
    const int64_t k = unit / chunks;
    const int64_t c = unit - k * chunks;
    const int64_t s0 = c * G * kU + lane;
    const int64_t i0 = k * kEmbTile;
    const int64_t i1 = i0 + kEmbTile < ntok ? i0 + kEmbTile : ntok;
    A acc[kU][N];
    zero_acc<T, N>(acc);
    int64_t cur = -1, run_a = i0;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t v = key[i];
      if (v != cur) {
        if (valid_key(cur, V, pad)) {
          flush_run<T, N>(cur, run_a, i, i0, k, seg, part, gw, acc, s0, G, nvec);
          zero_acc<T, N>(acc);
        }
        cur = v;
        run_a = i;
      }
      if (!valid_key(v, V, pad)) continue;
      const T* grow = g + row_offset(gs, pos[i]);
      T x[kU][N];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int64_t s = s0 + u * G;
        if (s < nvec) load_n<T, N>(x[u], grow + s * N);
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int64_t s = s0 + u * G;
        if (s < nvec)
#pragma unroll
          for (int j = 0; j < N; ++j) acc[u][j] += to_acc<A>(x[u][j]);
      }
    }
    if (valid_key(cur, V, pad)) flush_run<T, N>(cur, run_a, i1, i0, k, seg, part, gw, acc, s0, G, nvec);
  }
}

template <typename T, int N>
__global__ void __launch_bounds__(kThreads)
    emb_bwd_rows(const int64_t* __restrict__ seg, const acc_t<T>* __restrict__ part, T* __restrict__ gw, int64_t V,
                 int64_t nvec, int lg, int64_t chunks) {
  using A = acc_t<T>;
  const int G = 1 << lg;
  const int lane = threadIdx.x & (G - 1);
  const int64_t per_block = kThreads >> lg;
  const int64_t units = V * chunks;
  for (int64_t unit = blockIdx.x * per_block + (threadIdx.x >> lg); unit < units;
       unit += static_cast<int64_t>(gridDim.x) * per_block) {
    const int64_t v = unit / chunks;
    const int64_t c = unit - v * chunks;
    const int64_t s0 = c * G * kU + lane;
    const int64_t s = seg[2 * v], e = seg[2 * v + 1];
    A acc[kU][N];
    zero_acc<T, N>(acc);
    if (e != 0) {  // a valid segment ends at >= 1; e == 0: untouched, padding or never seen
      const int64_t ks = s / kEmbTile, ke = (e - 1) / kEmbTile;
      if (ks == ke) continue;  // whole segment in one tile: emb_bwd_tiles wrote it
      for (int64_t k = ks; k <= ke; ++k) {
        const A* prow = part + (k == ks ? 2 * k + 1 : 2 * k) * nvec * N;
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int64_t sl = s0 + u * G;
          if (sl < nvec)
#pragma unroll
            for (int j = 0; j < N; ++j) acc[u][j] += prow[sl * N + j];
        }
      }
    }
    store_acc_row<T, N>(gw + v * nvec * N, acc, s0, G, nvec);
  }
}

// ---- backward of the 2D kernel: atomics on the same grid ---------------------

template <typename T, typename I>
__global__ void __launch_bounds__(256)
    emb_bwd_2d_atomic(const T* __restrict__ g, const I* __restrict__ idx, acc_t<T>* __restrict__ acc, int64_t ntok,
                      int64_t V, int64_t E, int64_t pad) {
  const int64_t tok = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (tok >= ntok) return;
  const int64_t v = static_cast<int64_t>(idx[tok]);
  if (!valid_key(v, V, pad)) return;
  for (int64_t e = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; e < E;
       e += static_cast<int64_t>(gridDim.y) * blockDim.y)
    atomicAdd(acc + v * E + e, to_acc<acc_t<T>>(g[tok * E + e]));
}

template <typename T>
__global__ void emb_convert(const acc_t<T>* __restrict__ acc, T* __restrict__ out, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = from_acc<T>(acc[i]);
}

dim3 grid_2d(int64_t ntok, int64_t E) {
  const int64_t gx = (ntok + 15) / 16, gy = (E + 15) / 16;
  return dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy < 65535 ? gy : 65535));
}

template <typename F>
void dispatch_index(bool idx64, F&& f) {
  if (idx64)
    f(int64_t{});
  else
    f(int32_t{});
}

}  // namespace

LaunchStatus embedding_forward_cuda(const EmbeddingFwdArgs& a, cudaStream_t stream) {
  if (a.T == 0 || a.E == 0) return 0;
  dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int NV = 16 / sizeof(T);
    const Plan p = embedding::forward_plan(a, sizeof(T));
    dispatch_index(a.idx64, [&](auto itag) {
      using I = decltype(itag);
      auto launch = [&](auto n_c) {
        constexpr int N = decltype(n_c)::value;
        emb_fwd<T, I, N><<<blocks_for(a.T * p.chunks, p.lg), kThreads, 0, stream>>>(
            static_cast<const I*>(a.idx), a.is, static_cast<const T*>(a.weight), a.w_stride, static_cast<T*>(a.out),
            a.T, a.V, p.nvec, p.lg, p.chunks);
      };
      if (p.vec)
        launch(std::integral_constant<int, NV>{});
      else
        launch(std::integral_constant<int, 1>{});
    });
  });
  return static_cast<LaunchStatus>(cudaGetLastError());
}

LaunchStatus embedding_forward_2d_cuda(const EmbeddingFwdArgs& a, cudaStream_t stream) {
  if (a.T == 0 || a.E == 0) return 0;
  dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    dispatch_index(a.idx64, [&](auto itag) {
      using I = decltype(itag);
      emb_fwd_2d<T, I><<<grid_2d(a.T, a.E), dim3(16, 16), 0, stream>>>(static_cast<const I*>(a.idx), a.is,
                                                                       static_cast<const T*>(a.weight), a.w_stride,
                                                                       static_cast<T*>(a.out), a.T, a.V, a.E);
    });
  });
  return static_cast<LaunchStatus>(cudaGetLastError());
}

int64_t embedding_backward_partial_elems(int64_t T, int64_t E) {
  const int64_t tiles = (T + kEmbTile - 1) / kEmbTile;
  return 2 * tiles * E;
}

LaunchStatus embedding_backward_sorted_cuda(const EmbeddingBwdArgs& a, cudaStream_t stream) {
  if (a.V == 0 || a.E == 0) return 0;
  if (a.T > 0) {
    const int64_t blocks = (a.T + 255) / 256;
    emb_bwd_mark<<<static_cast<unsigned>(blocks < (1 << 20) ? blocks : (1 << 20)), 256, 0, stream>>>(
        a.sorted_key, a.seg, a.T, a.V, a.padding_idx);
  }
  dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    constexpr int NV = 16 / sizeof(T);
    const Plan p = embedding::backward_plan(a, sizeof(T));
    auto launch = [&](auto n_c) {
      constexpr int N = decltype(n_c)::value;
      const int64_t tiles = (a.T + kEmbTile - 1) / kEmbTile;
      if (tiles > 0)
        emb_bwd_tiles<T, N><<<blocks_for(tiles * p.chunks, p.lg), kThreads, 0, stream>>>(
            static_cast<const T*>(a.grad_out), a.gs, a.sorted_key, a.sorted_pos, a.seg, static_cast<A*>(a.partial),
            static_cast<T*>(a.grad_weight), a.T, a.V, a.padding_idx, p.nvec, p.lg, p.chunks, tiles);
      emb_bwd_rows<T, N><<<blocks_for(a.V * p.chunks, p.lg), kThreads, 0, stream>>>(
          a.seg, static_cast<const A*>(a.partial), static_cast<T*>(a.grad_weight), a.V, p.nvec, p.lg, p.chunks);
    };
    if (p.vec)
      launch(std::integral_constant<int, NV>{});
    else
      launch(std::integral_constant<int, 1>{});
  });
  return static_cast<LaunchStatus>(cudaGetLastError());
}

LaunchStatus embedding_backward_2d_atomic_cuda(const void* grad_out, const void* idx, bool idx64, void* acc,
                                               void* grad_weight, int64_t T, int64_t V, int64_t E, int64_t padding_idx,
                                               DType dtype, cudaStream_t stream) {
  if (V == 0 || E == 0) return 0;
  dispatch_dtype(dtype, [&](auto tag) {
    using T_ = decltype(tag);
    using A = acc_t<T_>;
    const int64_t n = V * E;
    cudaMemsetAsync(acc, 0, sizeof(A) * n, stream);
    if (T > 0) {
      dispatch_index(idx64, [&](auto itag) {
        using I = decltype(itag);
        emb_bwd_2d_atomic<T_, I><<<grid_2d(T, E), dim3(16, 16), 0, stream>>>(
            static_cast<const T_*>(grad_out), static_cast<const I*>(idx), static_cast<A*>(acc), T, V, E, padding_idx);
      });
    }
    if (static_cast<void*>(acc) != grad_weight) {
      const int64_t blocks = (n + 255) / 256;
      emb_convert<T_><<<static_cast<unsigned>(blocks < (1 << 20) ? blocks : (1 << 20)), 256, 0, stream>>>(
          static_cast<const A*>(acc), static_cast<T_*>(grad_weight), n);
    }
  });
  return static_cast<LaunchStatus>(cudaGetLastError());
}

}  // namespace gpu_puzzles
