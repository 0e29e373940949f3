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
// The forward (2- and 4-byte types) takes faster kernels where they apply:
//   rows, 128 V < N <= 512 V        : one warp per row, packed in registers, no
//                                      block barrier (row_warp_fwd_kernel);
//   rows, 2048 V < N <= 131072      : a cluster per row with a single DSMEM
//                                      exchange and 2 blocks per SM (cluster_fwd_kernel);
//   columns, 512 < N <= 4096        : a cluster per 128-byte column tile, N split
//                                      over its blocks, in registers (inner_cluster_fwd_kernel).
// Default since the staged variants (SoftmaxTuning rows=new; cols=new for the backward):
//   rows, 2048 V < N <= 65536 V, N % V == 0, aligned (forward): persistent
//                                      clusters of 2-16 blocks, each thread's slice
//                                      of the next rows in flight through cp.async
//                                      into shared memory (staged_rows_fwd_kernel);
//   columns, N > 512, inner % V == 0, aligned (forward and backward): persistent
//                                      clusters per 128-byte column tile, the next
//                                      tiles staged the same way (staged_cols_kernel).
// A refused cluster launch falls back to the older kernels.
// The teaching kernels (tree / shuffle / online) run one block per row.
// Statistics are float (double for float64); exp is the accurate expf/exp.
// Index arithmetic is 64-bit: tensors may exceed 2^31 elements.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>
#include <initializer_list>
#include <type_traits>

#include <cooperative_groups.h>

#include "common/bulk_copy.cuh"
#include "common/cp_async.cuh"
#include "common/device.cuh"
#include "common/func_attr.h"
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

// ---- fast forward kernels (Auto, forward only) ---------------------------------
// Shared pieces: exp(x - m) and stores that do not linger in L2.
//
// Half types: exp(x - m) = 2^((x - m) log2e) with MUFU.EX2; ex2.approx's own
// error (~2^-22) is far under half precision. The subtraction comes first: the
// one-FFMA form 2^(x log2e - round(m log2e)) carries the rounding of m log2e
// (up to 2% at |m| ~ 1e6) as a factor that cancels in softmax but not in
// log_softmax's log(sum) (seen on the H100 at bf16 |x| ~ 1e6). float / double
// keep the accurate expf / exp (the fp32 tests hold softmax to 5e-6 relative).
constexpr float kLog2e = 1.4426950408889634f;
__device__ __forceinline__ float ex2_approx(float v) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
  return r;
}
template <typename T, bool HALF = (sizeof(T) == 2)> struct ExpShift {
  using A = acc_t<T>;
  A m;
  __device__ __forceinline__ explicit ExpShift(A m_) : m(m_) {}
  __device__ __forceinline__ A operator()(A x) const { return exp_a(x - m); }
};
template <typename T> struct ExpShift<T, true> {
  float m;  // m = -inf (an all -inf row) gives NaN, as torch does
  __device__ __forceinline__ explicit ExpShift(float m_) : m(m_) {}
  __device__ __forceinline__ float operator()(float x) const { return ex2_approx((x - m) * kLog2e); }
};

// Raw 16-byte chunks (the row kept packed in registers: 8 KB of bf16 is 64
// registers per lane of a warp, not 128). Out of range elements read as -inf.
template <typename T, int V>
__device__ __forceinline__ void load_raw(Vec<T, V>& r, const T* __restrict__ p, int64_t i0, int64_t N, bool vec) {
  if (vec) {
    if (i0 < N) {
      load_vec(r, p + i0);
    } else {
#pragma unroll
      for (int k = 0; k < V; ++k) r.e[k] = from_acc<T>(neg_inf<acc_t<T>>());
    }
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) r.e[k] = i0 + k < N ? p[i0 + k] : from_acc<T>(neg_inf<acc_t<T>>());
  }
}

// Half types: make the packed words opaque between passes, so the compiler
// converts them again instead of keeping every converted float live (which
// doubles the registers and spills). Costs no instruction.
template <typename T, int V> __device__ __forceinline__ void pin(Vec<T, V>& r) {
  if constexpr (sizeof(T) == 2) {
#pragma unroll
    for (int i = 0; i < Vec<T, V>::kWords; ++i) asm volatile("" : "+r"(r.w[i]));
  }
}

// Streaming 16-byte store (st.global.cs): the output is not read again here.
template <typename T, int V>
__device__ __forceinline__ void store_raw(T* __restrict__ p, const Vec<T, V>& r, int64_t i0, int64_t N, bool vec) {
  if (vec) {
    if (i0 < N) __stcs(reinterpret_cast<uint4*>(p + i0), r.q[0]);
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k)
      if (i0 + k < N) p[i0 + k] = r.e[k];
  }
}

// Merge running pair (m2, s2) into (m, s), where s = sum of exp(x - m). A pair
// with s == 0 is empty (all its x are -inf, or padding): its m takes no part,
// so an empty part can never drag the shift away from the real maximum. NaN
// sums are not empty and poison the result, as in torch. Commutative (a
// butterfly gives every lane the same bits).
template <typename A> __device__ __forceinline__ void pair_merge(A& m, A& s, A m2, A s2) {
  if (s2 == A(0)) return;
  if (s == A(0)) { m = m2; s = s2; return; }
  const A mn = max_a(m, m2);
  s = s * exp_a(m - mn) + s2 * exp_a(m2 - mn);
  m = mn;
}

// ---- rows of 128 V < N <= 512 V (8 KB), 2- and 4-byte types: a warp per row ----
// Lane l holds chunks c = 0..CH-1 at (c * 32 + l) * V as raw 32-bit words (8 KB
// of bf16 is 64 registers per lane, not 128 floats): each warp load is a
// contiguous 512 bytes and all CH loads are in flight before the first use. No
// block barrier (the block path syncs 6 times per row): warps retire rows on
// their own, 4 per block. ptxas holds the converted floats too (~157 registers
// for 8 KB rows of bf16, no spill): 3 blocks, 12 rows, 96 KB of loads in flight
// per SM (the block path had 5 rows).
constexpr int kRowWarpThreads = 128;

// Element k (compile-time) of a chunk of 4 words, as float; bf16 and fp16 take
// two per word (element 2i in the low half), float one.
template <typename T> __device__ __forceinline__ float word_elem(const uint32_t (&w)[4], int k) {
  if constexpr (sizeof(T) == 4) {
    return __uint_as_float(w[k]);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __uint_as_float(k & 1 ? w[k >> 1] & 0xffff0000u : w[k >> 1] << 16);
  } else {
    const uint32_t h = k & 1 ? w[k >> 1] >> 16 : w[k >> 1] & 0xffffu;
    return __half2float(__ushort_as_half(static_cast<unsigned short>(h)));
  }
}
template <typename T> __device__ __forceinline__ uint32_t bits_of(float v) {
  if constexpr (sizeof(T) == 4) return __float_as_uint(v);
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  else return __half_as_ushort(__float2half_rn(v));
}
template <typename T> __device__ __forceinline__ void set_word_elem(uint32_t (&w)[4], int k, float v) {
  if constexpr (sizeof(T) == 4) {
    w[k] = __float_as_uint(v);
  } else if (k & 1) {
    w[k >> 1] = (w[k >> 1] & 0xffffu) | (bits_of<T>(v) << 16);
  } else {
    w[k >> 1] = (w[k >> 1] & 0xffff0000u) | bits_of<T>(v);
  }
}

