// Softmax / log_softmax forward and backward on CUDA.
//
// Tensors are contiguous (outer, N, inner), reduced over N. The auto kernels:
//   rows (inner == 1), N <= 128 * V : one warp per row, the row in registers
//                                      (V = elements per 16-byte vector); rows of
//                                      N <= 16 V share a warp, a lane per vector;
//   rows, N <= 2048 * V             : one block per row, the row in registers,
//                                      so x (or y and dy) is read exactly once;
//   rows, N <= 131072 on sm_90      : a cluster of 2-8 blocks per row, the row in
//                                      their registers, partials exchanged through
//                                      distributed shared memory: one read;
//   rows, longer (or few long rows) : split: each block reduces a chunk to a
//                                      partial (max, sum), a second kernel merges
//                                      the row's partials and writes its chunk;
//   columns (inner > 1)             : threads over inner (coalesced), each
//                                      reducing over N with a running (max, sum);
//                                      the block's tile is kept in shared memory
//                                      when it fits, so x is read once.
// The teaching kernels (tree / shuffle / online) run one block per row.
// Statistics are float (double for float64); exp is the accurate expf/exp.
// Index arithmetic is 64-bit: tensors may exceed 2^31 elements.
#include <algorithm>
#include <cmath>
#include <initializer_list>

#include <cooperative_groups.h>

#include "common/device.cuh"
#include "softmax/softmax.h"

