// Long softmax rows on Hopper, a thread-block cluster per row, partial
// statistics exchanged through distributed shared memory: the row in registers
// (cluster_rows_kernel, forward and backward; cluster_fwd_kernel, forward), staged
// through shared memory by persistent clusters (staged_rows_fwd_kernel), or the
// row's slices held in shared memory (forward and backward: smem_own_rows_kernel where
// every input row starts at the output row's offset within 16 bytes, aligned or not;
// smem_rows_kernel for any row length and alignment). Input rows start at any row
// strides (RowStrides).
#include "common/bulk_copy.cuh"
#include "common/cp_async.cuh"
#include "softmax/softmax_kernels.cuh"

namespace gpu_puzzles {
namespace {

using namespace softmax_detail;

// ---- the row exchange of the one-barrier cluster kernels -----------------------
// cluster_fwd_kernel, staged_rows_fwd_kernel and smem_rows_kernel (forward) reduce each
// warp's values to a pair (shift, sum of exp(x - shift)) in wred, then merge the
// pairs over the block and the cluster.

// This warp's pair for its values v: shift = the warp's maximum, s = the sum of
// exp(x - shift); softmax keeps e = exp(x - shift) in v. A warp of only -inf
// (or padding) shifts by 0: exp(-inf) = 0, sum 0 (empty), while a NaN among
// them still makes the sum NaN.
template <bool LOG, typename T, int K, int V, typename A>
__device__ __forceinline__ A warp_pair(A (&v)[K][V], A& shift) {
  A mw = neg_inf<A>();
#pragma unroll
  for (int c = 0; c < K; ++c)
#pragma unroll
    for (int k = 0; k < V; ++k) mw = max_a(mw, v[c][k]);
  mw = warp_max(mw);
  shift = mw == neg_inf<A>() ? A(0) : mw;
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
  return warp_sum(s);
}

// Warp 0 merges the block's nw warp pairs (a butterfly: every lane the same
// bits) and publishes the block's pair in `part` for the cluster.
template <typename A>
__device__ __forceinline__ void publish_block_pair(const A (*wred)[2], A* part, int lane, int w, int nw) {
  if (w == 0) {
    A bm = lane < nw ? wred[lane][0] : A(0), bs = lane < nw ? wred[lane][1] : A(0);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const A m2 = __shfl_xor_sync(0xffffffffu, bm, o), s2 = __shfl_xor_sync(0xffffffffu, bs, o);
      pair_merge(bm, bs, m2, s2);
    }
    if (lane == 0) {
      part[0] = bm;
      part[1] = bs;
    }
  }
}

// The same for sums alone (the backward's dot): part = (0, block sum), for
// cluster_pair<true>.
template <int NW, typename A>
__device__ __forceinline__ void publish_block_sum(const A (&wred)[NW][2], A (&part)[2], int lane, int w) {
  if (w == 0) {
    A t = lane < NW ? wred[lane][1] : A(0);
    t = warp_sum(t);
    if (lane == 0) {
      part[0] = A(0);
      part[1] = t;
    }
  }
}

// The row's (M, S) from this warp's pair (shift, s): the block's nw warp pairs merged,
// then the cluster's block pairs. The cluster barrier is a release/acquire across the
// cluster (every block's pair visible after it) and orders this row's wred reads before
// the next row's wred writes.
template <typename Cluster, int NW, typename A>
__device__ __forceinline__ void exchange_pair(Cluster& cluster, A (&wred)[NW][2], A (&part)[2], int CS, int lane, int w,
                                              int nw, A shift, A s, A& M, A& S) {
  if (lane == 0) {
    wred[w][0] = shift;
    wred[w][1] = s;
  }
  __syncthreads();
  publish_block_pair(wred, part, lane, w, nw);
  cluster.sync();
  cluster_pair(cluster, part, CS, M, S);
}

// This thread's values from the row's (M, S): log_softmax keeps x and writes
// (x - M) - log S; softmax keeps e = exp(x - shift) and scales it by
// exp(shift - M) / S. S == 0 only for a row of all -inf: NaN there, as torch.
// An empty warp (s == 0, shift 0) writes 0: exp(0 - M) would overflow for a
// very negative M and make 0 * inf = NaN.
template <bool LOG, int K, int V, typename A>
__device__ __forceinline__ void finish_row(A (&v)[K][V], A M, A S, A s, A shift) {
  const A nan = A(NAN);
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
}

// ---- long rows on Hopper: a thread-block cluster per row -----------------------
// CS blocks (2..8) of one cluster share a row, each holding its slice in
// registers (16 elements per thread), so x is read once even for rows too long
// for one block. Block partials are exchanged through distributed shared memory.
// `part` is double-buffered by row parity: a block may start the next row while a
// slower one still reads this row's partials.

template <typename T, bool BWD>
__global__ void __launch_bounds__(1024)
    cluster_rows_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out, int64_t rows, int64_t N,
                        RowStrides la, RowStrides lb, bool log, bool vec) {
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
    const T* ar = row_ptr(a, la, row);
    T* outr = out + row * N;
    A v[CH][V];
    if constexpr (!BWD) {
      A m = block_max(regs_load_max<T>(v, ar, G, t, N, vec), red);
      if (threadIdx.x == 0) part[parity][0] = m;
      cluster.sync();
      for (int r = 0; r < CS; ++r) m = max_a(m, *cluster.map_shared_rank(&part[parity][0], r));
      A s = block_sum(regs_exp_sum(v, m, log), red);
      if (threadIdx.x == 0) part[parity][1] = s;
      cluster.sync();
      s = A(0);
      for (int r = 0; r < CS; ++r) s += *cluster.map_shared_rank(&part[parity][1], r);  // same order everywhere
      regs_store_fwd(outr, v, s, log, G, t, N, vec);
    } else {
      const T* br = row_ptr(b, lb, row);
      A g[CH][V];
      A s = block_sum(regs_load_dot<T>(v, g, ar, br, G, t, N, log, vec), red);
      if (threadIdx.x == 0) part[parity][1] = s;
      cluster.sync();
      s = A(0);
      for (int r = 0; r < CS; ++r) s += *cluster.map_shared_rank(&part[parity][1], r);
      regs_store_bwd(outr, v, g, s, log, G, t, N, vec);
    }
  }
  cluster.sync();  // no block exits while another may still read its `part`