template <typename T, int CH, bool LOG>
__global__ void __launch_bounds__(kRowWarpThreads, 3)
row_warp_fwd_kernel(const T* __restrict__ a, T* __restrict__ out, int64_t rows, int64_t N, bool vec) {
  static_assert(sizeof(T) == 2 || sizeof(T) == 4, "2- and 4-byte types");
  constexpr int V = 16 / sizeof(T);
  const int lane = threadIdx.x & 31;
  constexpr int kWarps = kRowWarpThreads / 32;
  const uint32_t ninf = bits_of<T>(-INFINITY) * (sizeof(T) == 2 ? 0x10001u : 1u);  // -inf in every slot
  const int64_t step = int64_t(gridDim.x) * kWarps;
  for (int64_t row = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5); row < rows; row += step) {  // warp-uniform
    const T* ar = a + row * N + lane * V;
    T* outr = out + row * N + lane * V;
    const int64_t rem = N - int64_t(lane) * V;  // elements from this lane's first
    uint32_t r[CH][4];
#pragma unroll
    for (int c = 0; c < CH; ++c) {
      const int i0 = c * 32 * V;  // < 8 KB / 2: int is enough
      if (vec) {
        if (i0 < rem) {
          const uint4 q = __ldg(reinterpret_cast<const uint4*>(ar + i0));
          r[c][0] = q.x; r[c][1] = q.y; r[c][2] = q.z; r[c][3] = q.w;
        } else {
#pragma unroll
          for (int i = 0; i < 4; ++i) r[c][i] = ninf;
        }
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) r[c][i] = ninf;
#pragma unroll
        for (int k = 0; k < V; ++k)
          if (i0 + k < rem) set_word_elem<T>(r[c], k, to_acc<float>(ar[i0 + k]));
      }
    }
    float m = -INFINITY;
#pragma unroll
    for (int c = 0; c < CH; ++c)
#pragma unroll
      for (int k = 0; k < V; ++k) m = fmaxf(m, word_elem<T>(r[c], k));
    m = warp_max(m);
    const ExpShift<T> ex(m);
    float s = 0.f;
#pragma unroll
    for (int c = 0; c < CH; ++c) {
#pragma unroll
      for (int k = 0; k < V; ++k) s += ex(word_elem<T>(r[c], k));  // padding: exp(-inf) = 0
    }
    s = warp_sum(s);
    const float ls = LOG ? logf(s) : 0.f;
    const float inv = 1.f / s;
#pragma unroll
    for (int c = 0; c < CH; ++c) {
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float x = word_elem<T>(r[c], k);
        set_word_elem<T>(r[c], k, LOG ? (x - m) - ls : ex(x) * inv);
      }
      const int i0 = c * 32 * V;
      if (vec) {
        if (i0 < rem) __stcs(reinterpret_cast<uint4*>(outr + i0), make_uint4(r[c][0], r[c][1], r[c][2], r[c][3]));
      } else {
#pragma unroll
        for (int k = 0; k < V; ++k)
          if (i0 + k < rem) outr[i0 + k] = from_acc<T>(word_elem<T>(r[c], k));
      }
    }
  }
}

// ---- long rows, forward, on Hopper: a cluster per row, one cluster barrier -----
// CS blocks (2..8) of up to 512 threads share a row; thread t of the cluster
// holds CH chunks of V (32 elements) at (c * G + t) * V in registers. Each warp
// reduces its values to a pair (shift, sum of exp(x - shift)) with its own
// maximum as the shift, the block merges its warps' pairs, and the blocks swap
// pairs through distributed shared memory once (one cluster barrier per row,
// not two). 512 threads at <= 64 registers give 2 blocks per SM: one block's
// loads overlap the other's barrier. Softmax keeps e = exp(x - shift) and
// scales it by exp(shift - M) / S; log_softmax keeps x.
constexpr int kClusterFwdThreads = 512;
constexpr int kClusterFwdElems = 32;  // elements per thread

template <typename T, bool LOG>
__global__ void __launch_bounds__(kClusterFwdThreads, 2)
cluster_fwd_kernel(const T* __restrict__ a, T* __restrict__ out, int64_t rows, int64_t N, bool vec) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using A = acc_t<T>;
  constexpr int V = 16 / sizeof(T);
  constexpr int CH = kClusterFwdElems / V;
  __shared__ A wred[kClusterFwdThreads / 32][2];
  __shared__ A part[2][2];  // [row parity][shift, sum]: a slower block may still read the last row's
  cg::cluster_group cluster = cg::this_cluster();
  const int CS = int(cluster.num_blocks());
  const int G = int(blockDim.x) * CS;
  const int t = int(cluster.block_rank()) * int(blockDim.x) + int(threadIdx.x);
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int64_t step = gridDim.x / CS;
  int parity = 0;
  for (int64_t row = blockIdx.x / CS; row < rows; row += step, parity ^= 1) {  // cluster-uniform
    // Rebased on this thread's first element: 32-bit chunk offsets (c G V <= N <=
    // 131072), fewer live 64-bit addresses.
    const T* ar = a + row * N + int64_t(t) * V;
    T* outr = out + row * N + int64_t(t) * V;
    const int64_t rem = N - int64_t(t) * V;
    A v[CH][V];
#pragma unroll
    for (int c = 0; c < CH; ++c) load_chunk<T, V>(v[c], ar, int64_t(c * G * V), rem, vec, neg_inf<A>());
    A mw = neg_inf<A>();
#pragma unroll
    for (int c = 0; c < CH; ++c)
#pragma unroll
      for (int k = 0; k < V; ++k) mw = max_a(mw, v[c][k]);
    mw = warp_max(mw);
    // A warp of only -inf (or padding) shifts by 0: exp(-inf) = 0, sum 0 (empty),
    // while a NaN among them still makes the sum NaN.
    const A shift = mw == neg_inf<A>() ? A(0) : mw;
    const ExpShift<T> ex(shift);
    A s = A(0);
#pragma unroll
    for (int c = 0; c < CH; ++c)
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const A e = ex(v[c][k]);
        s += e;
        if (!LOG) v[c][k] = e;
      }
    s = warp_sum(s);
    if (lane == 0) { wred[w][0] = shift; wred[w][1] = s; }
    __syncthreads();
    if (w == 0) {
      A bm = lane < nw ? wred[lane][0] : A(0), bs = lane < nw ? wred[lane][1] : A(0);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const A m2 = __shfl_xor_sync(0xffffffffu, bm, o), s2 = __shfl_xor_sync(0xffffffffu, bs, o);
        pair_merge(bm, bs, m2, s2);
      }
      if (lane == 0) { part[parity][0] = bm; part[parity][1] = bs; }
    }
    // Release/acquire across the cluster: every block's pair is visible after it;
    // also orders this row's wred reads before the next row's wred writes.
    cluster.sync();
    A M = A(0), S = A(0);
    for (int r = 0; r < CS; ++r) {  // rank order: identical bits in every block
      const A* p = cluster.map_shared_rank(&part[parity][0], r);
      pair_merge(M, S, p[0], p[1]);
    }
    // S == 0 only for a row of all -inf: NaN there, as torch.
    const A nan = A(NAN);
    if (LOG) {
      const A ls = S == A(0) ? nan : log_a(S);
#pragma unroll
      for (int c = 0; c < CH; ++c)
#pragma unroll
        for (int k = 0; k < V; ++k) v[c][k] = (v[c][k] - M) - ls;
    } else {
      // An empty warp (s == 0, shift 0) writes 0: exp(0 - M) would overflow for
      // a very negative M and make 0 * inf = NaN.
      const A scale = S == A(0) ? nan : (s == A(0) ? A(0) : exp_a(shift - M) / S);
#pragma unroll
      for (int c = 0; c < CH; ++c)
#pragma unroll
        for (int k = 0; k < V; ++k) v[c][k] *= scale;
    }