namespace gpu_puzzles {
namespace {

namespace cg = cooperative_groups;

constexpr int kWarpRowsThreads = 256;   // 8 rows per block in the warp path
constexpr int kSplitThreads = 256;
constexpr int64_t kSplitChunk = 16384;  // elements of a row per block (a multiple of every V)
constexpr int kInnerThreads = 512;
constexpr int kLoopThreads = 256;       // power of two: the tree reduction halves it
constexpr int64_t kInnerCacheBytes = 100 * 1024;
constexpr int64_t kMaxGrid = int64_t(1) << 24;  // grid-stride loops cover the rest

template <typename A> __device__ __forceinline__ A neg_inf() { return static_cast<A>(-INFINITY); }
__device__ __forceinline__ float exp_a(float v) { return expf(v); }
__device__ __forceinline__ double exp_a(double v) { return exp(v); }
__device__ __forceinline__ float log_a(float v) { return logf(v); }
__device__ __forceinline__ double log_a(double v) { return log(v); }
__device__ __forceinline__ float max_a(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double max_a(double a, double b) { return fmax(a, b); }

// Running (max m, sum s of exp(x - m)). -inf adds nothing; +inf or NaN make s
// NaN, so the row becomes NaN as in torch.softmax (exp(inf - inf) there).
template <typename A> __device__ __forceinline__ void online_add(A& m, A& s, A x) {
  if (x > m) {
    s = s * exp_a(m - x) + (A(1) + (x - x));  // x - x is NaN for x = +inf
    m = x;
  } else if (x != neg_inf<A>()) {
    s += exp_a(x - m);
  }
}

// Merge (m2, s2) into (m, s). An empty part (s == 0) contributes nothing, even
// when both maxima are -inf (exp(-inf + inf) would be NaN).
template <typename A> __device__ __forceinline__ void online_merge(A& m, A& s, A m2, A s2) {
  const A mn = max_a(m, m2);
  const A a = s == A(0) ? A(0) : s * exp_a(m - mn);
  const A b = s2 == A(0) ? A(0) : s2 * exp_a(m2 - mn);
  m = mn;
  s = a + b;
}

// Block-wide reductions through `red` (33 slots). Every thread of the block
// calls them (barriers); blockDim.x is a multiple of 32. The trailing barrier
// lets the caller reuse `red` at once.
template <typename A> __device__ __forceinline__ A block_sum(A v, A* red) {
  v = warp_sum(v);
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  if (lane == 0) red[w] = v;
  __syncthreads();
  if (w == 0) {
    A t = lane < nw ? red[lane] : A(0);
    t = warp_sum(t);
    if (lane == 0) red[32] = t;
  }
  __syncthreads();
  const A r = red[32];
  __syncthreads();
  return r;
}

template <typename A> __device__ __forceinline__ A block_max(A v, A* red) {
  v = warp_max(v);
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  if (lane == 0) red[w] = v;
  __syncthreads();
  if (w == 0) {
    A t = lane < nw ? red[lane] : neg_inf<A>();
    t = warp_max(t);
    if (lane == 0) red[32] = t;
  }
  __syncthreads();
  const A r = red[32];
  __syncthreads();
  return r;
}

// The seed's shared-memory tree: halve the active threads each step.
template <bool IS_MAX, typename A> __device__ __forceinline__ A tree_reduce(A v, A* buf) {
  const int t = threadIdx.x;
  buf[t] = v;
  __syncthreads();
  for (int st = blockDim.x >> 1; st > 0; st >>= 1) {
    if (t < st) buf[t] = IS_MAX ? max_a(buf[t], buf[t + st]) : buf[t] + buf[t + st];
    __syncthreads();
  }
  const A r = buf[0];
  __syncthreads();
  return r;
}

// Block-wide merge of per-thread running (m, s).
template <typename A> __device__ __forceinline__ void block_merge(A& m, A& s, A* red) {
  const A mb = block_max(m, red);
  s = block_sum(s == A(0) ? A(0) : s * exp_a(m - mb), red);
  m = mb;
}

// V consecutive elements from i0 (out-of-range ones read as `fill`). With
// vec, N % V == 0 and the row is 16-byte aligned, so a chunk is wholly in or out.
template <typename T, int V, typename A>
__device__ __forceinline__ void load_chunk(A (&v)[V], const T* __restrict__ p, int64_t i0, int64_t N, bool vec,
                                           A fill) {
  if (vec) {
    if (i0 < N) {
      Vec<T, V> t;
      load_vec(t, p + i0);
#pragma unroll
      for (int k = 0; k < V; ++k) v[k] = to_acc<A>(t.e[k]);
    } else {
#pragma unroll
      for (int k = 0; k < V; ++k) v[k] = fill;
    }
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) v[k] = i0 + k < N ? to_acc<A>(p[i0 + k]) : fill;
  }
}

template <typename T, int V, typename A>
__device__ __forceinline__ void store_chunk(T* __restrict__ p, const A (&v)[V], int64_t i0, int64_t N, bool vec) {
  if (vec) {
    if (i0 < N) {
      Vec<T, V> t;
#pragma unroll
      for (int k = 0; k < V; ++k) t.e[k] = from_acc<T>(v[k]);
      store_vec(p + i0, t);
    }
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k)
      if (i0 + k < N) p[i0 + k] = from_acc<T>(v[k]);
  }
}

// Reductions over a group: the block, or LANES aligned lanes of a warp (xor
// offsets below LANES never leave the group). Every lane of the warp calls them.
template <bool BLOCK, int LANES, typename A> __device__ __forceinline__ A group_max(A v, A* red) {
  if constexpr (BLOCK) {
    return block_max(v, red);
  } else {
#pragma unroll
    for (int o = LANES / 2; o > 0; o >>= 1) v = max_a(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
  }
}
template <bool BLOCK, int LANES, typename A> __device__ __forceinline__ A group_sum(A v, A* red) {
  if constexpr (BLOCK) {
    return block_sum(v, red);
  } else {
#pragma unroll
    for (int o = LANES / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
  }
}

// ---- rows in registers: LANES lanes of a warp (BLOCK = false) or a block per row
// Thread t of a G-thread group holds chunks c = 0..CH-1 of V elements starting
// at (c * G + t) * V: each 16-byte load of a warp is one contiguous 512 bytes.
// Short rows: a warp holds 32 / LANES rows. The row loop is warp-uniform (the
// shuffles need every lane); a lane past the last row works on an empty row
// (Nr = 0: loads give the fill value, stores write nothing). Warps exit
// independently (no block barrier is used in warp mode).
template <typename T, int CH, bool BLOCK, bool BWD, int LANES = 32>
__global__ void __launch_bounds__(BLOCK ? 1024 : kWarpRowsThreads)
rows_regs_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out, int64_t rows, int64_t N,
                 bool log, bool vec) {
  using A = acc_t<T>;
  constexpr int V = 16 / sizeof(T);
  static_assert(LANES >= 1 && LANES <= 32 && (LANES & (LANES - 1)) == 0, "LANES: a power of two up to 32");
  __shared__ A red[33];
  const int G = BLOCK ? int(blockDim.x) : LANES;
  const int t = BLOCK ? int(threadIdx.x) : int(threadIdx.x & (LANES - 1));
  const int64_t rpw = BLOCK ? 1 : 32 / LANES;  // rows per warp and step
  const int64_t per = BLOCK ? 1 : (blockDim.x >> 5) * rpw;
  const int64_t first = BLOCK ? int64_t(blockIdx.x) : (int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5)) * rpw;
  const int64_t step = int64_t(gridDim.x) * per;
  for (int64_t r0 = first; r0 < rows; r0 += step) {
    const int64_t row = BLOCK ? r0 : r0 + (threadIdx.x & 31) / LANES;
    const bool valid = row < rows;
    const int64_t Nr = valid ? N : 0;
    const T* ar = a + (valid ? row : 0) * N;
    T* outr = out + (valid ? row : 0) * N;
    A v[CH][V];
    if constexpr (!BWD) {
      A m = neg_inf<A>();
#pragma unroll
      for (int c = 0; c < CH; ++c) {
        load_chunk<T, V>(v[c], ar, (int64_t(c) * G + t) * V, Nr, vec, neg_inf<A>());
#pragma unroll
        for (int k = 0; k < V; ++k) m = max_a(m, v[c][k]);
      }
      m = group_max<BLOCK, LANES>(m, red);
      A s = A(0);
#pragma unroll
      for (int c = 0; c < CH; ++c)
#pragma unroll
        for (int k = 0; k < V; ++k) {
          const A d = v[c][k] - m;  // padding: -inf - m, exp 0
          const A e = exp_a(d);
          s += e;
          v[c][k] = log ? d : e;
        }
      s = group_sum<BLOCK, LANES>(s, red);
      const A sub = log ? log_a(s) : A(0);
      const A mul = log ? A(1) : A(1) / s;
#pragma unroll
      for (int c = 0; c < CH; ++c) {
#pragma unroll
        for (int k = 0; k < V; ++k) v[c][k] = log ? v[c][k] - sub : v[c][k] * mul;
        store_chunk<T, V>(outr, v[c], (int64_t(c) * G + t) * V, Nr, vec);
      }
    } else {
      // softmax: dx = y (dy - sum(dy y));  log_softmax: dx = dy - exp(y) sum(dy)
      const T* br = b + (valid ? row : 0) * N;
      A g[CH][V];
      A s = A(0);
#pragma unroll
      for (int c = 0; c < CH; ++c) {
        load_chunk<T, V>(v[c], ar, (int64_t(c) * G + t) * V, Nr, vec, A(0));
        load_chunk<T, V>(g[c], br, (int64_t(c) * G + t) * V, Nr, vec, A(0));
#pragma unroll
        for (int k = 0; k < V; ++k) s += log ? g[c][k] : g[c][k] * v[c][k];
      }
      s = group_sum<BLOCK, LANES>(s, red);
#pragma unroll
      for (int c = 0; c < CH; ++c) {
#pragma unroll
        for (int k = 0; k < V; ++k) v[c][k] = log ? g[c][k] - exp_a(v[c][k]) * s : v[c][k] * (g[c][k] - s);
        store_chunk<T, V>(outr, v[c], (int64_t(c) * G + t) * V, Nr, vec);
      }
    }
  }
}

// ---- long rows: split across blocks ----------------------------------------
// Block `blk` = row * S + c reduces elements [c * kSplitChunk, ...) of its row to
// a partial: (max, sum) for the forward, sum for the backward.
template <typename T, bool BWD>
__global__ void __launch_bounds__(kSplitThreads)
split_stats_kernel(const T* __restrict__ a, const T* __restrict__ b, acc_t<T>* __restrict__ ws, int64_t rows,
                   int64_t N, int64_t S, bool log, bool vec) {
  using A = acc_t<T>;
  constexpr int V = 16 / sizeof(T);
  __shared__ A red[33];
  for (int64_t blk = blockIdx.x; blk < rows * S; blk += gridDim.x) {
    const int64_t row = blk / S, lo = (blk % S) * kSplitChunk;
    const int64_t hi = min(N, lo + kSplitChunk);
    const T* ar = a + row * N;
    A m = neg_inf<A>(), s = A(0);
    for (int64_t i = lo + int64_t(threadIdx.x) * V; i < hi; i += int64_t(kSplitThreads) * V) {
      A va[V];
      if constexpr (!BWD) {
        load_chunk<T, V>(va, ar, i, hi, vec, neg_inf<A>());
#pragma unroll
        for (int k = 0; k < V; ++k) online_add(m, s, va[k]);
      } else {
        A vb[V];
        load_chunk<T, V>(va, ar, i, hi, vec, A(0));
        load_chunk<T, V>(vb, b + row * N, i, hi, vec, A(0));
#pragma unroll
        for (int k = 0; k < V; ++k) s += log ? vb[k] : va[k] * vb[k];
      }
    }
    if constexpr (!BWD) {
      block_merge(m, s, red);
      if (threadIdx.x == 0) { ws[2 * blk] = m; ws[2 * blk + 1] = s; }
    } else {
      s = block_sum(s, red);
      if (threadIdx.x == 0) ws[blk] = s;
    }
  }
}

// Merge the row's S partials (same order in every block: deterministic), then
// write this block's chunk.
template <typename T, bool BWD>
__global__ void __launch_bounds__(kSplitThreads)
split_apply_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out,
                   const acc_t<T>* __restrict__ ws, int64_t rows, int64_t N, int64_t S, bool log, bool vec) {
  using A = acc_t<T>;
  constexpr int V = 16 / sizeof(T);
  __shared__ A red[33];
  for (int64_t blk = blockIdx.x; blk < rows * S; blk += gridDim.x) {
    const int64_t row = blk / S, lo = (blk % S) * kSplitChunk;
    const int64_t hi = min(N, lo + kSplitChunk);
    A m = neg_inf<A>(), s = A(0);
    if constexpr (!BWD) {
      for (int64_t j = threadIdx.x; j < S; j += kSplitThreads) online_merge(m, s, ws[2 * (row * S + j)], ws[2 * (row * S + j) + 1]);
      block_merge(m, s, red);
    } else {
      for (int64_t j = threadIdx.x; j < S; j += kSplitThreads) s += ws[row * S + j];
      s = block_sum(s, red);
    }
    const A sub = log ? log_a(s) : A(0);
    const A mul = A(1) / s;
    const T* ar = a + row * N;
    T* outr = out + row * N;
    for (int64_t i = lo + int64_t(threadIdx.x) * V; i < hi; i += int64_t(kSplitThreads) * V) {
      A va[V];
      load_chunk<T, V>(va, ar, i, hi, vec, A(0));
      if constexpr (!BWD) {
#pragma unroll
        for (int k = 0; k < V; ++k) va[k] = log ? va[k] - m - sub : exp_a(va[k] - m) * mul;
      } else {
        A vb[V];
        load_chunk<T, V>(vb, b + row * N, i, hi, vec, A(0));
#pragma unroll
        for (int k = 0; k < V; ++k) va[k] = log ? vb[k] - exp_a(va[k]) * s : va[k] * (vb[k] - s);
      }
      store_chunk<T, V>(outr, va, i, hi, vec);
    }
  }
}