#endif
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

template <typename T, bool LOG>
__global__ void __launch_bounds__(kClusterFwdThreads, 2)
    cluster_fwd_kernel(const T* __restrict__ a, T* __restrict__ out, int64_t rows, int64_t N, RowStrides la, bool vec) {
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
    const T* ar = row_ptr(a, la, row) + int64_t(t) * V;
    T* outr = out + row * N + int64_t(t) * V;
    const int64_t rem = N - int64_t(t) * V;
    A v[CH][V];
#pragma unroll
    for (int c = 0; c < CH; ++c) load_chunk<T, V>(v[c], ar, int64_t(c * G * V), rem, vec, neg_inf<A>());
    A shift;
    const A s = warp_pair<LOG, T>(v, shift);
    A M, S;
    exchange_pair(cluster, wred, part[parity], CS, lane, w, nw, shift, s, M, S);
    finish_row<LOG>(v, M, S, s, shift);
#pragma unroll
    for (int c = 0; c < CH; ++c) store_chunk<T, V>(outr, v[c], int64_t(c * G * V), rem, vec);
  }
  cluster.sync();  // no block exits while another may still read its `part`
#endif
}

// ---- long rows, forward, on Hopper: staged, persistent clusters (rows=staged) --
// Why: in the register cluster kernel above, each
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