#pragma unroll
    for (int c = 0; c < CH; ++c) store_chunk<T, V>(outr, v[c], int64_t(c * G * V), rem, vec);
  }
  cluster.sync();  // no block exits while another may still read its `part`
#endif
}

// ---- a non-last dim, forward, on Hopper: a cluster per column tile -------------
// Tile = 8 16-byte vectors across inner (128 bytes of each of the N rows: whole
// cache lines) of one outer index. The cluster's CS blocks split N: block r
// holds rows [r NB, r NB + NB) of the tile, NB <= 32 * 16, in registers (thread
// (tx, ty) holds rows ty, ty + 32, ... of vector tx, 16 loads in flight). Per
// column (shift, sum) pairs are merged over the 4 lanes sharing tx (shuffles),
// the block's 8 warps (shared memory) and the cluster's blocks (distributed
// shared memory, one cluster barrier). x is read once and written once.
constexpr int kIcTx = 8, kIcTy = 32, kIcRows = 16;
constexpr int kIcThreads = kIcTx * kIcTy;  // 256
constexpr int kIcMaxCols = kIcTx * 8;      // columns of a tile, bf16 / fp16 (fp32: 32)

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
    // Lanes tx, tx + 8, tx + 16, tx + 24 share the columns.
#pragma unroll
    for (int k = 0; k < V; ++k)
#pragma unroll
      for (int of = kIcTx; of < 32; of <<= 1) {
        const A m2 = __shfl_xor_sync(0xffffffffu, sh[k], of), s2 = __shfl_xor_sync(0xffffffffu, s[k], of);
        pair_merge(sh[k], s[k], m2, s2);
      }
    if (lane < kIcTx) {
#pragma unroll
      for (int k = 0; k < V; ++k) { red[w][tx * V + k][0] = sh[k]; red[w][tx * V + k][1] = s[k]; }
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
      A M = A(0), S = A(0);
      for (int rk = 0; rk < CS; ++rk) {  // rank order: identical bits in every block
        const A* p = cluster.map_shared_rank(&part[parity][threadIdx.x][0], rk);
        pair_merge(M, S, p[0], p[1]);
      }
      fin[threadIdx.x][0] = M;
      fin[threadIdx.x][1] = S;
    }
    __syncthreads();
    A M[V], mul[V];
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const A Mk = fin[tx * V + k][0], Sk = fin[tx * V + k][1];
      // S == 0 only for a column of all -inf: NaN there, as torch. Log: (x - M) - log S.
      M[k] = Mk;
      mul[k] = Sk == A(0) ? A(NAN) : (LOG ? log_a(Sk) : A(1) / Sk);
    }
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

// ---- long rows, forward, on Hopper: staged, persistent clusters (rows=new) -----
// Why the register cluster kernel above tops out near 2/3 of HBM speed: each
// block lives for one row slice only (load, reduce, cluster barrier, store,
// exit), so an SM's loads stop while its blocks reduce, wait at the barrier,
// store and are replaced, and a new cluster of 8 needs 8 free slots in one GPC
// at once. Here a grid of exactly the resident clusters loops over rows, and
// each thread keeps the next `stages` rows of its slice in flight with cp.async
// into shared memory: x is read once, the copies for later rows overlap this
// row's reductions, barrier and stores. Thread t of the cluster owns vectors
// (c G + t) V, c < K (each warp access a contiguous 512 bytes), staged at its
// own shared-memory slots: only the thread that copied a slot reads it, after
// its own cp.async.wait_group, and refills it only after a block barrier that
// follows its use (no cross-thread hazard). Statistics as cluster_fwd_kernel:
// per-warp (shift, sum) pairs, one DSMEM exchange per row.
constexpr int kSrThreads = 512;

template <typename T, bool LOG, int K>
__global__ void __launch_bounds__(kSrThreads, K <= 4 ? 2 : 1)
staged_rows_fwd_kernel(const T* __restrict__ a, T* __restrict__ out, int64_t rows, int64_t N, int stages) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using A = acc_t<T>;
  constexpr int V = 16 / sizeof(T);
  extern __shared__ __align__(16) unsigned char sr_raw[];
  uint4* buf = reinterpret_cast<uint4*>(sr_raw);
  __shared__ A wred[kSrThreads / 32][2];
  __shared__ A part[2][2];  // [row parity][shift, sum]
  cg::cluster_group cluster = cg::this_cluster();
  const int CS = int(cluster.num_blocks());
  const int BT = int(blockDim.x), tid = int(threadIdx.x);
  const int64_t G = int64_t(BT) * CS;
  const int64_t t = int64_t(cluster.block_rank()) * BT + tid;
  const int lane = tid & 31, w = tid >> 5, nw = BT >> 5;
  const int64_t step = gridDim.x / CS;
  const int64_t first = blockIdx.x / CS;
  const int64_t rem = N - t * V;  // elements of a row from this thread's first
  auto issue = [&](int64_t row, int st) {
    if (row < rows) {
      const T* ar = a + row * N + t * V;
#pragma unroll
      for (int c = 0; c < K; ++c)
        if (int64_t(c) * G * V < rem) cp_async16(&buf[(st * K + c) * BT + tid], ar + int64_t(c) * G * V);
    }
    cp_async_commit();  // empty groups too: every thread counts the same groups
  };
  for (int st = 0; st < stages; ++st) issue(first + int64_t(st) * step, st);
  int parity = 0, st = 0;
  for (int64_t row = first; row < rows; row += step, parity ^= 1) {  // cluster-uniform
    // `stages` groups are pending (this row's is the oldest): wait for the oldest.
    if (stages >= 3) cp_async_wait<2>();
    else cp_async_wait<1>();
    A v[K][V];
#pragma unroll
    for (int c = 0; c < K; ++c) {
      if (int64_t(c) * G * V < rem) {
        Vec<T, V> r;
        r.q[0] = buf[(st * K + c) * BT + tid];
#pragma unroll
        for (int k = 0; k < V; ++k) v[c][k] = to_acc<A>(r.e[k]);
      } else {
#pragma unroll
        for (int k = 0; k < V; ++k) v[c][k] = neg_inf<A>();
      }
    }
    A mw = neg_inf<A>();
#pragma unroll
    for (int c = 0; c < K; ++c)
#pragma unroll
      for (int k = 0; k < V; ++k) mw = max_a(mw, v[c][k]);
    mw = warp_max(mw);
    const A shift = mw == neg_inf<A>() ? A(0) : mw;  // an empty warp: see cluster_fwd_kernel
    const ExpShift<T> ex(shift);
    A s = A(0);
#pragma unroll
    for (int c = 0; c < K; ++c)
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const A e = ex(v[c][k]);
        s += e;
        if (!LOG) v[c][k] = e;
      }
    s = warp_sum(s);
    if (lane == 0) { wred[w][0] = shift; wred[w][1] = s; }
    __syncthreads();
    // This thread's slots of stage `st` are in registers and used: refill them
    // with the row `stages` steps on.
    issue(row + int64_t(stages) * step, st);
    st = st + 1 == stages ? 0 : st + 1;
    if (w == 0) {
      A bm = lane < nw ? wred[lane][0] : A(0), bs = lane < nw ? wred[lane][1] : A(0);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const A m2 = __shfl_xor_sync(0xffffffffu, bm, o), s2 = __shfl_xor_sync(0xffffffffu, bs, o);
        pair_merge(bm, bs, m2, s2);
      }
      if (lane == 0) { part[parity][0] = bm; part[parity][1] = bs; }
    }
    cluster.sync();  // every block's pair visible; this row's wred reads done
    A M = A(0), S = A(0);
    for (int r = 0; r < CS; ++r) {  // rank order: identical bits in every block
      const A* p = cluster.map_shared_rank(&part[parity][0], r);
      pair_merge(M, S, p[0], p[1]);
    }
    const A nan = A(NAN);
    T* outr = out + row * N + t * V;
    if (LOG) {
      const A ls = S == A(0) ? nan : log_a(S);
#pragma unroll
      for (int c = 0; c < K; ++c)
#pragma unroll
        for (int k = 0; k < V; ++k) v[c][k] = (v[c][k] - M) - ls;
    } else {
      const A scale = S == A(0) ? nan : (s == A(0) ? A(0) : exp_a(shift - M) / S);
#pragma unroll
      for (int c = 0; c < K; ++c)
#pragma unroll
        for (int k = 0; k < V; ++k) v[c][k] *= scale;
    }