// ---- long rows on Hopper: a thread-block cluster per row -----------------------
// CS blocks (2..8) of one cluster share a row, each holding its slice in
// registers (16 elements per thread), so x is read once even for rows too long
// for one block. Block partials are exchanged through distributed shared memory.
// `part` is double-buffered by row parity: a block may start the next row while a
// slower one still reads this row's partials.
constexpr int kClusterElems = 16;  // elements per thread
constexpr int kClusterMax = 8;     // portable cluster size limit

template <typename T, bool BWD>
__global__ void __launch_bounds__(1024)
cluster_rows_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out, int64_t rows, int64_t N,
                    bool log, bool vec) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using A = acc_t<T>;
  constexpr int V = 16 / sizeof(T);
  constexpr int CH = kClusterElems / V;
  __shared__ A red[33];
  __shared__ A part[2][2];  // [parity][max, sum]
  cg::cluster_group cluster = cg::this_cluster();
  const int CS = int(cluster.num_blocks());
  const int G = int(blockDim.x) * CS;
  const int t = int(cluster.block_rank()) * int(blockDim.x) + int(threadIdx.x);
  const int64_t step = gridDim.x / CS;
  int parity = 0;
  for (int64_t row = blockIdx.x / CS; row < rows; row += step, parity ^= 1) {
    const T* ar = a + row * N;
    T* outr = out + row * N;
    A v[CH][V];
    A s = A(0);
    if constexpr (!BWD) {
      A m = neg_inf<A>();
#pragma unroll
      for (int c = 0; c < CH; ++c) {
        load_chunk<T, V>(v[c], ar, (int64_t(c) * G + t) * V, N, vec, neg_inf<A>());
#pragma unroll
        for (int k = 0; k < V; ++k) m = max_a(m, v[c][k]);
      }
      m = block_max(m, red);
      if (threadIdx.x == 0) part[parity][0] = m;
      cluster.sync();
      for (int r = 0; r < CS; ++r) m = max_a(m, *cluster.map_shared_rank(&part[parity][0], r));
#pragma unroll
      for (int c = 0; c < CH; ++c)
#pragma unroll
        for (int k = 0; k < V; ++k) {
          const A d = v[c][k] - m;
          const A e = exp_a(d);
          s += e;
          v[c][k] = log ? d : e;
        }
      s = block_sum(s, red);
      if (threadIdx.x == 0) part[parity][1] = s;
      cluster.sync();
      s = A(0);
      for (int r = 0; r < CS; ++r) s += *cluster.map_shared_rank(&part[parity][1], r);  // same order everywhere
      const A sub = log ? log_a(s) : A(0);
      const A mul = log ? A(1) : A(1) / s;
#pragma unroll
      for (int c = 0; c < CH; ++c) {
#pragma unroll
        for (int k = 0; k < V; ++k) v[c][k] = log ? v[c][k] - sub : v[c][k] * mul;
        store_chunk<T, V>(outr, v[c], (int64_t(c) * G + t) * V, N, vec);
      }
    } else {
      const T* br = b + row * N;
      A g[CH][V];
#pragma unroll
      for (int c = 0; c < CH; ++c) {
        load_chunk<T, V>(v[c], ar, (int64_t(c) * G + t) * V, N, vec, A(0));
        load_chunk<T, V>(g[c], br, (int64_t(c) * G + t) * V, N, vec, A(0));
#pragma unroll
        for (int k = 0; k < V; ++k) s += log ? g[c][k] : g[c][k] * v[c][k];
      }
      s = block_sum(s, red);
      if (threadIdx.x == 0) part[parity][1] = s;
      cluster.sync();
      s = A(0);
      for (int r = 0; r < CS; ++r) s += *cluster.map_shared_rank(&part[parity][1], r);
#pragma unroll
      for (int c = 0; c < CH; ++c) {
#pragma unroll
        for (int k = 0; k < V; ++k) v[c][k] = log ? g[c][k] - exp_a(v[c][k]) * s : v[c][k] * (g[c][k] - s);
        store_chunk<T, V>(outr, v[c], (int64_t(c) * G + t) * V, N, vec);
      }
    }
  }
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
          if constexpr (BWD) s += log ? vb[u] : va[u] * vb[u];
          else online_add(m, s, va[u]);
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
        if constexpr (BWD) s += st[1][j * TC + tx];
        else online_merge(m, s, st[0][j * TC + tx], st[1][j * TC + tx]);
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