template <typename T, bool LOG, int K>
__global__ void __launch_bounds__(kSrThreads, K <= 4 ? 2 : 1)
    staged_rows_fwd_kernel(const T* __restrict__ a, T* __restrict__ out, int64_t rows, int64_t N, RowStrides la,
                           int stages) {
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
      const T* ar = row_ptr(a, la, row) + t * V;
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
    if (stages >= 3)
      cp_async_wait<2>();
    else
      cp_async_wait<1>();
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
    A shift;
    const A s = warp_pair<LOG, T>(v, shift);
    if (lane == 0) {
      wred[w][0] = shift;
      wred[w][1] = s;
    }
    __syncthreads();
    // This thread's slots of stage `st` are in registers and used: refill them
    // with the row `stages` steps on.
    issue(row + int64_t(stages) * step, st);
    st = st + 1 == stages ? 0 : st + 1;
    publish_block_pair(wred, part[parity], lane, w, nw);
    cluster.sync();  // every block's pair visible; this row's wred reads done
    A M, S;
    cluster_pair(cluster, part[parity], CS, M, S);
    T* outr = out + row * N + t * V;
    finish_row<LOG>(v, M, S, s, shift);
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

// ---- long rows on Hopper: the row slice in shared memory (rows=smem|bulk) -----
// Why another one: the staged kernel above keeps its slice in registers (112 per
// thread), so one 512-thread block fills an SM, and a cluster of 8 then needs 8
// whole SMs of one GPC: SMs left over in a GPC stay idle.
// Here a block's slice of the row is the only copy, in dynamic shared memory;
// threads read it two or three times at shared-memory speed, need few registers,
// and several blocks share an SM: one block's loads overlap another's reductions
// and stores, and a cluster may spread over fewer SMs.
//
// Any row length, alignment and row stride. The row's output, from the 16-byte
// boundary at or below its first element, is cut into 16-byte vectors; block
// `rank` of the cluster owns output vectors [rank SV, rank SV + SV): exactly the
// row elements [lo, hi) they hold, so no two blocks write the same 16 bytes. The
// block copies the aligned 16-byte input vectors covering [lo, hi) (at most SB,
// SV + 1 when the input may be misaligned against the output, else SV) to
// shared memory; bytes outside the row in them are never used. Those before the
// row's first element lie inside the allocation (it starts 16-byte aligned); a
// block's last vector, where it runs past the row's end, is copied element by
// element (past the row may be past the allocation). Each pass walks
// the output vectors: an input misaligned against the output is read as two
// shared vectors and a shift (smem_fetch); the row's first and last output vectors,
// partly outside the row, go element by element (masked reads, element stores).
//
// Forward: per-warp (shift, sum) pairs, one DSMEM exchange per row (as
// staged_rows_fwd_kernel), then y. Backward (a = y, b = dy): dot = sum(dy y)
// (softmax) or sum(dy) (log_softmax), one DSMEM exchange, then dx: y and dy read
// once from memory. BULK: thread 0 copies each input with one bulk copy (TMA)
// completing on an mbarrier; else the threads cp.async the vectors. A grid of up
// to kMaxGrid blocks strides over rows. The plan sends rows whose inputs start at the
// output's offset within 16 bytes (no shift) to smem_own_rows_kernel below.

template <typename T, bool LOG, bool BWD, bool BULK>
__global__ void __launch_bounds__(kSmThreads)
    smem_rows_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out, int64_t rows, int64_t N,
                     RowStrides la, RowStrides lb, int64_t SV, int64_t SB) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using A = acc_t<T>;
  constexpr int V = 16 / sizeof(T);
  extern __shared__ __align__(128) unsigned char sm_raw[];
  uint4* abuf = reinterpret_cast<uint4*>(sm_raw);
  uint4* bbuf = abuf + SB;  // BWD: dy's vectors
  const T* abufT = reinterpret_cast<const T*>(abuf);
  const T* bbufT = reinterpret_cast<const T*>(bbuf);
  __shared__ A wred[kSmThreads / 32][2];
  __shared__ A part[2][2];  // [row parity][shift, sum]
  __shared__ uint64_t bar;
  cg::cluster_group cluster = cg::this_cluster();
  const int CS = int(cluster.num_blocks());
  const int tid = int(threadIdx.x), lane = tid & 31, w = tid >> 5;
  const int64_t j0 = int64_t(cluster.block_rank()) * SV;  // this block's first output vector
  const int64_t step = gridDim.x / CS, first = blockIdx.x / CS;
  if (BULK && tid == 0) mbar_init(&bar);
  __syncthreads();
  unsigned phase = 0;
  int parity = 0;
  for (int64_t row = first; row < rows; row += step, parity ^= 1) {  // cluster-uniform
    const T* arow = row_ptr(a, la, row);
    const T* brow = BWD ? row_ptr(b, lb, row) : nullptr;
    T* orow = out + row * N;
    const int oo = misalign(orow), oa = misalign(arow), ob = BWD ? misalign(brow) : 0;
    const int64_t j1 = min(j0 + SV, (oo + N + V - 1) / V);  // output vectors [j0, j1)
    // Row elements [lo, hi) of this block (empty when j1 <= j0: the block only
    // takes part in the barriers); input vectors from fa (fb) hold them, element i
    // at position i + da (i + db) of the shared copy.
    const int64_t lo = max(int64_t(0), j0 * V - oo), hi = min(N, j1 * V - oo);
    const bool any = j1 > j0;
    const int64_t fa = any ? (lo + oa) / V : 0, na = any ? (hi - 1 + oa) / V - fa + 1 : 0;
    const int64_t fb = any ? (lo + ob) / V : 0, nb = BWD && any ? (hi - 1 + ob) / V - fb + 1 : 0;
    const int64_t da = oa - fa * V, db = ob - fb * V;
    const int sa = int(((oa - oo) % V + V) % V), sb = int(((ob - oo) % V + V) % V);  // shifts, row-uniform
    const uint4* asrc = reinterpret_cast<const uint4*>(arow - oa) + fa;
    const uint4* bsrc = BWD ? reinterpret_cast<const uint4*>(brow - ob) + fb : nullptr;
    // A last vector that runs past the row's end may run past the end of the
    // allocation (the last row of a tensor whose size is not a multiple of 16
    // bytes): that one is copied element by element, only this block's elements.
    const bool at = any && (fa + na) * V - oa > N, bt = BWD && any && (fb + nb) * V - ob > N;
    const int64_t ca = na - at, cb = nb - bt;  // whole vectors copied
    if (tid < V) {
      if (at) {
        const int64_t i = (na - 1) * V + tid - da;
        if (i >= lo && i < hi) reinterpret_cast<T*>(abuf)[i + da] = arow[i];
      }
      if (bt) {
        const int64_t i = (nb - 1) * V + tid - db;
        if (i >= lo && i < hi) reinterpret_cast<T*>(bbuf)[i + db] = brow[i];
      }
    }
    if constexpr (BULK) {
      if (any) {  // block-uniform
        if (tid == 0) {
          mbar_arrive_expect(&bar, unsigned((ca + cb) * 16));
          if (ca > 0) bulk_load(abuf, asrc, unsigned(ca * 16), &bar);
          if (BWD && cb > 0) bulk_load(bbuf, bsrc, unsigned(cb * 16), &bar);
        }
        mbar_wait(&bar, phase);
        phase ^= 1u;
      }
    } else {
      for (int64_t q = tid; q < ca; q += kSmThreads) cp_async16(&abuf[q], asrc + q);
      if (BWD)
        for (int64_t q = tid; q < cb; q += kSmThreads) cp_async16(&bbuf[q], bsrc + q);
      cp_async_commit();
      cp_async_wait<0>();
    }
    __syncthreads();  // shifted reads and the tail take elements other threads copied
    // Output vector j holds row elements i0 = j V - oo .. i0 + V - 1; an edge one
    // (partly outside the row) is read element by element, `fill` outside.
    auto edge = [&](int64_t i0) { return i0 < 0 || i0 + V > N; };
    auto get = [&](const uint4* buf, const T* bufT, int64_t d, int sh, int64_t i0, A(&v)[V], A fill) {
      if (!edge(i0)) {
        const Vec<T, V> r = smem_fetch<T, V>(buf, i0 + d, sh);
#pragma unroll
        for (int k = 0; k < V; ++k) v[k] = to_acc<A>(r.e[k]);
      } else {
#pragma unroll
        for (int k = 0; k < V; ++k) {
          const int64_t i = i0 + k;
          v[k] = i >= 0 && i < N ? to_acc<A>(bufT[i + d]) : fill;
        }
      }
    };
    auto put = [&](int64_t i0, const A(&v)[V]) {
      if (!edge(i0)) {
        Vec<T, V> y;
#pragma unroll
        for (int k = 0; k < V; ++k) y.e[k] = from_acc<T>(v[k]);
        __stcs(reinterpret_cast<uint4*>(orow + i0), y.q[0]);
      } else {
#pragma unroll
        for (int k = 0; k < V; ++k) {
          const int64_t i = i0 + k;
          if (i >= 0 && i < N) orow[i] = from_acc<T>(v[k]);
        }
      }
    };
    A M, S;
    if constexpr (!BWD) {
      A m = neg_inf<A>();
#pragma unroll 4
      for (int64_t j = j0 + tid; j < j1; j += kSmThreads) {
        A v[V];
        get(abuf, abufT, da, sa, j * V - oo, v, neg_inf<A>());
#pragma unroll
        for (int k = 0; k < V; ++k) m = max_a(m, v[k]);
      }
      m = warp_max(m);
      const A shift = m == neg_inf<A>() ? A(0) : m;  // an empty warp: see cluster_fwd_kernel
      const ExpShift<T> ex(shift);
      A s = A(0);
#pragma unroll 4
      for (int64_t j = j0 + tid; j < j1; j += kSmThreads) {
        A v[V];
        get(abuf, abufT, da, sa, j * V - oo, v, neg_inf<A>());
#pragma unroll
        for (int k = 0; k < V; ++k) s += ex(v[k]);  // outside the row: exp(-inf) = 0
      }
      exchange_pair(cluster, wred, part[parity], CS, lane, w, kSmThreads / 32, shift, warp_sum(s), M, S);
      const A nan = A(NAN);
      const A mul = S == A(0) ? nan : (LOG ? log_a(S) : A(1) / S);  // an all -inf row: NaN, as torch
      const ExpShift<T> exm(M);
#pragma unroll 4
      for (int64_t j = j0 + tid; j < j1; j += kSmThreads) {
        A v[V];
        get(abuf, abufT, da, sa, j * V - oo, v, A(0));
#pragma unroll
        for (int k = 0; k < V; ++k) v[k] = LOG ? (v[k] - M) - mul : exm(v[k]) * mul;
        put(j * V - oo, v);
      }
    } else {
      // softmax: dx = y (dy - sum(dy y));  log_softmax: dx = dy - exp(y) sum(dy)
      A s = A(0);
#pragma unroll 2
      for (int64_t j = j0 + tid; j < j1; j += kSmThreads) {
        A y[V], g[V];
        get(abuf, abufT, da, sa, j * V - oo, y, A(0));
        get(bbuf, bbufT, db, sb, j * V - oo, g, A(0));
#pragma unroll
        for (int k = 0; k < V; ++k) s += LOG ? g[k] : g[k] * y[k];
      }
      s = warp_sum(s);
      if (lane == 0) wred[w][1] = s;
      __syncthreads();
      publish_block_sum(wred, part[parity], lane, w);
      cluster.sync();  // every block's sum visible; this row's wred reads done
      cluster_pair<true>(cluster, part[parity], CS, M, S);
#pragma unroll 2
      for (int64_t j = j0 + tid; j < j1; j += kSmThreads) {
        A y[V], g[V];
        get(abuf, abufT, da, sa, j * V - oo, y, A(0));
        get(bbuf, bbufT, db, sb, j * V - oo, g, A(0));
#pragma unroll
        for (int k = 0; k < V; ++k) y[k] = LOG ? g[k] - exp_a(y[k]) * S : y[k] * (g[k] - S);
        put(j * V - oo, y);
      }
    }
    // The next row's copies overwrite the shared slice every thread has read.
    __syncthreads();
  }
  cluster.sync();  // no block exits while another may still read its `part`