#pragma unroll
    for (int c = 0; c < K; ++c) {
      if (int64_t(c) * G * V < rem) {
        Vec<T, V> y;
#pragma unroll
        for (int k = 0; k < V; ++k) y.e[k] = from_acc<T>(v[c][k]);
        __stcs(reinterpret_cast<uint4*>(outr + int64_t(c) * G * V), y.q[0]);
      }
    }
  }
  cp_async_wait<0>();  // only empty groups can remain; leave none behind
  cluster.sync();      // no block exits while another may still read its `part`
#endif
}

// ---- long rows, forward, on Hopper: the row slice in shared memory (rows=smem|bulk)
// Why another one: the staged kernel above keeps its slice in registers (112 per
// thread), so one 512-thread block fills an SM, and a cluster of 8 then needs 8
// whole SMs of one GPC: the H100 holds 15 such clusters, 120 of its 132 SMs (ncu).
// Here the block's slice of the row (SV 16-byte vectors, SV 16 bytes of dynamic
// shared memory, 64 KB for fp32 131072 over 8 blocks) is the only copy; threads
// read it three times (max, sum, write) at shared-memory speed, need few
// registers, and several blocks share an SM: one block's loads overlap another's
// reductions and stores, and a cluster may spread over fewer SMs. BULK: thread 0
// copies the slice with one bulk copy (TMA) completing on an mbarrier; else each
// thread cp.asyncs its own vectors and reads back only those (no barrier needed
// for them). Statistics as staged_rows_fwd_kernel: per-warp (shift, sum) pairs,
// one DSMEM exchange per row. A grid of up to kMaxGrid blocks strides over rows.
constexpr int kSmThreads = 256;

template <typename T, bool LOG, bool BULK>
__global__ void __launch_bounds__(kSmThreads)
smem_rows_fwd_kernel(const T* __restrict__ a, T* __restrict__ out, int64_t rows, int64_t N, int64_t SV) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using A = acc_t<T>;
  constexpr int V = 16 / sizeof(T);
  extern __shared__ __align__(128) unsigned char sm_raw[];
  uint4* buf = reinterpret_cast<uint4*>(sm_raw);
  __shared__ A wred[kSmThreads / 32][2];
  __shared__ A part[2][2];  // [row parity][shift, sum]
  __shared__ uint64_t bar;
  cg::cluster_group cluster = cg::this_cluster();
  const int CS = int(cluster.num_blocks());
  const int tid = int(threadIdx.x), lane = tid & 31, w = tid >> 5;
  const int64_t v0 = int64_t(cluster.block_rank()) * SV;
  const int64_t cnt = max(int64_t(0), min(SV, N / V - v0));  // vectors of this block's slice
  const int64_t step = gridDim.x / CS, first = blockIdx.x / CS;
  if (BULK && tid == 0) mbar_init(&bar);
  __syncthreads();
  unsigned phase = 0;
  int parity = 0;
  for (int64_t row = first; row < rows; row += step, parity ^= 1) {  // cluster-uniform
    const T* src = a + row * N + v0 * V;
    if constexpr (BULK) {
      if (cnt > 0) {
        if (tid == 0) {
          mbar_arrive_expect(&bar, unsigned(cnt * 16));
          bulk_load(buf, src, unsigned(cnt * 16), &bar);
        }
        mbar_wait(&bar, phase);
        phase ^= 1u;
      }
    } else {
      for (int64_t j = tid; j < cnt; j += kSmThreads) cp_async16(&buf[j], src + j * V);
      cp_async_commit();
      cp_async_wait<0>();
    }
    A m = neg_inf<A>();
#pragma unroll 4
    for (int64_t j = tid; j < cnt; j += kSmThreads) {
      Vec<T, V> r;
      r.q[0] = buf[j];
#pragma unroll
      for (int k = 0; k < V; ++k) m = max_a(m, to_acc<A>(r.e[k]));
    }
    m = warp_max(m);
    const A shift = m == neg_inf<A>() ? A(0) : m;  // an empty warp: see cluster_fwd_kernel
    const ExpShift<T> ex(shift);
    A s = A(0);
#pragma unroll 4
    for (int64_t j = tid; j < cnt; j += kSmThreads) {
      Vec<T, V> r;
      r.q[0] = buf[j];
#pragma unroll
      for (int k = 0; k < V; ++k) s += ex(to_acc<A>(r.e[k]));
    }
    s = warp_sum(s);
    if (lane == 0) { wred[w][0] = shift; wred[w][1] = s; }
    __syncthreads();
    if (w == 0) {
      A bm = lane < kSmThreads / 32 ? wred[lane][0] : A(0), bs = lane < kSmThreads / 32 ? wred[lane][1] : A(0);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const A m2 = __shfl_xor_sync(0xffffffffu, bm, o), s2 = __shfl_xor_sync(0xffffffffu, bs, o);
        pair_merge(bm, bs, m2, s2);
      }
      if (lane == 0) { part[parity][0] = bm; part[parity][1] = bs; }
    }
    cluster.sync();  // every block's pair visible; this row's wred reads done
    A M = A(0), S = A(0);
    for (int r = 0; r < CS; ++r) {  // rank order: identical bits in every block
      const A* p = cluster.map_shared_rank(&part[parity][0], r);
      pair_merge(M, S, p[0], p[1]);
    }
    const A nan = A(NAN);
    const A mul = S == A(0) ? nan : (LOG ? log_a(S) : A(1) / S);  // an all -inf row: NaN, as torch
    const ExpShift<T> exm(M);
    T* dst = out + row * N + v0 * V;
#pragma unroll 4
    for (int64_t j = tid; j < cnt; j += kSmThreads) {
      Vec<T, V> r, y;
      r.q[0] = buf[j];
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const A x = to_acc<A>(r.e[k]);
        y.e[k] = from_acc<T>(LOG ? (x - M) - mul : exm(x) * mul);
      }
      __stcs(reinterpret_cast<uint4*>(dst + j * V), y.q[0]);
    }
    // The next row's copy overwrites the slice (BULK: every thread's part of it).
    if (BULK) __syncthreads();
  }
  cluster.sync();  // no block exits while another may still read its `part`
#endif
}