// ---- the curriculum's steps: one block per row, looping over the row --------
template <typename T, int ALGO, bool BWD>
__global__ void __launch_bounds__(kLoopThreads)
looped_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out, int64_t rows, int64_t N,
              bool log) {
  using A = acc_t<T>;
  __shared__ A buf[kLoopThreads];
  __shared__ A red[33];
  const int t = threadIdx.x;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* ar = a + row * N;
    T* outr = out + row * N;
    if constexpr (!BWD) {
      A m = neg_inf<A>(), s = A(0);
      if (ALGO == int(SoftmaxAlgo::Online)) {
        for (int64_t i = t; i < N; i += kLoopThreads) online_add(m, s, to_acc<A>(ar[i]));
        block_merge(m, s, red);
      } else {
        for (int64_t i = t; i < N; i += kLoopThreads) m = max_a(m, to_acc<A>(ar[i]));
        m = ALGO == int(SoftmaxAlgo::Tree) ? tree_reduce<true>(m, buf) : block_max(m, red);
        for (int64_t i = t; i < N; i += kLoopThreads) s += exp_a(to_acc<A>(ar[i]) - m);
        s = ALGO == int(SoftmaxAlgo::Tree) ? tree_reduce<false>(s, buf) : block_sum(s, red);
      }
      const A sub = log ? log_a(s) : A(0);
      const A mul = A(1) / s;
      for (int64_t i = t; i < N; i += kLoopThreads) {
        const A x = to_acc<A>(ar[i]);
        outr[i] = from_acc<T>(log ? x - m - sub : exp_a(x - m) * mul);
      }
    } else {
      const T* br = b + row * N;
      A s = A(0);
      for (int64_t i = t; i < N; i += kLoopThreads)
        s += log ? to_acc<A>(br[i]) : to_acc<A>(ar[i]) * to_acc<A>(br[i]);
      s = ALGO == int(SoftmaxAlgo::Tree) ? tree_reduce<false>(s, buf) : block_sum(s, red);
      for (int64_t i = t; i < N; i += kLoopThreads) {
        const A y = to_acc<A>(ar[i]), g = to_acc<A>(br[i]);
        outr[i] = from_acc<T>(log ? g - exp_a(y) * s : y * (g - s));
      }
    }
  }
}