#endif
}

// ---- long rows whose inputs start where the output does (rows=smem|bulk) -------
// Why: in the usual layouts (a contiguous x and a fresh out; y and dy of one shape)
// every row of every tensor starts at the same offset within 16 bytes, even for an
// odd N. Then input vector j of a row holds exactly the elements of output vector
// j: no shift, and each thread copies its own vectors q = tid, tid + kSmThreads, ...
// of the block's slice and reads back only those, so no block barrier follows the
// copy (cp.async) or the last pass. The row's first and last vectors, where the row
// starts or ends inside them, stay out of the hot loops: their owner threads do them
// element by element. ALIGNED (every row 16-byte aligned, N % V == 0): no such
// vectors; the forward is the aligned-only kernel this family started with.
// Barriers per row: one block barrier (the warps' pairs or sums) and one cluster
// barrier (BULK: one more block barrier, the next bulk copy overwrites what every
// thread read). Slices, statistics and the grid as smem_rows_kernel.

template <typename T, bool LOG, bool BWD, bool BULK, bool ALIGNED>
__global__ void __launch_bounds__(kSmThreads)
    smem_own_rows_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out, int64_t rows, int64_t N,
                         RowStrides la, RowStrides lb, int64_t SV) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using A = acc_t<T>;
  constexpr int V = 16 / sizeof(T);
  extern __shared__ __align__(128) unsigned char sm_raw[];
  uint4* abuf = reinterpret_cast<uint4*>(sm_raw);
  uint4* bbuf = abuf + SV;  // BWD: dy's vectors
  __shared__ A wred[kSmThreads / 32][2];
  __shared__ A part[2][2];  // [row parity][shift, sum]
  __shared__ uint64_t bar;
  cg::cluster_group cluster = cg::this_cluster();
  const int CS = int(cluster.num_blocks());
  const int tid = int(threadIdx.x), lane = tid & 31, w = tid >> 5;
  const int64_t j0 = int64_t(cluster.block_rank()) * SV;  // this block's first vector of a row
  const int64_t cnt_al = ALIGNED ? max(int64_t(0), min(SV, N / V - j0)) : 0;
  const int64_t step = gridDim.x / CS, first = blockIdx.x / CS;
  if (BULK && tid == 0) mbar_init(&bar);
  __syncthreads();
  unsigned phase = 0;
  int parity = 0;
  for (int64_t row = first; row < rows; row += step, parity ^= 1) {  // cluster-uniform
    const T* arow = row_ptr(a, la, row);
    const T* brow = BWD ? row_ptr(b, lb, row) : nullptr;
    T* orow = out + row * N;
    const int oo = ALIGNED ? 0 : misalign(orow);  // the inputs' too (the plan checked)
    // Slice vector q holds row elements (j0 + q) V - oo + k, k < V. Vectors [0, cnt)
    // of the slice are this row's; qh, qt: the row's first and last vector when the
    // row starts or ends inside it, else -1; the hot loops take [qh + 1, qe).
    int64_t cnt = cnt_al, qh = -1, qt = -1;
    if constexpr (!ALIGNED) {
      const int64_t nv = (oo + N + V - 1) / V;  // the row's vectors
      cnt = max(int64_t(0), min(SV, nv - j0));
      if (j0 == 0 && oo > 0) qh = 0;
      if (cnt > 0 && j0 + cnt == nv && (oo + N) % V != 0) qt = cnt - 1;
    }
    const int64_t qe = qt >= 0 ? qt : cnt;
    const int64_t q0 = tid <= qh ? tid + kSmThreads : tid;  // this thread's first vector of [qh + 1, qe)
    const uint4* asrc = reinterpret_cast<const uint4*>(arow - oo) + j0;
    const uint4* bsrc = BWD ? reinterpret_cast<const uint4*>(brow - oo) + j0 : nullptr;
    uint4* dst = reinterpret_cast<uint4*>(orow - oo) + j0;
    // fn(q) for the edge vectors qh, qt on their owner threads.
    auto edges = [&](auto&& fn) {
      if constexpr (!ALIGNED) {
        if (qh >= 0 && tid == 0) fn(qh);
        if (qt > qh && tid == int(qt % kSmThreads)) fn(qt);
      }
    };
    // An edge vector's elements, `fill` outside the row.
    auto edge_get = [&](const uint4* buf, int64_t q, A(&v)[V], A fill) {
      const T* p = reinterpret_cast<const T*>(buf + q);
      const int64_t e0 = (j0 + q) * V - oo;
#pragma unroll
      for (int k = 0; k < V; ++k) v[k] = e0 + k >= 0 && e0 + k < N ? to_acc<A>(p[k]) : fill;
    };
    auto edge_put = [&](int64_t q, const A(&v)[V]) {
      const int64_t e0 = (j0 + q) * V - oo;
#pragma unroll
      for (int k = 0; k < V; ++k)
        if (e0 + k >= 0 && e0 + k < N) orow[e0 + k] = from_acc<T>(v[k]);
    };
    // The last vector, where the row ends inside it, may run past the end of the
    // allocation (the last row of a tensor whose size is not a multiple of 16
    // bytes): its owner copies the row's elements of it one by one. The first
    // vector is copied whole: its bytes before the row lie inside the allocation.
    edges([&](int64_t q) {
      if (q != qt) return;
      T* pa = reinterpret_cast<T*>(abuf + q);
      T* pb = reinterpret_cast<T*>(bbuf + q);
      const int64_t e0 = (j0 + q) * V - oo;
#pragma unroll
      for (int k = 0; k < V; ++k)
        if (e0 + k >= 0 && e0 + k < N) {
          pa[k] = arow[e0 + k];
          if (BWD) pb[k] = brow[e0 + k];
        }
    });
    if constexpr (BULK) {
      if (cnt > 0) {  // block-uniform
        if (tid == 0) {
          mbar_arrive_expect(&bar, unsigned(qe * (BWD ? 32 : 16)));
          if (qe > 0) {
            bulk_load(abuf, asrc, unsigned(qe * 16), &bar);
            if (BWD) bulk_load(bbuf, bsrc, unsigned(qe * 16), &bar);
          }
        }
        mbar_wait(&bar, phase);
        phase ^= 1u;
      }
    } else {
      for (int64_t q = tid; q < qe; q += kSmThreads) {
        cp_async16(&abuf[q], asrc + q);
        if (BWD) cp_async16(&bbuf[q], bsrc + q);
      }
      cp_async_commit();
      cp_async_wait<0>();
    }
    if constexpr (!BWD) {
      A m = neg_inf<A>();
#pragma unroll 4
      for (int64_t q = q0; q < qe; q += kSmThreads) {
        Vec<T, V> r;
        r.q[0] = abuf[q];
#pragma unroll
        for (int k = 0; k < V; ++k) m = max_a(m, to_acc<A>(r.e[k]));
      }
      edges([&](int64_t q) {
        A v[V];
        edge_get(abuf, q, v, neg_inf<A>());
#pragma unroll
        for (int k = 0; k < V; ++k) m = max_a(m, v[k]);
      });
      m = warp_max(m);
      const A shift = m == neg_inf<A>() ? A(0) : m;  // an empty warp: see cluster_fwd_kernel
      const ExpShift<T> ex(shift);
      A s = A(0);
#pragma unroll 4
      for (int64_t q = q0; q < qe; q += kSmThreads) {
        Vec<T, V> r;
        r.q[0] = abuf[q];
#pragma unroll
        for (int k = 0; k < V; ++k) s += ex(to_acc<A>(r.e[k]));
      }
      edges([&](int64_t q) {
        A v[V];
        edge_get(abuf, q, v, neg_inf<A>());
#pragma unroll
        for (int k = 0; k < V; ++k) s += ex(v[k]);  // outside the row: exp(-inf) = 0
      });
      A M, S;
      exchange_pair(cluster, wred, part[parity], CS, lane, w, kSmThreads / 32, shift, warp_sum(s), M, S);
      const A nan = A(NAN);
      const A mul = S == A(0) ? nan : (LOG ? log_a(S) : A(1) / S);  // an all -inf row: NaN, as torch
      const ExpShift<T> exm(M);
#pragma unroll 4
      for (int64_t q = q0; q < qe; q += kSmThreads) {
        Vec<T, V> r, y;
        r.q[0] = abuf[q];
#pragma unroll
        for (int k = 0; k < V; ++k) {
          const A x = to_acc<A>(r.e[k]);
          y.e[k] = from_acc<T>(LOG ? (x - M) - mul : exm(x) * mul);
        }
        __stcs(dst + q, y.q[0]);
      }
      edges([&](int64_t q) {
        A v[V];
        edge_get(abuf, q, v, A(0));
#pragma unroll
        for (int k = 0; k < V; ++k) v[k] = LOG ? (v[k] - M) - mul : exm(v[k]) * mul;
        edge_put(q, v);
      });
    } else {
      // softmax: dx = y (dy - sum(dy y));  log_softmax: dx = dy - exp(y) sum(dy)
      A s = A(0);
#pragma unroll 2
      for (int64_t q = q0; q < qe; q += kSmThreads) {
        Vec<T, V> ry, rg;
        ry.q[0] = abuf[q];
        rg.q[0] = bbuf[q];
#pragma unroll
        for (int k = 0; k < V; ++k) s += LOG ? to_acc<A>(rg.e[k]) : to_acc<A>(rg.e[k]) * to_acc<A>(ry.e[k]);
      }
      edges([&](int64_t q) {
        A y[V], g[V];
        edge_get(abuf, q, y, A(0));
        edge_get(bbuf, q, g, A(0));
#pragma unroll
        for (int k = 0; k < V; ++k) s += LOG ? g[k] : g[k] * y[k];
      });
      s = warp_sum(s);
      if (lane == 0) wred[w][1] = s;
      __syncthreads();
      publish_block_sum(wred, part[parity], lane, w);
      cluster.sync();  // every block's sum visible; this row's wred reads done
      A M, S;
      cluster_pair<true>(cluster, part[parity], CS, M, S);
#pragma unroll 2
      for (int64_t q = q0; q < qe; q += kSmThreads) {
        Vec<T, V> ry, rg, d;
        ry.q[0] = abuf[q];
        rg.q[0] = bbuf[q];
#pragma unroll
        for (int k = 0; k < V; ++k) {
          const A y = to_acc<A>(ry.e[k]), g = to_acc<A>(rg.e[k]);
          d.e[k] = from_acc<T>(LOG ? g - exp_a(y) * S : y * (g - S));
        }
        __stcs(dst + q, d.q[0]);
      }
      edges([&](int64_t q) {
        A y[V], g[V];
        edge_get(abuf, q, y, A(0));
        edge_get(bbuf, q, g, A(0));
#pragma unroll
        for (int k = 0; k < V; ++k) y[k] = LOG ? g[k] - exp_a(y[k]) * S : y[k] * (g[k] - S);
        edge_put(q, y);
      });
    }
    // BULK: the next row's copy overwrites every thread's vectors. cp.async: each
    // thread overwrites only its own, after its own reads.
    if (BULK) __syncthreads();
  }
  cluster.sync();  // no block exits while another may still read its `part`