// ---- a non-last dim, on Hopper: staged column tiles, persistent (cols=new) ---
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
constexpr int kScTx = 8, kScTy = 32;
constexpr int kScThreads = kScTx * kScTy;  // 256

template <typename T> __device__ __forceinline__ acc_t<T> exp_shift(acc_t<T> x, acc_t<T> sh) {
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
    if (stages >= 3) cp_async_wait<2>();
    else if (stages == 2) cp_async_wait<1>();
    else cp_async_wait<0>();
    const int64_t o = tile / tiles, col = (tile % tiles) * TW + int64_t(tx) * V;
    const bool active = col < inner;
    const int my = active ? cnt : 0;
    A sh[V], s[V];
#pragma unroll
    for (int k = 0; k < V; ++k) { sh[k] = A(0); s[k] = A(0); }
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
      // Lanes tx, tx + 8, tx + 16, tx + 24 share the columns.
#pragma unroll
      for (int k = 0; k < V; ++k)
#pragma unroll
        for (int of = kScTx; of < 32; of <<= 1) {
          const A m2 = __shfl_xor_sync(0xffffffffu, sh[k], of), s2 = __shfl_xor_sync(0xffffffffu, s[k], of);
          pair_merge(sh[k], s[k], m2, s2);
        }
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
      for (int k = 0; k < V; ++k) { red[w][tx * V + k][0] = sh[k]; red[w][tx * V + k][1] = s[k]; }
    }
    __syncthreads();
    if (tid < TW) {
      A bm = A(0), bs = A(0);
      for (int ww = 0; ww < kScThreads / 32; ++ww) {
        if constexpr (BWD) bs += red[ww][tid][1];
        else pair_merge(bm, bs, red[ww][tid][0], red[ww][tid][1]);
      }
      part[parity][tid][0] = bm;
      part[parity][tid][1] = bs;
    }
    cluster.sync();  // every block's pairs visible (release/acquire); red reads done
    if (tid < TW) {
      A M = A(0), S = A(0);
      for (int rk = 0; rk < CS; ++rk) {  // rank order: identical bits in every block
        const A* p = cluster.map_shared_rank(&part[parity][tid][0], rk);
        if constexpr (BWD) S += p[1];
        else pair_merge(M, S, p[0], p[1]);
      }
      fin[tid][0] = M;
      fin[tid][1] = S;
    }
    __syncthreads();
    A M[V], mul[V];
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const A Mk = fin[tx * V + k][0], Sk = fin[tx * V + k][1];
      M[k] = Mk;
      if constexpr (BWD) mul[k] = Sk;
      else mul[k] = Sk == A(0) ? A(NAN) : (LOG ? log_a(Sk) : A(1) / Sk);  // all -inf column: NaN, as torch
    }
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

enum class Kind { WarpRows, RowWarp, BlockRows, ClusterRows, ClusterFwd, StagedRows, SmemRows, Split, Inner,
                  InnerCluster, StagedCols, Looped };

struct Plan {
  Kind kind;
  int ch = 1;        // chunks per thread (register paths)
  int lanes = 32;    // lanes per row (WarpRows)
  int threads = 0;   // block size (BlockRows, ClusterRows), TC (Inner)
  int64_t S = 1;     // chunks per row (Split), blocks per cluster (ClusterRows, ClusterFwd, InnerCluster)
  bool cache = false;
  int64_t smem = 0;  // dynamic shared memory bytes (Inner, StagedRows, StagedCols)
  int stages = 2;    // StagedRows, StagedCols: copies in flight per thread, in rows / tiles;
                     // 1: one at a time, several blocks per SM (grid: see `grid`)
  int64_t sv = 0;    // SmemRows: 16-byte vectors of a block's slice of the row
  bool bulk = false; // SmemRows: the slice arrives by one bulk copy (TMA), not per-thread cp.async
  int grid = 1;      // StagedCols with 1 stage, SmemRows: clusters launched per resident cluster
  // InnerCluster keeps threads / cache / smem of the Inner plan: its fallback
  // when the cluster launch is refused.
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

// The forward cluster kernels: sm_90 code present, and the GPU can hold at least
// one cluster of the largest size at the kernel's block size (asked once per
// device and kernel; the answer does not change).
template <typename K> bool cluster_fwd_ok(K kernel, int threads) {
  static std::atomic<int> known[64];  // 0 unknown, 1 yes, 2 no
  int dev = 0, major = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) { cudaGetLastError(); return false; }
  const int k = known[dev].load(std::memory_order_relaxed);
  if (k) return k == 1;
  bool ok = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess && major >= 9;
  cudaFuncAttributes fa{};
  ok = ok && cudaFuncGetAttributes(&fa, kernel) == cudaSuccess && fa.ptxVersion >= 90;
  if (ok) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(kClusterMax);
    cfg.blockDim = dim3(unsigned(threads));
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = kClusterMax;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    int clusters = 0;
    ok = cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) == cudaSuccess && clusters > 0;
  }
  cudaGetLastError();  // a refused query leaves no error behind
  known[dev].store(ok ? 1 : 2, std::memory_order_relaxed);
  return ok;
}

// ---- the staged kernels' launch limits ------------------------------------------
// Dynamic shared memory a staged block may take (227 KB per block on sm_90, less
// the kernels' static arrays, under 6 KB).
constexpr int64_t kStagedSmemMax = 220 * 1024;

template <typename T, int K> auto staged_rows_kernel_for(bool log) {
  return log ? staged_rows_fwd_kernel<T, true, K> : staged_rows_fwd_kernel<T, false, K>;
}
template <typename T> auto smem_rows_kernel_for(bool log, bool bulk) {
  return log ? (bulk ? smem_rows_fwd_kernel<T, true, true> : smem_rows_fwd_kernel<T, true, false>)
             : (bulk ? smem_rows_fwd_kernel<T, false, true> : smem_rows_fwd_kernel<T, false, false>);
}
template <typename T, bool BWD> auto staged_cols_kernel_for(bool log) {
  return log ? staged_cols_kernel<T, BWD, true> : staged_cols_kernel<T, BWD, false>;
}

// Clusters of `cs` blocks of the kernel that the GPU holds at once (0: none, or
// no sm_90 code), asked once per device, kernel and configuration. Allows the
// non-portable cluster size 16 and the dynamic shared memory first.
template <typename Kern> int resident_clusters(Kern kernel, int threads, int cs, int64_t smem) {
  // Kernel attributes are per device and per function, so each (device, kernel)
  // keeps the largest dynamic shared memory asked of it so far (a smaller plan
  // never lowers it under a larger one); after the first call per plan this is a
  // lookup, no cudaFuncSetAttribute per launch.
  struct Key { int dev; const void* fn; int threads, cs; int64_t smem; int n; };
  struct Attr { int dev; const void* fn; int64_t smem; };
  static std::mutex mu;
  static std::vector<Key> known;
  static std::vector<Attr> attrs;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) { cudaGetLastError(); return 0; }
  const void* fn = reinterpret_cast<const void*>(kernel);
  std::lock_guard<std::mutex> lock(mu);
  for (const Key& k : known)
    if (k.dev == dev && k.fn == fn && k.threads == threads && k.cs == cs && k.smem == smem) return k.n;
  Attr* at = nullptr;
  for (Attr& x : attrs)
    if (x.dev == dev && x.fn == fn) at = &x;
  int n = 0, major = 0;
  cudaFuncAttributes fa{};
  bool ok = smem <= kStagedSmemMax && cs <= 16 &&
            cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess && major >= 9 &&
            cudaFuncGetAttributes(&fa, kernel) == cudaSuccess && fa.ptxVersion >= 90;
  if (ok && (at == nullptr || at->smem < smem)) {
    ok = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)) == cudaSuccess &&
         cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) == cudaSuccess;
    if (ok) {
      if (at == nullptr) attrs.push_back(Attr{dev, fn, smem});
      else at->smem = smem;
    }
  }
  if (ok) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(unsigned(cs));
    cfg.blockDim = dim3(unsigned(threads));
    cfg.dynamicSmemBytes = size_t(smem);
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = unsigned(cs);
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    if (cudaOccupancyMaxActiveClusters(&n, kernel, &cfg) != cudaSuccess) n = 0;
  }
  cudaGetLastError();  // a refused query leaves no error behind
  known.push_back(Key{dev, fn, threads, cs, smem, n});
  return n;
}