// ---- planning ----------------------------------------------------------------

enum class Kind { WarpRows, BlockRows, ClusterRows, Split, Inner, Looped };

struct Plan {
  Kind kind;
  int ch = 1;        // chunks per thread (register paths)
  int lanes = 32;    // lanes per row (WarpRows)
  int threads = 0;   // block size (BlockRows, ClusterRows), TC (Inner)
  int64_t S = 1;     // chunks per row (Split), blocks per cluster (ClusterRows)
  bool cache = false;
  int64_t smem = 0;  // dynamic shared memory bytes (Inner)
};

int esize(DType dt) { return dt == DType::Float64 ? 8 : (dt == DType::Float32 ? 4 : 2); }
int64_t pow2ceil(int64_t v) { int64_t p = 1; while (p < v) p <<= 1; return p; }
int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
bool al16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// Clusters need sm_90 and a kernel compiled for it (a compute_80 PTX JIT-ed on
// Hopper would run the kernel's empty sm_80 body).
bool cluster_ok(bool bwd) {
  int dev = 0, major = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  if (major < 9) return false;
  cudaFuncAttributes fa{};
  const cudaError_t e = bwd ? cudaFuncGetAttributes(&fa, cluster_rows_kernel<float, true>)
                            : cudaFuncGetAttributes(&fa, cluster_rows_kernel<float, false>);
  if (e != cudaSuccess) { cudaGetLastError(); return false; }
  return fa.ptxVersion >= 90;
}

