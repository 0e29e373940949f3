// The pieces the softmax kernel files share (softmax_rows.cu, softmax_cluster.cu,
// softmax_cols.cu, softmax_teaching.cu, softmax_plan.cu): block sizes, the
// device reductions and statistics helpers, what the plan reads of a call's layout
// (the Plan: softmax_plan.h), and each family's launcher. Internal to csrc/softmax;
// include from .cu files only.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include <cooperative_groups.h>

#include "common/device.cuh"
#include "softmax/softmax.h"

namespace gpu_puzzles {
namespace softmax_detail {

namespace cg = cooperative_groups;

// ---- block sizes and limits ----------------------------------------------------
constexpr int kWarpRowsThreads = 256;  // 8 rows per block in the warp path
constexpr int kSplitThreads = 256;
constexpr int64_t kSplitChunk = 16384;  // elements of a row per block (a multiple of every V)
constexpr int kInnerThreads = 512;
constexpr int kLoopThreads = 256;  // power of two: the tree reduction halves it
constexpr int64_t kInnerCacheBytes = 100 * 1024;
constexpr int64_t kMaxGrid = int64_t(1) << 24;  // grid-stride loops cover the rest
constexpr int kClusterElems = 16;               // cluster_rows_kernel: elements per thread
constexpr int kClusterMax = 8;                  // portable cluster size limit
constexpr int kRowWarpThreads = 128;            // row_warp_fwd_kernel: 4 rows per block
constexpr int kClusterFwdThreads = 512;         // cluster_fwd_kernel
constexpr int kClusterFwdElems = 32;            // cluster_fwd_kernel: elements per thread
// inner_cluster_fwd_kernel: 8 x 32 threads, 16 rows each
constexpr int kIcTx = 8, kIcTy = 32, kIcRows = 16;
constexpr int kIcThreads = kIcTx * kIcTy;  // 256
constexpr int kIcMaxCols = kIcTx * 8;      // columns of a tile, bf16 / fp16 (fp32: 32)
constexpr int kSrThreads = 512;            // staged_rows_fwd_kernel
constexpr int kSmThreads = 256;            // smem_rows_kernel
constexpr int kScTx = 8, kScTy = 32;       // staged_cols_kernel
constexpr int kScThreads = kScTx * kScTy;  // 256
// Dynamic shared memory a staged block may take (227 KB per block on sm_90, less
// the kernels' static arrays, under 6 KB).
constexpr int64_t kStagedSmemMax = 220 * 1024;

// ---- device helpers ------------------------------------------------------------
template <typename A>
__device__ __forceinline__ A neg_inf() {
  return static_cast<A>(-INFINITY);
}
__device__ __forceinline__ float exp_a(float v) { return expf(v); }
__device__ __forceinline__ double exp_a(double v) { return exp(v); }
__device__ __forceinline__ float log_a(float v) { return logf(v); }
__device__ __forceinline__ double log_a(double v) { return log(v); }
__device__ __forceinline__ float max_a(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double max_a(double a, double b) { return fmax(a, b); }

// Running (max m, sum s of exp(x - m)). -inf adds nothing; +inf or NaN make s
// NaN, so the row becomes NaN as in torch.softmax (exp(inf - inf) there).
template <typename A>
__device__ __forceinline__ void online_add(A& m, A& s, A x) {
  if (x > m) {
    s = s * exp_a(m - x) + (A(1) + (x - x));  // x - x is NaN for x = +inf
    m = x;
  } else if (x != neg_inf<A>()) {
    s += exp_a(x - m);
  }
}

// Merge (m2, s2) into (m, s). An empty part (s == 0) contributes nothing, even
// when both maxima are -inf (exp(-inf + inf) would be NaN).
template <typename A>
__device__ __forceinline__ void online_merge(A& m, A& s, A m2, A s2) {
  const A mn = max_a(m, m2);
  const A a = s == A(0) ? A(0) : s * exp_a(m - mn);
  const A b = s2 == A(0) ? A(0) : s2 * exp_a(m2 - mn);
  m = mn;
  s = a + b;
}

// Block-wide reductions through `red` (33 slots). Every thread of the block
// calls them (barriers); blockDim.x is a multiple of 32. The trailing barrier
// lets the caller reuse `red` at once.
template <bool kMax, typename A>
__device__ __forceinline__ A block_reduce(A v, A* red) {
  v = kMax ? warp_max(v) : warp_sum(v);
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  if (lane == 0) red[w] = v;
  __syncthreads();
  if (w == 0) {
    A t = lane < nw ? red[lane] : (kMax ? neg_inf<A>() : A(0));
    t = kMax ? warp_max(t) : warp_sum(t);
    if (lane == 0) red[32] = t;
  }
  __syncthreads();
  const A r = red[32];
  __syncthreads();
  return r;
}
template <typename A>
__device__ __forceinline__ A block_sum(A v, A* red) {
  return block_reduce<false>(v, red);
}
template <typename A>
__device__ __forceinline__ A block_max(A v, A* red) {
  return block_reduce<true>(v, red);
}

// The seed's shared-memory tree: halve the active threads each step.
template <bool IS_MAX, typename A>
__device__ __forceinline__ A tree_reduce(A v, A* buf) {
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
template <typename A>
__device__ __forceinline__ void block_merge(A& m, A& s, A* red) {
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
template <bool BLOCK, int LANES, bool MAX, typename A>
__device__ __forceinline__ A group_reduce(A v, A* red) {
  if constexpr (BLOCK) {
    if constexpr (MAX)
      return block_max(v, red);
    else
      return block_sum(v, red);
  } else {
#pragma unroll
    for (int o = LANES / 2; o > 0; o >>= 1) {
      const A w = __shfl_xor_sync(0xffffffffu, v, o);
      if constexpr (MAX)
        v = max_a(v, w);
      else
        v += w;
    }
    return v;
  }
}
template <bool BLOCK, int LANES, typename A>
__device__ __forceinline__ A group_max(A v, A* red) {
  return group_reduce<BLOCK, LANES, true>(v, red);
}
template <bool BLOCK, int LANES, typename A>
__device__ __forceinline__ A group_sum(A v, A* red) {
  return group_reduce<BLOCK, LANES, false>(v, red);
}

// ---- a row in registers (rows_regs_kernel, cluster_rows_kernel) -----------------
// Thread t of a G-thread group holds chunks c < CH of V elements at (c G + t) V of
// its row; the group's reductions between these steps are the caller's.

// Loads the thread's chunks (-inf past N) and returns their maximum.
template <typename T, int CH, int V, typename A>
__device__ __forceinline__ A regs_load_max(A (&v)[CH][V], const T* ar, int G, int t, int64_t N, bool vec) {
  A m = neg_inf<A>();
#pragma unroll
  for (int c = 0; c < CH; ++c) {
    load_chunk<T, V>(v[c], ar, (int64_t(c) * G + t) * V, N, vec, neg_inf<A>());
#pragma unroll
    for (int k = 0; k < V; ++k) m = max_a(m, v[c][k]);
  }
  return m;
}

// With the row's maximum m: v becomes x - m (log) or exp(x - m); returns the thread's
// sum of exp(x - m).
template <int CH, int V, typename A>
__device__ __forceinline__ A regs_exp_sum(A (&v)[CH][V], A m, bool log) {
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
  return s;
}

// With the row's sum s: stores (x - m) - log s (log) or exp(x - m) / s.
template <typename T, int CH, int V, typename A>
__device__ __forceinline__ void regs_store_fwd(T* outr, A (&v)[CH][V], A s, bool log, int G, int t, int64_t N,
                                               bool vec) {
  const A sub = log ? log_a(s) : A(0);
  const A mul = log ? A(1) : A(1) / s;
#pragma unroll
  for (int c = 0; c < CH; ++c) {
#pragma unroll
    for (int k = 0; k < V; ++k) v[c][k] = log ? v[c][k] - sub : v[c][k] * mul;
    store_chunk<T, V>(outr, v[c], (int64_t(c) * G + t) * V, N, vec);
  }
}

// Backward (a = y, b = dy): loads the thread's chunks of both (0 past N) and returns
// its part of sum(dy y) (softmax) or sum(dy) (log_softmax).
template <typename T, int CH, int V, typename A>
__device__ __forceinline__ A regs_load_dot(A (&v)[CH][V], A (&g)[CH][V], const T* ar, const T* br, int G, int t,
                                           int64_t N, bool log, bool vec) {
  A s = A(0);
#pragma unroll
  for (int c = 0; c < CH; ++c) {
    load_chunk<T, V>(v[c], ar, (int64_t(c) * G + t) * V, N, vec, A(0));
    load_chunk<T, V>(g[c], br, (int64_t(c) * G + t) * V, N, vec, A(0));
#pragma unroll
    for (int k = 0; k < V; ++k) s += log ? g[c][k] : g[c][k] * v[c][k];
  }
  return s;
}

// With the row's sum s: stores dx = y (dy - s) (softmax) or dy - exp(y) s (log_softmax).
template <typename T, int CH, int V, typename A>
__device__ __forceinline__ void regs_store_bwd(T* outr, A (&v)[CH][V], const A (&g)[CH][V], A s, bool log, int G, int t,
                                               int64_t N, bool vec) {
#pragma unroll
  for (int c = 0; c < CH; ++c) {
#pragma unroll
    for (int k = 0; k < V; ++k) v[c][k] = log ? g[c][k] - exp_a(v[c][k]) * s : v[c][k] * (g[c][k] - s);
    store_chunk<T, V>(outr, v[c], (int64_t(c) * G + t) * V, N, vec);
  }
}

// ---- the fast forward kernels' helpers -------------------------------------------
// Shared pieces: exp(x - m) and stores that do not linger in L2.
//
// Half types: exp(x - m) = 2^((x - m) log2e) with MUFU.EX2; ex2.approx's own
// error (~2^-22) is far under half precision. The subtraction comes first: the
// one-FFMA form 2^(x log2e - round(m log2e)) carries the rounding of m log2e
// (up to 2% at |m| ~ 1e6) as a factor that cancels in softmax but not in
// log_softmax's log(sum) (the bf16 tests at |x| ~ 1e6 catch it). float / double
// keep the accurate expf / exp (the fp32 tests hold softmax to 5e-6 relative).
constexpr float kLog2e = 1.4426950408889634f;
__device__ __forceinline__ float ex2_approx(float v) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
  return r;
}
template <typename T, bool HALF = (sizeof(T) == 2)>
struct ExpShift {
  using A = acc_t<T>;
  A m;
  __device__ __forceinline__ explicit ExpShift(A m_) : m(m_) {}
  __device__ __forceinline__ A operator()(A x) const { return exp_a(x - m); }
};
template <typename T>
struct ExpShift<T, true> {
  float m;  // m = -inf (an all -inf row) gives NaN, as torch does
  __device__ __forceinline__ explicit ExpShift(float m_) : m(m_) {}
  __device__ __forceinline__ float operator()(float x) const { return ex2_approx((x - m) * kLog2e); }
};

// Half types: make the packed words opaque between passes, so the compiler
// converts them again instead of keeping every converted float live (which
// doubles the registers and spills). Costs no instruction.
template <typename T, int V>
__device__ __forceinline__ void pin(Vec<T, V>& r) {
  if constexpr (sizeof(T) == 2) {
#pragma unroll
    for (int i = 0; i < Vec<T, V>::kWords; ++i) asm volatile("" : "+r"(r.w[i]));
  }
}

// Merge running pair (m2, s2) into (m, s), where s = sum of exp(x - m). A pair
// with s == 0 is empty (all its x are -inf, or padding): its m takes no part,
// so an empty part can never drag the shift away from the real maximum. NaN
// sums are not empty and poison the result, as in torch. Commutative (a
// butterfly gives every lane the same bits).
template <typename A>
__device__ __forceinline__ void pair_merge(A& m, A& s, A m2, A s2) {
  if (s2 == A(0)) return;
  if (s == A(0)) {
    m = m2;
    s = s2;
    return;
  }
  const A mn = max_a(m, m2);
  s = s * exp_a(m - mn) + s2 * exp_a(m2 - mn);
  m = mn;
}

// After the cluster barrier: the pair (M, S) from every block's `part`, merged in rank
// order (identical bits in every block); kSumOnly (backward partials) sums S alone.
template <bool kSumOnly = false, typename Cluster, typename A>  // Cluster: cg::cluster_group (sm_90)
__device__ __forceinline__ void cluster_pair(Cluster& cluster, A* part, int CS, A& M, A& S) {
  M = A(0);
  S = A(0);
  for (int r = 0; r < CS; ++r) {
    const A* p = cluster.map_shared_rank(part, r);
    if constexpr (kSumOnly)
      S += p[1];
    else
      pair_merge(M, S, p[0], p[1]);
  }
}

// ---- rows at any strides and alignment ----------------------------------------
// The start of row `row` of an input (common/row_strides.h).
template <typename T>
__device__ __forceinline__ const T* row_ptr(const T* __restrict__ p, const RowStrides& L, int64_t row) {
  return p + row_offset(L, row);
}

// Elements of T from the 16-byte boundary at or below p (0..V-1).
template <typename T>
__device__ __forceinline__ int misalign(const T* p) {
  return int((reinterpret_cast<uintptr_t>(p) & 15) / sizeof(T));
}

// Vector x shifted down by D elements, the vacated top filled from y: the V
// elements starting at element D of the 32 bytes (x, y). Compile-time D, so every
// element stays in registers.
template <int D, typename T, int V>
__device__ __forceinline__ void shift_into(Vec<T, V>& r, const Vec<T, V>& x, const Vec<T, V>& y) {
#pragma unroll
  for (int k = 0; k < V; ++k) r.e[k] = k + D < V ? x.e[k + D] : y.e[k + D - V];
}
template <int D, typename T, int V>
__device__ __forceinline__ void shift_case(int d, Vec<T, V>& r, const Vec<T, V>& x, const Vec<T, V>& y) {
  if constexpr (D < V) {
    if (d == D)
      shift_into<D>(r, x, y);
    else
      shift_case<D + 1>(d, r, x, y);
  }
}

// The V elements at element position `pos` (>= 0) of shared vectors `buf`, d =
// pos % V (uniform over a row, so the branches do not diverge): one 16-byte read
// when aligned, else two and a shift. With d > 0 both vectors must hold data.
template <typename T, int V>
__device__ __forceinline__ Vec<T, V> smem_fetch(const uint4* buf, int64_t pos, int d) {
  Vec<T, V> r;
  if (d == 0) {
    r.q[0] = buf[pos / V];
  } else {
    Vec<T, V> x, y;
    x.q[0] = buf[pos / V];
    y.q[0] = buf[pos / V + 1];
    shift_case<1>(d, r, x, y);
  }
  return r;
}

// ---- planning (the Plan: softmax_plan.h) --------------------------------------

// f(tag, bwd_c) and its result: tag a value of a's element type (dispatch_dtype), bwd_c
// std::true_type for the backward, else std::false_type. The families' entry points.
template <typename F>
auto dispatch_typed(const SoftmaxArgs& a, bool bwd, F&& f) {
  return dispatch_dtype(a.dtype, [&](auto tag) { return bwd ? f(tag, std::true_type{}) : f(tag, std::false_type{}); });
}

// A call's pointers in its element type: input a (x, or y backward), input b (dy; null
// forward) and the output.
template <typename T>
struct TypedPtrs {
  const T* a;
  const T* b;
  T* out;
};
template <typename T>
TypedPtrs<T> typed_ptrs(const SoftmaxArgs& a) {
  return {static_cast<const T*>(a.a), static_cast<const T*>(a.b), static_cast<T*>(a.out)};
}

inline int esize(DType dt) { return dt == DType::Float64 ? 8 : (dt == DType::Float32 ? 4 : 2); }
inline int64_t pow2ceil(int64_t v) {
  int64_t p = 1;
  while (p < v) p <<= 1;
  return p;
}
inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline bool al16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

unsigned grid_for(int64_t blocks);
cudaLaunchAttribute cluster_attr(int64_t cs);

// Clusters of `cs` blocks of `kernel` that the GPU holds at once (0: none, or no
// sm_90 code); sets the kernel's shared memory and cluster size attributes first.
int resident_clusters(const void* kernel, int threads, int cs, int64_t smem);

// Launches a staged / shared-memory kernel on the clusters resident at once;
// an error when the GPU holds none (the caller falls back).
template <typename Kern, typename... Args>
cudaError_t launch_staged(Kern kernel, const Plan& p, int64_t items, cudaStream_t st, Args... args) {
  // A positive count means resident_clusters has set the kernel's attributes
  // (shared memory >= p.smem, cluster size 16 allowed) on this device.
  const int n = resident_clusters(reinterpret_cast<const void*>(kernel), p.threads, int(p.S), p.smem);
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
  cudaLaunchAttribute attr[1] = {cluster_attr(p.S)};
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, args...);
}

// Vectorized 16-byte access: whole vectors per row, every pointer aligned and
// every row stride a whole number of vectors.
inline bool vec_ok(const SoftmaxArgs& a, bool bwd) {
  const int V = 16 / esize(a.dtype);
  auto whole = [V](const RowStrides& L) { return L.s0 % V == 0 && L.s1 % V == 0; };
  return a.N % V == 0 && al16(a.a) && al16(a.out) && whole(a.la) && (!bwd || (al16(a.b) && whole(a.lb)));
}

// Every row of every input starts at the same offset within 16 bytes as the same
// row of the (contiguous) output: then no input needs shifting against it. Row r =
// r0 n1 + r1 of an input starts at r0 s0 + r1 s1 elements, of the output at r N.
inline bool same_misalign(const SoftmaxArgs& a, bool bwd) {
  const int V = 16 / esize(a.dtype);
  auto same = [&](const void* p, const RowStrides& L) {
    return (reinterpret_cast<uintptr_t>(p) & 15) == (reinterpret_cast<uintptr_t>(a.out) & 15) &&
           (L.n1 == 1 || (L.s1 - a.N) % V == 0) && (a.outer <= L.n1 || (L.s0 - L.n1 * a.N) % V == 0);
  };
  return same(a.a, a.la) && (!bwd || same(a.b, a.lb));
}

// ---- the kernel families' launchers (one per file) -----------------------------
// The register / split paths return the launch's error. The cluster paths
// (ClusterRows, ClusterFwd, StagedRows, SmemRows, InnerCluster, StagedCols)
// return the cluster launch's own status, without cudaGetLastError, so that
// launch_plan can fall back when the GPU refuses the cluster.
cudaError_t launch_rows(const SoftmaxArgs& a, const Plan& p, void* workspace, cudaStream_t st,
                        bool bwd);                                                                // softmax_rows.cu
cudaError_t launch_split(const SoftmaxArgs& a, void* workspace, cudaStream_t st, bool bwd);       // softmax_rows.cu
cudaError_t launch_cluster_rows(const SoftmaxArgs& a, const Plan& p, cudaStream_t st, bool bwd);  // softmax_cluster.cu
cudaError_t launch_cols(const SoftmaxArgs& a, const Plan& p, cudaStream_t st, bool bwd);          // softmax_cols.cu
cudaError_t launch_teaching(const SoftmaxArgs& a, SoftmaxAlgo algo, cudaStream_t st, bool bwd);   // softmax_teaching.cu

// Kernel handles for the heuristic's capacity queries (nullptr: not built for
// that dtype; the float instantiations stand for every dtype where one is asked).
const void* cluster_rows_kernel_handle(bool bwd);  // float
const void* cluster_fwd_kernel_handle();           // float, softmax
const void* staged_rows_kernel_handle(DType dt, bool log, int K);
const void* smem_rows_kernel_handle(DType dt, bool log, bool bulk, bool bwd, int align);  // align: Plan::align
const void* inner_cluster_kernel_handle();                                                // float, softmax
const void* staged_cols_kernel_handle(DType dt, bool log, bool bwd);

}  // namespace softmax_detail
}  // namespace gpu_puzzles