template <typename Kern, typename... Args>
cudaError_t launch_staged(Kern kernel, const Plan& p, int64_t items, cudaStream_t st, Args... args) {
  // A positive count means resident_clusters has set the kernel's attributes
  // (shared memory >= p.smem, cluster size 16 allowed) on this device.
  const int n = resident_clusters(kernel, p.threads, int(p.S), p.smem);
  if (n <= 0) return cudaErrorInvalidConfiguration;
  cudaLaunchConfig_t cfg{};
  // stages > 1: persistent (the resident clusters loop over the items); 1: p.grid
  // times the resident clusters (4: blocks come and go at different phases,
  // several per SM; 1: all resident at once, each looping over its share).
  const int64_t clusters = std::min<int64_t>(items, p.stages > 1 ? n : int64_t(p.grid) * n);
  cfg.gridDim = dim3(unsigned(clusters * p.S));
  cfg.blockDim = dim3(unsigned(p.threads));
  cfg.dynamicSmemBytes = size_t(p.smem);
  cfg.stream = st;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = unsigned(p.S);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, args...);
}

// Staged plans: fill p and say whether the GPU runs it (else the older kernels).
bool plan_staged_rows(const SoftmaxArgs& a, const SoftmaxTuning& tu, Plan& p) {
  const int V = 16 / esize(a.dtype);
  const int64_t N = a.N;
  int K = 8;
  int64_t cs = std::max<int64_t>(2, pow2ceil(cdiv(N, int64_t(kSrThreads) * 8 * V)));
  if (tu.cluster > cs) {  // a larger cluster with half the registers per thread (2 blocks per SM)
    const int64_t cs4 = std::min<int64_t>(tu.cluster, std::max<int64_t>(2, pow2ceil(cdiv(N, int64_t(kSrThreads) * 4 * V))));
    if (cs4 > cs) { cs = cs4; K = 4; }
  }
  if (cs > 16) return false;
  p.kind = Kind::StagedRows;
  p.S = cs;
  p.ch = K;
  p.threads = int(std::max<int64_t>(128, pow2ceil(cdiv(N, cs * K * V))));
  if (p.threads > kSrThreads) return false;  // cs K V 512 >= N by the choice above; kept as a guard
  p.stages = std::max(2, tu.stages);  // the register slices need a copy in flight behind them
  while (p.stages > 2 && int64_t(p.stages) * K * p.threads * 16 > kStagedSmemMax) --p.stages;
  p.smem = int64_t(p.stages) * K * p.threads * 16;
  if (p.smem > kStagedSmemMax) return false;
  return dispatch_dtype(a.dtype, [&](auto tag) -> bool {
    using T = decltype(tag);
    if constexpr (sizeof(T) > 4) {
      return false;
    } else {
      return K == 8 ? resident_clusters(staged_rows_kernel_for<T, 8>(a.log), p.threads, int(cs), p.smem) > 0
                    : resident_clusters(staged_rows_kernel_for<T, 4>(a.log), p.threads, int(cs), p.smem) > 0;
    }
  });
}

// The slice a block holds is 512 KB / tu.cluster (64 KB at the default 8: three
// blocks per SM), so the cluster is 8 for a 512 KB row and grows with it to 16.
bool plan_smem_rows(const SoftmaxArgs& a, const SoftmaxTuning& tu, Plan& p) {
  const int es = esize(a.dtype), V = 16 / es;
  const int64_t slice = (int64_t(512) << 10) / tu.cluster;
  const int64_t cs = std::min<int64_t>(16, std::max<int64_t>(2, pow2ceil(cdiv(a.N * es, slice))));
  p.kind = Kind::SmemRows;
  p.S = cs;
  p.sv = cdiv(a.N / V, cs);
  p.smem = p.sv * 16;
  p.threads = kSmThreads;
  p.stages = 1;
  p.bulk = tu.rows == 4;
  p.grid = tu.grid;
  if (p.smem > kStagedSmemMax) return false;
  return dispatch_dtype(a.dtype, [&](auto tag) -> bool {
    using T = decltype(tag);
    if constexpr (sizeof(T) > 4) {
      return false;
    } else {
      return resident_clusters(smem_rows_kernel_for<T>(a.log, p.bulk), p.threads, int(cs), p.smem) > 0;
    }
  });
}

bool plan_staged_cols(const SoftmaxArgs& a, const SoftmaxTuning& tu, bool bwd, Plan& p) {
  const int64_t arrays = bwd ? 2 : 1;
  const int64_t rmax = bwd ? tu.col_rows_bwd : tu.col_rows_fwd;
  // rmax is a preference: the cluster stops at 16 blocks, the rows per thread grow.
  int64_t cs = std::min<int64_t>(16, std::max<int64_t>(2, pow2ceil(cdiv(a.N, kScTy * rmax))));
  int stages = tu.stages;
  auto bytes = [&](int64_t c, int sg) { return int64_t(sg) * arrays * cdiv(cdiv(a.N, c), kScTy) * kScThreads * 16; };
  // Too big for shared memory: fewer stages, then more blocks per tile.
  while (stages > 2 && bytes(cs, stages) > kStagedSmemMax) --stages;
  while (cs < 16 && bytes(cs, stages) > kStagedSmemMax) cs *= 2;
  if (cs > 16 || bytes(cs, stages) > kStagedSmemMax) return false;
  p.kind = Kind::StagedCols;
  p.S = cs;
  p.ch = int(cdiv(cdiv(a.N, cs), kScTy));  // R, rows per thread
  p.threads = kScThreads;
  p.stages = stages;
  p.grid = tu.grid;
  p.smem = bytes(cs, stages);
  return dispatch_dtype(a.dtype, [&](auto tag) -> bool {
    using T = decltype(tag);
    if constexpr (sizeof(T) > 4) {
      return false;
    } else {
      return bwd ? resident_clusters(staged_cols_kernel_for<T, true>(a.log), p.threads, int(cs), p.smem) > 0
                 : resident_clusters(staged_cols_kernel_for<T, false>(a.log), p.threads, int(cs), p.smem) > 0;
    }
  });
}