Plan make_plan(const SoftmaxArgs& a, SoftmaxAlgo algo, bool bwd) {
  Plan p{};
  const int es = esize(a.dtype), V = 16 / es;
  if (algo != SoftmaxAlgo::Auto) { p.kind = Kind::Looped; return p; }
  if (a.inner > 1) {
    p.kind = Kind::Inner;
    const int64_t full = std::min<int64_t>(32 / es, pow2ceil(a.inner));
    const int64_t arrays = bwd ? 2 : 1;
    // Narrower tiles read part of a 32-byte sector each; the neighbouring tiles
    // (adjacent blocks, resident together) use the rest of it from L2.
    for (int64_t tc : {full, std::max<int64_t>(1, full / 2), std::max<int64_t>(1, full / 4)}) {
      const int64_t bytes = a.N * tc * es * arrays;
      if (bytes <= kInnerCacheBytes) { p.threads = int(tc); p.cache = true; p.smem = bytes; return p; }
    }
    p.threads = int(full);
    return p;
  }
  const int64_t rows = a.outer, N = a.N;
  if (N <= 32 * 4 * V) {
    p.kind = Kind::WarpRows;
    p.ch = N <= 32 * V ? 1 : (N <= 64 * V ? 2 : 4);
    // Short rows share a warp: one lane per 16-byte vector of the row.
    if (N <= 16 * V) p.lanes = int(pow2ceil(cdiv(N, V)));
    return p;
  }
  // Too long for one block's registers: a cluster per row where the GPU has
  // clusters (float64 would spill at 16 doubles x 2 per thread), else split.
  if (N > 2048 * V && es <= 4 && N <= int64_t(kClusterMax) * 1024 * kClusterElems && cluster_ok(bwd)) {
    p.kind = Kind::ClusterRows;
    p.S = std::max<int64_t>(2, pow2ceil(cdiv(N, int64_t(1024) * kClusterElems)));
    p.threads = int(std::max<int64_t>(128, pow2ceil(cdiv(N, p.S * kClusterElems))));
    return p;
  }
  // Few long rows would leave most SMs idle with one block per row: split them.
  if (N > 2048 * V || (rows < 128 && N >= 4 * kSplitChunk)) {
    p.kind = Kind::Split;
    p.S = cdiv(N, kSplitChunk);
    return p;
  }
  p.kind = Kind::BlockRows;
  p.ch = cdiv(N, 2 * V) >= 128 ? 2 : 1;
  p.threads = int(std::min<int64_t>(1024, std::max<int64_t>(64, pow2ceil(cdiv(N, int64_t(V) * p.ch)))));
  return p;
}