#endif
}

template <typename T, int K>
auto staged_rows_kernel_for(bool log) {
  return log ? staged_rows_fwd_kernel<T, true, K> : staged_rows_fwd_kernel<T, false, K>;
}
template <typename T, bool BWD, bool LOG, bool BULK>
const void* smem_rows_kernel_of(int align) {  // align: Plan::align
  return align == 0   ? reinterpret_cast<const void*>(smem_own_rows_kernel<T, LOG, BWD, BULK, true>)
         : align == 1 ? reinterpret_cast<const void*>(smem_own_rows_kernel<T, LOG, BWD, BULK, false>)
                      : reinterpret_cast<const void*>(smem_rows_kernel<T, LOG, BWD, BULK>);
}
template <typename T, bool BWD>
const void* smem_rows_kernel_for(bool log, bool bulk, int align) {
  return log ? (bulk ? smem_rows_kernel_of<T, BWD, true, true>(align) : smem_rows_kernel_of<T, BWD, true, false>(align))
             : (bulk ? smem_rows_kernel_of<T, BWD, false, true>(align)
                     : smem_rows_kernel_of<T, BWD, false, false>(align));
}

// The shared-memory row kernel of plan p (p.align: which of the three).
template <typename T, bool BWD, bool LOG, bool BULK>
cudaError_t launch_smem_rows_of(const SoftmaxArgs& a, const Plan& p, cudaStream_t st) {
  const auto [A_, B_, O] = typed_ptrs<T>(a);
  const int64_t rows = a.outer, N = a.N;
  if (p.align == 0)
    return launch_staged(smem_own_rows_kernel<T, LOG, BWD, BULK, true>, p, rows, st, A_, B_, O, rows, N, a.la, a.lb,
                         p.sv);
  if (p.align == 1)
    return launch_staged(smem_own_rows_kernel<T, LOG, BWD, BULK, false>, p, rows, st, A_, B_, O, rows, N, a.la, a.lb,
                         p.sv);
  return launch_staged(smem_rows_kernel<T, LOG, BWD, BULK>, p, rows, st, A_, B_, O, rows, N, a.la, a.lb, p.sv, p.sb);
}
template <typename T, bool BWD>
cudaError_t launch_smem_rows(const SoftmaxArgs& a, const Plan& p, cudaStream_t st) {
  return a.log ? (p.bulk ? launch_smem_rows_of<T, BWD, true, true>(a, p, st)
                         : launch_smem_rows_of<T, BWD, true, false>(a, p, st))
               : (p.bulk ? launch_smem_rows_of<T, BWD, false, true>(a, p, st)
                         : launch_smem_rows_of<T, BWD, false, false>(a, p, st));
}