Plan make_plan(const SoftmaxArgs& a, SoftmaxAlgo algo, bool bwd) {
  Plan p{};
  const int es = esize(a.dtype), V = 16 / es;
  if (algo != SoftmaxAlgo::Auto) { p.kind = Kind::Looped; return p; }
  const SoftmaxTuning tu = softmax_resolve_tuning(a.tune);
  if (a.inner > 1) {
    // 512 < N, whole 16-byte vectors across inner, at least half a 128-byte tile
    // used: staged column tiles (forward and backward), x / y and dy read once.
    if ((tu.cols == 2 || (tu.cols == 0 && bwd)) && es <= 4 && a.N > int64_t(kIcTy) * kIcRows && a.inner % V == 0 && a.inner * es >= 64 &&
        al16(a.a) && al16(a.out) && (!bwd || al16(a.b))) {
      Plan q{};
      if (plan_staged_cols(a, tu, bwd, q)) return q;
    }
    p.kind = Kind::Inner;
    const int64_t full = std::min<int64_t>(32 / es, pow2ceil(a.inner));
    const int64_t arrays = bwd ? 2 : 1;
    // Narrower tiles read part of a 32-byte sector each; the neighbouring tiles
    // (adjacent blocks, resident together) use the rest of it from L2.
    p.threads = int(full);
    for (int64_t tc : {full, std::max<int64_t>(1, full / 2), std::max<int64_t>(1, full / 4)}) {
      const int64_t bytes = a.N * tc * es * arrays;
      if (bytes <= kInnerCacheBytes) { p.threads = int(tc); p.cache = true; p.smem = bytes; break; }
    }
    // Forward, 512 < N <= 4096, whole 16-byte vectors across inner, at least half
    // a 128-byte tile used: a cluster of 2-8 blocks per tile holds it in registers
    // (one read of x, whole cache lines) instead of narrow tiles in shared memory.
    if (!bwd && es <= 4 && a.N > int64_t(kIcTy) * kIcRows && a.N <= int64_t(kClusterMax) * kIcTy * kIcRows &&
        a.inner % V == 0 && a.inner * es >= 64 && al16(a.a) && al16(a.out) &&
        cluster_fwd_ok(inner_cluster_fwd_kernel<float, false>, kIcThreads)) {
      p.kind = Kind::InnerCluster;
      p.S = pow2ceil(cdiv(a.N, int64_t(kIcTy) * kIcRows));
    }
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
  // Forward, rows up to 8 KB: still one warp per row, the row packed in
  // registers, no block barrier (the block path below syncs 6 times per row).
  if (!bwd && es <= 4 && N <= 32 * 16 * V) {
    p.kind = Kind::RowWarp;
    p.ch = N <= 32 * 8 * V ? 8 : 16;
    return p;
  }
  // Forward, long rows: the row slices in shared memory, several blocks per SM
  // (rows=smem, rows=bulk).
  if (!bwd && (tu.rows == 3 || tu.rows == 4) && N > 2048 * V && es <= 4 && N % V == 0 && al16(a.a) && al16(a.out)) {
    Plan q{};
    if (plan_smem_rows(a, tu, q)) return q;
  }
  // Forward, long rows: staged, persistent clusters (rows=new), x read once with
  // the next rows' copies in flight.
  if (!bwd && tu.rows == 2 && N > 2048 * V && es <= 4 && N % V == 0 && al16(a.a) && al16(a.out)) {
    Plan q{};
    if (plan_staged_rows(a, tu, q)) return q;
  }
  // Forward, long rows: a cluster per row with one cluster barrier and two
  // blocks per SM (the backward keeps the 1024-thread cluster kernel below).
  if (!bwd && N > 2048 * V && es <= 4 && N <= int64_t(kClusterMax) * kClusterFwdThreads * kClusterFwdElems &&
      cluster_fwd_ok(cluster_fwd_kernel<float, false>, kClusterFwdThreads)) {
    p.kind = Kind::ClusterFwd;
    p.S = std::max<int64_t>(2, pow2ceil(cdiv(N, int64_t(kClusterFwdThreads) * kClusterFwdElems)));
    p.threads = int(std::max<int64_t>(128, pow2ceil(cdiv(N, p.S * kClusterFwdElems))));
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

cudaLaunchAttribute cluster_attr(int64_t cs) {
  cudaLaunchAttribute at{};
  at.id = cudaLaunchAttributeClusterDimension;
  at.val.clusterDim.x = unsigned(cs);
  at.val.clusterDim.y = 1;
  at.val.clusterDim.z = 1;
  return at;
}

// The split path: also the fallback of the cluster paths when a cluster launch
// is refused (the workspace is sized for it; see softmax_workspace_bytes).
template <typename T, bool BWD>
cudaError_t launch_split(const SoftmaxArgs& a, void* workspace, cudaStream_t st, bool vec) {
  if (workspace == nullptr) return cudaErrorInvalidValue;
  const T* A_ = static_cast<const T*>(a.a);
  const T* B_ = static_cast<const T*>(a.b);
  T* O = static_cast<T*>(a.out);
  const int64_t rows = a.outer, N = a.N, S = cdiv(N, kSplitChunk);
  auto* ws = static_cast<acc_t<T>*>(workspace);
  const unsigned g = grid_for(rows * S);
  split_stats_kernel<T, BWD><<<g, kSplitThreads, 0, st>>>(A_, B_, ws, rows, N, S, a.log, vec);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  split_apply_kernel<T, BWD><<<g, kSplitThreads, 0, st>>>(A_, B_, O, ws, rows, N, S, a.log, vec);
  return cudaGetLastError();
}

template <typename T, bool BWD>
cudaError_t launch_inner(const SoftmaxArgs& a, const Plan& p, cudaStream_t st) {
  const T* A_ = static_cast<const T*>(a.a);
  const T* B_ = static_cast<const T*>(a.b);
  T* O = static_cast<T*>(a.out);
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
cudaError_t launch_typed(const SoftmaxArgs& a, const Plan& p, void* workspace, cudaStream_t st, SoftmaxAlgo algo);

// The plan with the staged kernels turned off: their fallback when a launch is refused.
template <typename T, bool BWD>
cudaError_t launch_old(const SoftmaxArgs& a, void* workspace, cudaStream_t st, SoftmaxAlgo algo) {
  SoftmaxArgs o = a;
  o.tune.rows = 1;
  o.tune.cols = 1;
  return launch_typed<T, BWD>(o, make_plan(o, algo, BWD), workspace, st, algo);
}

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
        if (e != cudaSuccess) {  // refused (no room for the cluster): the split path
          cudaGetLastError();
          return launch_split<T, BWD>(a, workspace, st, vec);
        }
      } else {
        return cudaErrorInvalidValue;
      }
      break;
    }
    case Kind::RowWarp: {
      if constexpr (!BWD && sizeof(T) <= 4) {
        const unsigned g = grid_for(cdiv(rows, kRowWarpThreads / 32));
        auto k = p.ch == 8 ? (a.log ? row_warp_fwd_kernel<T, 8, true> : row_warp_fwd_kernel<T, 8, false>)
                           : (a.log ? row_warp_fwd_kernel<T, 16, true> : row_warp_fwd_kernel<T, 16, false>);
        k<<<g, kRowWarpThreads, 0, st>>>(A_, O, rows, N, vec);
      } else {
        return cudaErrorInvalidValue;  // forward, 2- and 4-byte types only
      }
      break;
    }
    case Kind::ClusterFwd: {
      if constexpr (!BWD && sizeof(T) <= 4) {
        cudaLaunchConfig_t cfg{};
        const int64_t clusters = std::min<int64_t>(rows, kMaxGrid / kClusterMax);  // grid-stride over the rest
        cfg.gridDim = dim3(unsigned(clusters * p.S));
        cfg.blockDim = dim3(unsigned(p.threads));
        cfg.stream = st;
        cudaLaunchAttribute attr[1] = {cluster_attr(p.S)};
        cfg.attrs = attr;
        cfg.numAttrs = 1;
        const cudaError_t e = cudaLaunchKernelEx(&cfg, a.log ? cluster_fwd_kernel<T, true> : cluster_fwd_kernel<T, false>,
                                                 A_, O, rows, N, vec);
        if (e != cudaSuccess) {
          cudaGetLastError();
          return launch_split<T, BWD>(a, workspace, st, vec);
        }
      } else {
        return cudaErrorInvalidValue;  // forward, 2- and 4-byte types only
      }
      break;
    }
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
        const cudaError_t e =
            cudaLaunchKernelEx(&cfg, a.log ? inner_cluster_fwd_kernel<T, true> : inner_cluster_fwd_kernel<T, false>, A_,
                               O, a.outer, N, a.inner, tiles, NB);
        if (e != cudaSuccess) {
          cudaGetLastError();
          return launch_inner<T, BWD>(a, p, st);
        }
      } else {
        return cudaErrorInvalidValue;
      }
      break;
    }
    case Kind::StagedRows: {
      if constexpr (!BWD && sizeof(T) <= 4) {
        const cudaError_t e =
            p.ch == 8 ? launch_staged(staged_rows_kernel_for<T, 8>(a.log), p, rows, st, A_, O, rows, N, p.stages)
                      : launch_staged(staged_rows_kernel_for<T, 4>(a.log), p, rows, st, A_, O, rows, N, p.stages);
        if (e != cudaSuccess) {  // refused: the older kernels
          cudaGetLastError();
          return launch_old<T, BWD>(a, workspace, st, algo);
        }
      } else {
        return cudaErrorInvalidValue;  // forward, 2- and 4-byte types only
      }
      break;
    }
    case Kind::SmemRows: {
      if constexpr (!BWD && sizeof(T) <= 4) {
        const cudaError_t e = launch_staged(smem_rows_kernel_for<T>(a.log, p.bulk), p, rows, st, A_, O, rows, N, p.sv);
        if (e != cudaSuccess) {  // refused: the older kernels
          cudaGetLastError();
          return launch_old<T, BWD>(a, workspace, st, algo);
        }
      } else {
        return cudaErrorInvalidValue;  // forward, 2- and 4-byte types only
      }
      break;
    }
    case Kind::StagedCols: {
      if constexpr (sizeof(T) <= 4) {
        const int64_t tiles = cdiv(a.inner, int64_t(kScTx) * V);
        const cudaError_t e = launch_staged(staged_cols_kernel_for<T, BWD>(a.log), p, a.outer * tiles, st, A_, B_, O,
                                            a.outer, N, a.inner, tiles, p.ch, p.stages);
        if (e != cudaSuccess) {
          cudaGetLastError();
          return launch_old<T, BWD>(a, workspace, st, algo);
        }
      } else {
        return cudaErrorInvalidValue;
      }
      break;
    }
    case Kind::Split:
      return launch_split<T, BWD>(a, workspace, st, vec);
    case Kind::Inner:
      return launch_inner<T, BWD>(a, p, st);
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
  // The cluster paths fall back to the split path when a launch is refused.
  if (p.kind != Kind::Split && p.kind != Kind::ClusterRows && p.kind != Kind::ClusterFwd && p.kind != Kind::StagedRows &&
      p.kind != Kind::SmemRows)
    return 0;
  const int64_t acc = a.dtype == DType::Float64 ? 8 : 4;
  return a.outer * cdiv(a.N, kSplitChunk) * acc * (backward ? 1 : 2);
}