unsigned grid_for(int64_t blocks) { return unsigned(std::max<int64_t>(1, std::min(blocks, kMaxGrid))); }

template <typename T, bool BWD>
cudaError_t launch_typed(const SoftmaxArgs& a, const Plan& p, void* workspace, cudaStream_t st, SoftmaxAlgo algo) {
  const T* A_ = static_cast<const T*>(a.a);
  const T* B_ = static_cast<const T*>(a.b);
  T* O = static_cast<T*>(a.out);
  constexpr int V = 16 / sizeof(T);
  const int64_t rows = a.outer, N = a.N;
  const bool vec = N % V == 0 && al16(a.a) && al16(a.out) && (!BWD || al16(a.b));
  switch (p.kind) {
    case Kind::WarpRows: {
      const int per = kWarpRowsThreads / 32 * (32 / p.lanes);
      const unsigned g = grid_for(cdiv(rows, per));
      if (p.lanes == 1) rows_regs_kernel<T, 1, false, BWD, 1><<<g, kWarpRowsThreads, 0, st>>>(A_, B_, O, rows, N, a.log, vec);
      else if (p.lanes == 2) rows_regs_kernel<T, 1, false, BWD, 2><<<g, kWarpRowsThreads, 0, st>>>(A_, B_, O, rows, N, a.log, vec);
      else if (p.lanes == 4) rows_regs_kernel<T, 1, false, BWD, 4><<<g, kWarpRowsThreads, 0, st>>>(A_, B_, O, rows, N, a.log, vec);
      else if (p.lanes == 8) rows_regs_kernel<T, 1, false, BWD, 8><<<g, kWarpRowsThreads, 0, st>>>(A_, B_, O, rows, N, a.log, vec);
      else if (p.lanes == 16) rows_regs_kernel<T, 1, false, BWD, 16><<<g, kWarpRowsThreads, 0, st>>>(A_, B_, O, rows, N, a.log, vec);
      else if (p.ch == 1) rows_regs_kernel<T, 1, false, BWD><<<g, kWarpRowsThreads, 0, st>>>(A_, B_, O, rows, N, a.log, vec);
      else if (p.ch == 2) rows_regs_kernel<T, 2, false, BWD><<<g, kWarpRowsThreads, 0, st>>>(A_, B_, O, rows, N, a.log, vec);
      else rows_regs_kernel<T, 4, false, BWD><<<g, kWarpRowsThreads, 0, st>>>(A_, B_, O, rows, N, a.log, vec);
      break;
    }
    case Kind::BlockRows: {
      const unsigned g = grid_for(rows);
      if (p.ch == 1) rows_regs_kernel<T, 1, true, BWD><<<g, p.threads, 0, st>>>(A_, B_, O, rows, N, a.log, vec);
      else rows_regs_kernel<T, 2, true, BWD><<<g, p.threads, 0, st>>>(A_, B_, O, rows, N, a.log, vec);
      break;
    }
    case Kind::ClusterRows: {
      cudaLaunchConfig_t cfg{};
      const int64_t clusters = std::min<int64_t>(rows, 4096);  // grid-stride over the rest
      cfg.gridDim = dim3(unsigned(clusters * p.S));
      cfg.blockDim = dim3(unsigned(p.threads));
      cfg.dynamicSmemBytes = 0;
      cfg.stream = st;
      cudaLaunchAttribute attr[1];
      attr[0].id = cudaLaunchAttributeClusterDimension;
      attr[0].val.clusterDim.x = unsigned(p.S);
      attr[0].val.clusterDim.y = 1;
      attr[0].val.clusterDim.z = 1;
      cfg.attrs = attr;
      cfg.numAttrs = 1;
      if constexpr (sizeof(T) <= 4) {  // the plan never picks it for float64
        const cudaError_t e = cudaLaunchKernelEx(&cfg, cluster_rows_kernel<T, BWD>, A_, B_, O, rows, N, a.log, vec);
        if (e != cudaSuccess) return e;
      } else {
        return cudaErrorInvalidValue;
      }
      break;
    }
    case Kind::Split: {
      auto* ws = static_cast<acc_t<T>*>(workspace);
      const unsigned g = grid_for(rows * p.S);
      split_stats_kernel<T, BWD><<<g, kSplitThreads, 0, st>>>(A_, B_, ws, rows, N, p.S, a.log, vec);
      const cudaError_t e = cudaGetLastError();
      if (e != cudaSuccess) return e;
      split_apply_kernel<T, BWD><<<g, kSplitThreads, 0, st>>>(A_, B_, O, ws, rows, N, p.S, a.log, vec);
      break;
    }
    case Kind::Inner: {
      const int64_t tiles = cdiv(a.inner, p.threads);
      const dim3 block(p.threads, kInnerThreads / p.threads);
      const unsigned g = grid_for(a.outer * tiles);
      if (p.cache) {
        auto k = inner_kernel<T, BWD, true>;
        const cudaError_t e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, int(p.smem));
        if (e != cudaSuccess) return e;
        k<<<g, block, size_t(p.smem), st>>>(A_, B_, O, a.outer, N, a.inner, tiles, a.log);
      } else {
        inner_kernel<T, BWD, false><<<g, block, 0, st>>>(A_, B_, O, a.outer, N, a.inner, tiles, a.log);
      }
      break;
    }
    case Kind::Looped: {
      if (a.inner != 1) return cudaErrorInvalidValue;  // the host moves the dim last first
      const unsigned g = grid_for(rows);
      if (algo == SoftmaxAlgo::Tree)
        looped_kernel<T, int(SoftmaxAlgo::Tree), BWD><<<g, kLoopThreads, 0, st>>>(A_, B_, O, rows, N, a.log);
      else if (algo == SoftmaxAlgo::Shuffle)
        looped_kernel<T, int(SoftmaxAlgo::Shuffle), BWD><<<g, kLoopThreads, 0, st>>>(A_, B_, O, rows, N, a.log);
      else
        looped_kernel<T, int(SoftmaxAlgo::Online), BWD><<<g, kLoopThreads, 0, st>>>(A_, B_, O, rows, N, a.log);
      break;
    }
  }
  return cudaGetLastError();
}