template <typename T, bool BWD>
cudaError_t launch_cluster_typed(const SoftmaxArgs& a, const Plan& p, cudaStream_t st) {
  const auto [A_, B_, O] = typed_ptrs<T>(a);
  const int64_t rows = a.outer, N = a.N;
  const bool vec = vec_ok(a, BWD);
  switch (p.kind) {
    case Kind::ClusterRows:
    case Kind::ClusterFwd: {
      cudaLaunchConfig_t cfg{};
      // Grid-stride over the rest.
      const int64_t clusters = std::min<int64_t>(rows, p.kind == Kind::ClusterRows ? 4096 : kMaxGrid / kClusterMax);
      cfg.gridDim = dim3(unsigned(clusters * p.S));
      cfg.blockDim = dim3(unsigned(p.threads));
      cfg.stream = st;
      cudaLaunchAttribute attr[1] = {cluster_attr(p.S)};
      cfg.attrs = attr;
      cfg.numAttrs = 1;
      if constexpr (sizeof(T) <= 4) {  // the plan never picks them for float64
        if (p.kind == Kind::ClusterRows)
          return cudaLaunchKernelEx(&cfg, cluster_rows_kernel<T, BWD>, A_, B_, O, rows, N, a.la, a.lb, a.log, vec);
        if constexpr (!BWD)
          return cudaLaunchKernelEx(&cfg, a.log ? cluster_fwd_kernel<T, true> : cluster_fwd_kernel<T, false>, A_, O,
                                    rows, N, a.la, vec);
      }
      return cudaErrorInvalidValue;  // ClusterFwd: forward, 2- and 4-byte types only
    }
    case Kind::StagedRows:
      if constexpr (!BWD && sizeof(T) <= 4)
        return p.ch == 8
                   ? launch_staged(staged_rows_kernel_for<T, 8>(a.log), p, rows, st, A_, O, rows, N, a.la, p.stages)
                   : launch_staged(staged_rows_kernel_for<T, 4>(a.log), p, rows, st, A_, O, rows, N, a.la, p.stages);
      return cudaErrorInvalidValue;  // forward, 2- and 4-byte types only
    case Kind::SmemRows:
      if constexpr (sizeof(T) <= 4) return launch_smem_rows<T, BWD>(a, p, st);
      return cudaErrorInvalidValue;  // 2- and 4-byte types only
    default:
      break;
  }
  return cudaErrorInvalidValue;  // not a kernel of this file
}

}  // namespace