namespace {
int env_int(const char* name, std::initializer_list<int> allowed, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr) return fallback;
  const int x = std::atoi(v);
  for (int ok : allowed)
    if (x == ok) return x;
  return fallback;
}
int env_old_new(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr) return fallback;
  if (std::strcmp(v, "old") == 0) return 1;
  if (std::strcmp(v, "new") == 0) return 2;
  return fallback;
}
int env_variant(const char* name, int fallback) {  // the rows kernels: old, new, smem, bulk
  const char* v = std::getenv(name);
  if (v != nullptr && std::strcmp(v, "smem") == 0) return 3;
  if (v != nullptr && std::strcmp(v, "bulk") == 0) return 4;
  return env_old_new(name, fallback);
}
}  // namespace

SoftmaxTuning softmax_resolve_tuning(SoftmaxTuning t) {
  // The environment is read once per process (the sweep sets it per subprocess).
  static const SoftmaxTuning env = [] {
    SoftmaxTuning e;
    // H100 sweep at 4512142 (results/softmax_sweep_h100.txt): fp32 (4096, 131072)
    // forward rows=smem cluster 8 2.83 TB/s (bulk 2.80; the persistent staged
    // register kernel 2.15); bf16 (64, 4096, 256) dim=1, staged column tiles one at
    // a time (stages 1, several blocks per SM) forward 2.25 at 16 rows per thread,
    // backward 2.64 at 8 (register cluster kernel 1.79, persistent 3 stages 2.42).
    // Launched 4 clusters per resident one (grid=4, blocks coming and going),
    // synccheck reports "Divergent thread(s) in warp" at the first block barrier
    // of the column kernel (H100 and H200, flaky, backward mostly), with aligned and
    // unaligned barriers alike, though the SASS has the warp reconverged (BSYNC)
    // right before BAR.SYNC (an unaligned barrier.sync compiled to the same
    // instruction and was flagged too); with every cluster resident (grid=1) no
    // report, so 1 is the default for both one-stage kernels.
    e.rows = env_variant("GPU_PUZZLES_SOFTMAX_ROWS_VARIANT", 3);
    e.cluster = env_int("GPU_PUZZLES_SOFTMAX_CLUSTER", {4, 8, 16}, 8);
    // Column tiles: 1 stage (non-persistent). The staged rows kernel (rows=new)
    // always keeps at least 2 stages.
    e.stages = env_int("GPU_PUZZLES_SOFTMAX_STAGES", {1, 2, 3}, 1);
    // new: staged column tiles forward and backward (0 would keep them for the
    // backward only, the register cluster kernel forward).
    e.cols = env_old_new("GPU_PUZZLES_SOFTMAX_COL_VARIANT", 2);
    e.col_rows_fwd = env_int("GPU_PUZZLES_SOFTMAX_COL_ROWS_FWD", {4, 8, 16}, 16);
    e.col_rows_bwd = env_int("GPU_PUZZLES_SOFTMAX_COL_ROWS_BWD", {4, 8, 16}, 8);
    e.grid = env_int("GPU_PUZZLES_SOFTMAX_GRID", {1, 4}, 1);
    return e;
  }();
  if (t.rows == 0) t.rows = env.rows;
  if (t.cluster == 0) t.cluster = env.cluster;
  if (t.stages == 0) t.stages = env.stages;
  if (t.cols == 0) t.cols = env.cols;
  if (t.col_rows_fwd == 0) t.col_rows_fwd = env.col_rows_fwd;
  if (t.col_rows_bwd == 0) t.col_rows_bwd = env.col_rows_bwd;
  if (t.grid == 0) t.grid = env.grid;
  return t;
}

LaunchStatus softmax_forward_cuda(const SoftmaxArgs& a, SoftmaxAlgo algo, void* workspace, cudaStream_t stream) {
  return launch(a, algo, workspace, stream, false);
}

LaunchStatus softmax_backward_cuda(const SoftmaxArgs& a, SoftmaxAlgo algo, void* workspace, cudaStream_t stream) {
  return launch(a, algo, workspace, stream, true);
}

}  // namespace gpu_puzzles