LaunchStatus launch(const SoftmaxArgs& a, SoftmaxAlgo algo, void* workspace, cudaStream_t st, bool bwd) {
  if (a.outer * a.N * a.inner == 0) return cudaSuccess;
  const Plan p = make_plan(a, algo, bwd);
  return static_cast<LaunchStatus>(dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    return bwd ? launch_typed<T, true>(a, p, workspace, st, algo) : launch_typed<T, false>(a, p, workspace, st, algo);
  }));
}

}  // namespace

int64_t softmax_workspace_bytes(const SoftmaxArgs& a, SoftmaxAlgo algo, bool backward) {
  if (a.outer * a.N * a.inner == 0) return 0;
  const Plan p = make_plan(a, algo, backward);
  if (p.kind != Kind::Split) return 0;
  const int64_t acc = a.dtype == DType::Float64 ? 8 : 4;
  return a.outer * p.S * acc * (backward ? 1 : 2);
}

LaunchStatus softmax_forward_cuda(const SoftmaxArgs& a, SoftmaxAlgo algo, void* workspace, cudaStream_t stream) {
  return launch(a, algo, workspace, stream, false);
}

LaunchStatus softmax_backward_cuda(const SoftmaxArgs& a, SoftmaxAlgo algo, void* workspace, cudaStream_t stream) {
  return launch(a, algo, workspace, stream, true);
}

}  // namespace gpu_puzzles