namespace softmax_detail {

cudaError_t launch_cluster_rows(const SoftmaxArgs& a, const Plan& p, cudaStream_t st, bool bwd) {
  return dispatch_typed(a, bwd, [&](auto tag, auto bwd_c) {
    return launch_cluster_typed<decltype(tag), decltype(bwd_c)::value>(a, p, st);
  });
}

const void* cluster_rows_kernel_handle(bool bwd) {
  return bwd ? reinterpret_cast<const void*>(cluster_rows_kernel<float, true>)
             : reinterpret_cast<const void*>(cluster_rows_kernel<float, false>);
}

const void* cluster_fwd_kernel_handle() { return reinterpret_cast<const void*>(cluster_fwd_kernel<float, false>); }

const void* staged_rows_kernel_handle(DType dt, bool log, int K) {
  return dispatch_dtype(dt, [&](auto tag) -> const void* {
    using T = decltype(tag);
    if constexpr (sizeof(T) > 4) {
      return nullptr;
    } else {
      return K == 8 ? reinterpret_cast<const void*>(staged_rows_kernel_for<T, 8>(log))
                    : reinterpret_cast<const void*>(staged_rows_kernel_for<T, 4>(log));
    }
  });
}

const void* smem_rows_kernel_handle(DType dt, bool log, bool bulk, bool bwd, int align) {
  return dispatch_dtype(dt, [&](auto tag) -> const void* {
    using T = decltype(tag);
    if constexpr (sizeof(T) > 4) {
      return nullptr;
    } else {
      return bwd ? smem_rows_kernel_for<T, true>(log, bulk, align) : smem_rows_kernel_for<T, false>(log, bulk, align);
    }
  });
}

}  // namespace softmax_detail
}  // namespace gpu_puzzles
