// LayerNorm and the fused LayerNorm+Linear pieces on CUDA.
//   forward  : one block per row (one warp per row for short rows); the row is
//              held in registers (16-byte loads, all issued before any sum),
//              so mean and variance are an exact two-pass in fp32 (fp64 for
//              float64) at one read of x. Rows too long for registers, or
//              unaligned, use a looping kernel that re-reads x.
//   backward : persistent blocks, each walks rows and keeps its dgamma/dbeta
//              partial sums per owned column in registers; a second kernel sums
//              the per-block partials in a fixed order (deterministic).
//   fused    : the GEMM x @ Wc^T runs in cuBLAS (host side); here we fold gamma
//              and beta into W/b and apply the per-row statistics in an
//              in-place epilogue, so the normalised x is never written. On
//              sm_90a the GEMM and the statistics are one CUTLASS kernel
//              (lnlinear_evt_sm90.cu); the epilogue here then only fixes the
//              large-mean rows (FIXUP_ONLY).
// Index arithmetic is 64-bit: M*H and M*N may exceed 2^31.
#include <cstring>
#include <initializer_list>
#include <type_traits>

#include "common/device.cuh"
#include "common/func_attr.h"
#include "layernorm_linear/layernorm_linear.h"

namespace gpu_puzzles {
namespace {

constexpr int kCache = 4;  // vectors per thread held in registers by the cached kernels
// Widest blocks of the cached kernels: with launch bounds their registers always
// fit an SM (the backward keeps ~150 per thread for bf16); longer rows loop.
constexpr int kFwdMaxThreads = 512;
constexpr int kBwdMaxThreads = 256;
constexpr int kBwdMaxThreadsNarrow = 512;  // one vector per thread (ln_bwd_cached with C == 1)

// Programmatic dependent launch (PDL, sm_90; the host's GPU_PUZZLES_LNLINEAR_PDL=0 turns
// it off): the forward's prep kernels let the GEMM after them launch as their last
// blocks start (its prologue overlaps their tail; the CUTLASS GEMM waits for them before
// reading anything), and the large-mean fix-up is launched early behind the GEMM and
// waits for it (pdl_wait) before touching memory. Without a PDL launch on the other
// side both are no-ops.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

template <typename A> __device__ __forceinline__ A rsqrt_acc(A v) { return A(1) / sqrt(v); }
template <> __device__ __forceinline__ float rsqrt_acc<float>(float v) { return rsqrtf(v); }

// Row statistics, corrected two-pass: the first pass gives mu1 (shifted by x[0]); the
// second sums e = sum(x - mu1) and q = sum((x - mu1)^2). mu1 alone is off by
// ~eps_acc * |x[0] - mean| when x[0] is far out; e corrects it. The variance
// q/H - (e/H)^2 can round just below 0 on a constant row: clamped, so eps = 0 gives
// inf (as torch), not NaN.
template <typename A>
__device__ __forceinline__ void finish_stats(A mu1, A e, A q, int64_t H, double eps, A& mu, A& rs) {
  const A de = e / A(H);
  const A var = q / A(H) - de * de;
  mu = mu1 + de;
  rs = rsqrt_acc<A>((var > A(0) ? var : A(0)) + A(eps));
}

// VEC consecutive elements, 16-byte accesses when VEC * sizeof(T) is a multiple of 16.
// Loads: kNc through the read-only path (__ldg); kCoherent through the ordinary path
// (z, which the epilogue updates in place); kStream read-only and not allocated in L1.
// Stores: kStream is marked evict-first (st.global.cs). The streaming forms are for data
// touched once (the forward's x rows and y), so neither displaces gamma/beta, which every
// row re-reads (H100, layer_norm 8192x4096 bf16: 0.0515 -> 0.0503 ms,
// benchmarks/results/layer_norm_h100.txt).
enum class Ld { kNc, kCoherent, kStream };
enum class St { kDefault, kStream };

template <typename T, int VEC, Ld P = Ld::kNc>
__device__ __forceinline__ void load_pack(T (&d)[VEC], const T* p) {
  if constexpr ((VEC * sizeof(T)) % 16 == 0) {
#pragma unroll
    for (int i = 0; i < (int)(VEC * sizeof(T) / 16); ++i) {
      const uint4* src = reinterpret_cast<const uint4*>(p) + i;
      uint4 q;
      if constexpr (P == Ld::kStream)
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(q.x), "=r"(q.y), "=r"(q.z), "=r"(q.w)
                     : "l"(src));
      else if constexpr (P == Ld::kCoherent)
        q = *src;
      else
        q = __ldg(src);
      memcpy(reinterpret_cast<char*>(d) + 16 * i, &q, 16);
    }
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) d[i] = p[i];
  }
}

template <typename T, int VEC, St P = St::kDefault>
__device__ __forceinline__ void store_pack(T* __restrict__ p, const T (&d)[VEC]) {
  if constexpr ((VEC * sizeof(T)) % 16 == 0) {
#pragma unroll
    for (int i = 0; i < (int)(VEC * sizeof(T) / 16); ++i) {
      uint4 q;
      memcpy(&q, reinterpret_cast<const char*>(d) + 16 * i, 16);
      if constexpr (P == St::kStream)
        asm volatile("st.global.cs.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(reinterpret_cast<uint4*>(p) + i), "r"(q.x),
                     "r"(q.y), "r"(q.z), "r"(q.w)
                     : "memory");
      else
        reinterpret_cast<uint4*>(p)[i] = q;
    }
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) p[i] = d[i];
  }
}

// Sum of each of v[0..K) over the block (blockDim.x a multiple of 32, every thread
// calls). Every warp reduces the same 32 partials in the same order, so all threads
// get the same bits without a broadcast barrier. `sh` holds 32*K elements; the
// leading barrier protects its previous use.
template <typename A, int K>
__device__ __forceinline__ void block_sum_n(A (&v)[K], A* sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
  for (int j = 0; j < K; ++j) v[j] = warp_sum(v[j]);
  __syncthreads();
  if (lane == 0) {
#pragma unroll
    for (int j = 0; j < K; ++j) sh[32 * j + warp] = v[j];
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < K; ++j) v[j] = warp_sum(lane < nw ? sh[32 * j + lane] : A(0));
}

// Sum of a and b over the block (block_sum_n with K = 2; `sh` holds 64).
template <typename A>
__device__ __forceinline__ void block_sum2(A& a, A& b, A* sh) {
  A v[2] = {a, b};
  block_sum_n<A, 2>(v, sh);
  a = v[0];
  b = v[1];
}

// ---- forward -----------------------------------------------------------------

// Per-vector arithmetic of the LayerNorm forward, shared by its row kernels
// (ln_row_cached, warp_row_stats, ln_fwd_loop, ln_fwd_warp) and the backward's xn
// output. First pass: s += x - pivot. Second pass about mu1 (finish_stats):
// e += x - mu1, q += (x - mu1)^2. normalise: o = (x - mu) * rs * gamma + beta at
// vector column c.
template <typename T, int VEC>
__device__ __forceinline__ void sum_shifted(const T (&v)[VEC], acc_t<T> pivot, acc_t<T>& s) {
#pragma unroll
  for (int i = 0; i < VEC; ++i) s += to_acc<acc_t<T>>(v[i]) - pivot;
}

template <typename T, int VEC>
__device__ __forceinline__ void sum_centred(const T (&v)[VEC], acc_t<T> mu1, acc_t<T>& e, acc_t<T>& q) {
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    const acc_t<T> d = to_acc<acc_t<T>>(v[i]) - mu1;
    e += d;
    q += d * d;
  }
}

template <typename T, int VEC>
__device__ __forceinline__ void normalise(const T (&v)[VEC], acc_t<T> mu, acc_t<T> rs, const T* __restrict__ gamma,
                                          const T* __restrict__ beta, int64_t c, T (&o)[VEC]) {
  using A = acc_t<T>;
  T g[VEC], b[VEC];
  load_pack<T, VEC>(g, gamma + c * VEC);
  load_pack<T, VEC>(b, beta + c * VEC);
#pragma unroll
  for (int i = 0; i < VEC; ++i) o[i] = from_acc<T>((to_acc<A>(v[i]) - mu) * rs * to_acc<A>(g[i]) + to_acc<A>(b[i]));
}

// One row of LayerNorm held in registers by one block (blockDim.x threads, kCache
// vectors each; the caller sizes the block so the row fits). y null: statistics only.
template <typename T, int VEC>
__device__ __forceinline__ void ln_row_cached(int64_t row, const T* __restrict__ x, const T* __restrict__ gamma,
                                              const T* __restrict__ beta, T* __restrict__ y,
                                              acc_t<T>* __restrict__ mean, acc_t<T>* __restrict__ rstd, int64_t H,
                                              double eps, acc_t<T>* sh) {
  using A = acc_t<T>;
  const int64_t nvec = H / VEC;
  const T* xr = x + row * H;
  T v[kCache][VEC];
  // Sum x - x[0]: a shift close to the mean keeps the partial sums small, so
  // a large mean costs no accuracy in the first pass.
  const A pivot = to_acc<A>(xr[0]);
  // Every load issued before any sum: summing inside the guarded load loop made
  // each vector wait for its own load, one in flight per thread (H100, 8192x4096
  // bf16, standalone: 0.0571 -> 0.0503 ms; statistics only 0.0345 -> 0.0271).
#pragma unroll
  for (int k = 0; k < kCache; ++k) {
    const int64_t c = threadIdx.x + (int64_t)k * blockDim.x;
    if (c < nvec) load_pack<T, VEC, Ld::kStream>(v[k], xr + c * VEC);
  }
  A s = 0, unused = 0;
#pragma unroll
  for (int k = 0; k < kCache; ++k) {
    const int64_t c = threadIdx.x + (int64_t)k * blockDim.x;
    if (c < nvec) sum_shifted<T, VEC>(v[k], pivot, s);
  }
  block_sum2(s, unused, sh);
  const A mu1 = pivot + s / A(H);
  A q = 0, e = 0;  // second pass about mu1 (finish_stats)
#pragma unroll
  for (int k = 0; k < kCache; ++k) {
    const int64_t c = threadIdx.x + (int64_t)k * blockDim.x;
    if (c < nvec) sum_centred<T, VEC>(v[k], mu1, e, q);
  }
  block_sum2(q, e, sh);
  A mu, rs;
  finish_stats(mu1, e, q, H, eps, mu, rs);
  if (threadIdx.x == 0) {
    mean[row] = mu;
    rstd[row] = rs;
  }
  if (y != nullptr) {
#pragma unroll
    for (int k = 0; k < kCache; ++k) {
      const int64_t c = threadIdx.x + (int64_t)k * blockDim.x;
      if (c < nvec) {
        T o[VEC];
        normalise<T, VEC>(v[k], mu, rs, gamma, beta, c, o);
        store_pack<T, VEC, St::kStream>(y + row * H + c * VEC, o);
      }
    }
  }
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kFwdMaxThreads) ln_fwd_cached(const T* __restrict__ x, const T* __restrict__ gamma,
                              const T* __restrict__ beta, T* __restrict__ y, acc_t<T>* __restrict__ mean,
                              acc_t<T>* __restrict__ rstd, int64_t M, int64_t H, double eps) {
  __shared__ acc_t<T> sh[64];
  for (int64_t row = blockIdx.x; row < M; row += gridDim.x)
    ln_row_cached<T, VEC>(row, x, gamma, beta, y, mean, rstd, H, eps, sh);
}

// Mean and rstd of one row held by one warp: lane l loads vectors l, l + 32, ... (NV
// slots, those < nvec) into v, which the caller keeps. Same arithmetic as ln_row_cached
// (pivot shift, corrected two-pass from registers), warp shuffles only. STREAM: the loads
// skip L1 (rows read once). Every lane gets mu and rs.
template <bool STREAM, typename T, int VEC, int NV>
__device__ __forceinline__ void warp_row_stats(const T* __restrict__ xr, T (&v)[NV][VEC], int lane, int64_t nvec,
                                               int64_t H, double eps, acc_t<T>& mu, acc_t<T>& rs) {
  using A = acc_t<T>;
  const A pivot = to_acc<A>(xr[0]);
#pragma unroll
  for (int k = 0; k < NV; ++k) {  // all loads before any sum (see ln_row_cached)
    const int64_t c = lane + (int64_t)k * 32;
    if (c < nvec) {
      if constexpr (STREAM)
        load_pack<T, VEC, Ld::kStream>(v[k], xr + c * VEC);
      else
        load_pack<T, VEC>(v[k], xr + c * VEC);
    }
  }
  A s = 0;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t c = lane + (int64_t)k * 32;
    if (c < nvec) sum_shifted<T, VEC>(v[k], pivot, s);
  }
  s = warp_sum(s);
  const A mu1 = pivot + s / A(H);
  A q = 0, e = 0;  // second pass about mu1 (finish_stats)
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t c = lane + (int64_t)k * 32;
    if (c < nvec) sum_centred<T, VEC>(v[k], mu1, e, q);
  }
  finish_stats(mu1, warp_sum(e), warp_sum(q), H, eps, mu, rs);
}

// Short rows (at most 32 * kCache vectors: H <= 1024 in bf16): one warp per row,
// kWarpRows rows per block, the row in registers, warp shuffles only (no barrier,
// no shared memory). The block-per-row kernel would run one-warp blocks here, and
// the SM's 32-block limit would cap it at half occupancy, halving the loads in
// flight. Same arithmetic as ln_row_cached (pivot shift, exact two-pass).
constexpr int kWarpRows = 8;

template <typename T, int VEC>
__global__ void __launch_bounds__(32 * kWarpRows, 6) ln_fwd_warp(const T* __restrict__ x, const T* __restrict__ gamma,
                              const T* __restrict__ beta, T* __restrict__ y, acc_t<T>* __restrict__ mean,
                              acc_t<T>* __restrict__ rstd, int64_t M, int64_t H, double eps) {
  using A = acc_t<T>;
  const int lane = threadIdx.x & 31;
  const int64_t nvec = H / VEC;
  // row is warp-uniform: every lane of a warp runs the same iterations (full-mask shuffles).
  for (int64_t row = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); row < M;
       row += (int64_t)gridDim.x * (blockDim.x >> 5)) {
    T v[kCache][VEC];
    A mu, rs;
    warp_row_stats<false>(x + row * H, v, lane, nvec, H, eps, mu, rs);
    if (lane == 0) {
      mean[row] = mu;
      rstd[row] = rs;
    }
    if (y != nullptr) {
#pragma unroll
      for (int k = 0; k < kCache; ++k) {
        const int64_t c = lane + (int64_t)k * 32;
        if (c < nvec) {
          T o[VEC];
          normalise<T, VEC>(v[k], mu, rs, gamma, beta, c, o);
          store_pack<T, VEC>(y + row * H + c * VEC, o);
        }
      }
    }
  }
}

// Any H: three passes over the row (the later ones mostly hit L1/L2).
template <typename T, int VEC>
__global__ void ln_fwd_loop(const T* __restrict__ x, const T* __restrict__ gamma,
                            const T* __restrict__ beta, T* __restrict__ y, acc_t<T>* __restrict__ mean,
                            acc_t<T>* __restrict__ rstd, int64_t M, int64_t H, double eps) {
  using A = acc_t<T>;
  __shared__ A sh[64];
  const int64_t nvec = H / VEC;
  for (int64_t row = blockIdx.x; row < M; row += gridDim.x) {
    const T* xr = x + row * H;
    const A pivot = to_acc<A>(xr[0]);  // see ln_row_cached
    A s = 0, unused = 0;
    for (int64_t c = threadIdx.x; c < nvec; c += blockDim.x) {
      T v[VEC];
      load_pack<T, VEC>(v, xr + c * VEC);
      sum_shifted<T, VEC>(v, pivot, s);
    }
    block_sum2(s, unused, sh);
    const A mu1 = pivot + s / A(H);
    A q = 0, e = 0;  // second pass about mu1 (finish_stats)
    for (int64_t c = threadIdx.x; c < nvec; c += blockDim.x) {
      T v[VEC];
      load_pack<T, VEC>(v, xr + c * VEC);
      sum_centred<T, VEC>(v, mu1, e, q);
    }
    block_sum2(q, e, sh);
    A mu, rs;
    finish_stats(mu1, e, q, H, eps, mu, rs);
    if (threadIdx.x == 0) {
      mean[row] = mu;
      rstd[row] = rs;
    }
    if (y != nullptr) {
      for (int64_t c = threadIdx.x; c < nvec; c += blockDim.x) {
        T v[VEC], o[VEC];
        load_pack<T, VEC>(v, xr + c * VEC);
        normalise<T, VEC>(v, mu, rs, gamma, beta, c, o);
        store_pack<T, VEC>(y + row * H + c * VEC, o);
      }
    }
  }
}

// ---- backward ----------------------------------------------------------------

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * gamma.
// part: [2][gridDim.x][H] partial sums of dy*xhat (dgamma) and dy (dbeta).
// C vectors per thread; R rows per step: the loads of all R rows are issued before
// the one block reduction (2R sums), so a block keeps R rows of traffic in flight
// (H100, 8192x4096 bf16: one row per step 0.107 ms, two 0.095 ms). gamma is re-read
// (L1-resident) every step rather than held, to leave the registers to the rows.
// One vector per thread (C == 1): the next step's rows are loaded before this step's
// block reduction, so loads stay in flight through the barriers and the stores, where
// a block (one per SM at 512 threads) otherwise had none (H100, bf16, 8192x4096:
// 0.0928 -> 0.0839 ms, with xn and dx over dy 0.1223 -> 0.1139; 16384x1024, 128
// threads and several blocks per SM: 0.0476 -> 0.0471; outputs bitwise unchanged). With
// kCache vectors, or fp64, the second set of rows does not fit the registers.
// XN: also write xn = gamma * xhat + beta (the fused backward's dW operand), saving
// that backward a separate pass over x.
// dx may be dy (in place: the fused backward's dxn buffer): each element is read by the
// thread that writes it, before it writes it (a prefetch reads rows of later steps
// only); so neither pointer is __restrict__.
template <typename T, int VEC, int C, int R, bool XN>
__global__ void __launch_bounds__(C == 1 ? kBwdMaxThreadsNarrow : kBwdMaxThreads)
    ln_bwd_cached(const T* dy, const T* __restrict__ x, const T* __restrict__ gamma,
                  const acc_t<T>* __restrict__ mean, const acc_t<T>* __restrict__ rstd, T* dx,
                  acc_t<T>* __restrict__ part, const T* __restrict__ beta, T* __restrict__ xn, int64_t M, int64_t H) {
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
    T x[R][C][VEC], d[R][C][VEC];
    A mu[R], rs[R];
  };
  auto load_rows = [&](int64_t r, Rows& w) {
#pragma unroll
    for (int j = 0; j < R; ++j) {
      const bool live = r + j < M;  // block-uniform
      w.mu[j] = live ? mean[r + j] : A(0);
      w.rs[j] = live ? rstd[r + j] : A(0);
#pragma unroll
      for (int k = 0; k < C; ++k) {
        const int64_t c = threadIdx.x + (int64_t)k * blockDim.x;
        if (live && c < nvec) {
          load_pack<T, VEC>(w.x[j][k], x + (r + j) * H + c * VEC);
          load_pack<T, VEC>(w.d[j][k], dy + (r + j) * H + c * VEC);
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
    // This step's gamma vectors, all loaded before any arithmetic: loaded inside the
    // guarded loops below, each vector's arithmetic waited for its own load (H100,
    // 8192x4096 bf16 layer_norm backward 0.110 -> 0.104 ms). Held for the whole kernel
    // instead it took 210 registers, not 198, and slowed 16384x1024 (0.062 -> 0.0635).
    T gt[C][VEC];
#pragma unroll
    for (int k = 0; k < C; ++k) {
      const int64_t c = threadIdx.x + (int64_t)k * blockDim.x;
      if (c < nvec) load_pack<T, VEC>(gt[k], gamma + c * VEC);
    }
    A s[2 * R];
#pragma unroll
    for (int j = 0; j < 2 * R; ++j) s[j] = A(0);
    if (!kPrefetch) load_rows(r0, cur);
#pragma unroll
    for (int j = 0; j < R; ++j) {
      if (r0 + j >= M) break;
#pragma unroll
      for (int k = 0; k < C; ++k) {
        const int64_t c = threadIdx.x + (int64_t)k * blockDim.x;
        if (c < nvec) {
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            const A xh = (to_acc<A>(xv[j][k][i]) - mu[j]) * rs[j], d = to_acc<A>(dv[j][k][i]), g = to_acc<A>(gt[k][i]);
            s[2 * j] += d * g;
            s[2 * j + 1] += d * g * xh;
            pg[k][i] += d * xh;
            pb[k][i] += d;
          }
        }
      }
    }
    Rows next;  // the next step's rows (kPrefetch)
    if (kPrefetch && r0 + stride < M) load_rows(r0 + stride, next);
    block_sum_n<A, 2 * R>(s, sh);
#pragma unroll
    for (int j = 0; j < R; ++j) {
      if (r0 + j >= M) break;
      const A m1 = s[2 * j] / A(H), m2 = s[2 * j + 1] / A(H);
#pragma unroll
      for (int k = 0; k < C; ++k) {
        const int64_t c = threadIdx.x + (int64_t)k * blockDim.x;
        if (c < nvec) {
          T o[VEC];
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            const A xh = (to_acc<A>(xv[j][k][i]) - mu[j]) * rs[j];
            o[i] = from_acc<T>(rs[j] * (to_acc<A>(dv[j][k][i]) * to_acc<A>(gt[k][i]) - m1 - xh * m2));
          }
          store_pack<T, VEC>(dx + (r0 + j) * H + c * VEC, o);
          if constexpr (XN) {  // the LayerNorm output, as the forward's normalise computes it
            normalise<T, VEC>(xv[j][k], mu[j], rs[j], gamma, beta, c, o);
            store_pack<T, VEC>(xn + (r0 + j) * H + c * VEC, o);
          }
        }
      }
    }
    if constexpr (kPrefetch) cur = next;
  }
  A* pgr = part + (int64_t)blockIdx.x * H;
  A* pbr = part + ((int64_t)gridDim.x + blockIdx.x) * H;
#pragma unroll
  for (int k = 0; k < C; ++k) {
    const int64_t c = threadIdx.x + (int64_t)k * blockDim.x;
    if (c < nvec) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        pgr[c * VEC + i] = pg[k][i];
        pbr[c * VEC + i] = pb[k][i];
      }
    }
  }
}

// Any H: the block's partial rows live in `part` (each column owned by one thread).
// dx may be dy, as in ln_bwd_cached.
template <typename T>
__global__ void ln_bwd_loop(const T* dy, const T* __restrict__ x, const T* __restrict__ gamma,
                            const acc_t<T>* __restrict__ mean, const acc_t<T>* __restrict__ rstd,
                            T* dx, acc_t<T>* __restrict__ part, const T* __restrict__ beta,
                            T* __restrict__ xn, int64_t M, int64_t H) {
  using A = acc_t<T>;
  __shared__ A sh[64];
  A* pgr = part + (int64_t)blockIdx.x * H;
  A* pbr = part + ((int64_t)gridDim.x + blockIdx.x) * H;
  for (int64_t c = threadIdx.x; c < H; c += blockDim.x) {
    pgr[c] = A(0);
    pbr[c] = A(0);
  }
  for (int64_t row = blockIdx.x; row < M; row += gridDim.x) {
    const A mu = mean[row], rs = rstd[row];
    const T* xr = x + row * H;
    const T* dr = dy + row * H;
    A s1 = 0, s2 = 0;
    for (int64_t c = threadIdx.x; c < H; c += blockDim.x) {
      const A xh = (to_acc<A>(xr[c]) - mu) * rs, d = to_acc<A>(dr[c]), gd = d * to_acc<A>(gamma[c]);
      s1 += gd;
      s2 += gd * xh;
      pgr[c] += d * xh;
      pbr[c] += d;
    }
    block_sum2(s1, s2, sh);
    const A m1 = s1 / A(H), m2 = s2 / A(H);
    for (int64_t c = threadIdx.x; c < H; c += blockDim.x) {
      const A xh = (to_acc<A>(xr[c]) - mu) * rs;
      dx[row * H + c] = from_acc<T>(rs * (to_acc<A>(dr[c]) * to_acc<A>(gamma[c]) - m1 - xh * m2));
      if (xn != nullptr) {
        T o[1];
        normalise<T, 1>({xr[c]}, mu, rs, gamma, beta, c, o);
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

// ---- fused LayerNorm + Linear: fold and epilogue --------------------------------

// The fold's arithmetic on one VEC-vector w of W's row at vector column c, shared by
// fold_weight, lnlinear_prep and fold_row_cached (they differ in how a row is spread
// over threads and reduced). First pass: sg += w.gamma, sb += w.beta. Second pass, with
// m = mean(w * gamma) over the row: wc = w * gamma - m (rounded to T), rs += wc as stored.
template <typename T, int VEC>
__device__ __forceinline__ void fold_sums(const T (&w)[VEC], const T* __restrict__ gamma, const T* __restrict__ beta,
                                          int64_t c, acc_t<T>& sg, acc_t<T>& sb) {
  using A = acc_t<T>;
  T g[VEC], be[VEC];
  load_pack<T, VEC>(g, gamma + c * VEC);
  load_pack<T, VEC>(be, beta + c * VEC);
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    sg += to_acc<A>(w[i]) * to_acc<A>(g[i]);
    sb += to_acc<A>(w[i]) * to_acc<A>(be[i]);
  }
}

template <typename T, int VEC>
__device__ __forceinline__ void fold_store(const T (&w)[VEC], const T* __restrict__ gamma, int64_t c, acc_t<T> m,
                                           T* __restrict__ wc_row, acc_t<T>& rs) {
  using A = acc_t<T>;
  T g[VEC], o[VEC];
  load_pack<T, VEC>(g, gamma + c * VEC);
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    o[i] = from_acc<T>(to_acc<A>(w[i]) * to_acc<A>(g[i]) - m);
    rs += to_acc<A>(o[i]);
  }
  store_pack<T, VEC>(wc_row + c * VEC, o);  // not streamed: the GEMM reads wc next
}

template <typename T, int VEC>
__global__ void fold_weight(const T* __restrict__ W, const T* __restrict__ gamma, const T* __restrict__ beta,
                            const T* __restrict__ b, T* __restrict__ wc, acc_t<T>* __restrict__ r,
                            acc_t<T>* __restrict__ bp, int64_t N, int64_t H) {
  using A = acc_t<T>;
  __shared__ A sh[64];
  pdl_launch_dependents();
  const int64_t nvec = H / VEC;
  for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
    const T* wr = W + n * H;
    A sg = 0, sb = 0;
    for (int64_t c = threadIdx.x; c < nvec; c += blockDim.x) {
      T w[VEC];
      load_pack<T, VEC>(w, wr + c * VEC);
      fold_sums<T, VEC>(w, gamma, beta, c, sg, sb);
    }
    block_sum2(sg, sb, sh);
    const A m = sg / A(H);
    A rs = 0, unused = 0;
    for (int64_t c = threadIdx.x; c < nvec; c += blockDim.x) {
      T w[VEC];
      load_pack<T, VEC>(w, wr + c * VEC);
      fold_store<T, VEC>(w, gamma, c, m, wc + n * H, rs);
    }
    block_sum2(rs, unused, sh);
    if (threadIdx.x == 0) {
      r[n] = rs;
      bp[n] = sb + (b != nullptr ? to_acc<A>(b[n]) : A(0));
    }
  }
}

// Statistics of x and the fold of W in ONE launch (the fused forward's two
// bandwidth-bound passes before its GEMM). Warps walk "rows" 0 .. M+N-1: row i < M is
// x's row i (mean, rstd: warp_row_stats, as ln_fwd_warp), row M+n is W's row n (fold_weight's
// arithmetic). One warp per row, the row in registers (NV 16-byte vectors per lane),
// shuffles only: no barrier, so a warp never waits on another warp's loads. Apart,
// each pass ran latency-bound with its own tail (H100, bf16, 16384x1024 rows: stats
// alone 0.021 ms = 1.6 TB/s, fold 0.012 ms; see lnlinear_prep_variants.cu).
// Rows are ordered x first, W last, so the folded W is the most recent write when the
// GEMM starts reading it. Short rows only (<= 4 vectors per lane, H <= 1024 in bf16):
// with 16 per lane (H = 4096 bf16) it was slower than the two block-per-row passes
// (0.075 vs 0.062 ms at 8192x4096 + 4096x4096); longer rows take lnlinear_prep_rows.
// H100, 16384x1024 + 4096x1024: 0.0256 ms, 0.0201 since the loads come first.
constexpr int kPrepWarps = 8;
constexpr int kPrepMaxVecs = 4;  // per lane: 64 bytes of row in registers

template <typename T, int VEC, int NV>
__global__ void __launch_bounds__(32 * kPrepWarps, 4)
    lnlinear_prep(const T* __restrict__ x, const T* __restrict__ W, const T* __restrict__ gamma,
                  const T* __restrict__ beta, const T* __restrict__ b, acc_t<T>* __restrict__ mean,
                  acc_t<T>* __restrict__ rstd, T* __restrict__ wc, acc_t<T>* __restrict__ r,
                  acc_t<T>* __restrict__ bp, int64_t M, int64_t N, int64_t H, double eps) {
  using A = acc_t<T>;
  pdl_launch_dependents();
  const int lane = threadIdx.x & 31;
  const int64_t nvec = H / VEC;
  // row is warp-uniform: every lane runs the same iterations (full-mask shuffles).
  for (int64_t row = (int64_t)blockIdx.x * kPrepWarps + (threadIdx.x >> 5); row < M + N;
       row += (int64_t)gridDim.x * kPrepWarps) {
    T v[NV][VEC];
    if (row < M) {
      A mu, rs;
      warp_row_stats<true>(x + row * H, v, lane, nvec, H, eps, mu, rs);
      if (lane == 0) {
        mean[row] = mu;
        rstd[row] = rs;
      }
    } else {
      const int64_t n = row - M;
      const T* wr = W + n * H;
#pragma unroll
      for (int k = 0; k < NV; ++k) {  // all of W's loads before any sum (see ln_row_cached)
        const int64_t c = lane + (int64_t)k * 32;
        if (c < nvec) load_pack<T, VEC, Ld::kStream>(v[k], wr + c * VEC);
      }
      A sg = 0, sb = 0;
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        const int64_t c = lane + (int64_t)k * 32;
        if (c < nvec) fold_sums<T, VEC>(v[k], gamma, beta, c, sg, sb);
      }
      sg = warp_sum(sg);
      sb = warp_sum(sb);
      const A m = sg / A(H);
      A rs = 0;
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        const int64_t c = lane + (int64_t)k * 32;
        if (c < nvec) fold_store<T, VEC>(v[k], gamma, c, m, wc + n * H, rs);
      }
      rs = warp_sum(rs);
      if (lane == 0) {
        r[n] = rs;
        bp[n] = sb + (b != nullptr ? to_acc<A>(b[n]) : A(0));
      }
    }
  }
}

// Longer rows (up to kCache * kFwdMaxThreads vectors, bf16 H <= 16384): the same one
// launch with a block per row, each row in registers. Blocks [0, M) take x's rows
// (ln_row_cached, statistics only), blocks [M, M + N) W's rows (fold_row_cached:
// fold_weight's arithmetic with W read once). H100, 8192x4096 + 4096x4096 bf16,
// standalone: 0.0522 ms against 0.0560 for the two launches.
template <typename T, int VEC>
__device__ __forceinline__ void fold_row_cached(int64_t n, const T* __restrict__ W, const T* __restrict__ gamma,
                                                const T* __restrict__ beta, const T* __restrict__ b,
                                                T* __restrict__ wc, acc_t<T>* __restrict__ r,
                                                acc_t<T>* __restrict__ bp, int64_t H, acc_t<T>* sh) {
  using A = acc_t<T>;
  const int64_t nvec = H / VEC;
  const T* wr = W + n * H;
  T v[kCache][VEC];
#pragma unroll
  for (int k = 0; k < kCache; ++k) {  // all loads before any sum (see ln_row_cached)
    const int64_t c = threadIdx.x + (int64_t)k * blockDim.x;
    if (c < nvec) load_pack<T, VEC, Ld::kStream>(v[k], wr + c * VEC);
  }
  A sg = 0, sb = 0;
#pragma unroll
  for (int k = 0; k < kCache; ++k) {
    const int64_t c = threadIdx.x + (int64_t)k * blockDim.x;
    if (c < nvec) fold_sums<T, VEC>(v[k], gamma, beta, c, sg, sb);
  }
  block_sum2(sg, sb, sh);
  const A m = sg / A(H);
  A rs = 0, unused = 0;
#pragma unroll
  for (int k = 0; k < kCache; ++k) {
    const int64_t c = threadIdx.x + (int64_t)k * blockDim.x;
    if (c < nvec) fold_store<T, VEC>(v[k], gamma, c, m, wc + n * H, rs);
  }
  block_sum2(rs, unused, sh);
  if (threadIdx.x == 0) {
    r[n] = rs;
    bp[n] = sb + (b != nullptr ? to_acc<A>(b[n]) : A(0));
  }
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kFwdMaxThreads)
    lnlinear_prep_rows(const T* __restrict__ x, const T* __restrict__ W, const T* __restrict__ gamma,
                       const T* __restrict__ beta, const T* __restrict__ b, acc_t<T>* __restrict__ mean,
                       acc_t<T>* __restrict__ rstd, T* __restrict__ wc, acc_t<T>* __restrict__ r,
                       acc_t<T>* __restrict__ bp, int64_t M, int64_t N, int64_t H, double eps) {
  __shared__ acc_t<T> sh[64];
  pdl_launch_dependents();
  for (int64_t row = blockIdx.x; row < M + N; row += gridDim.x) {  // block-uniform branch
    if (row < M)
      ln_row_cached<T, VEC>(row, x, gamma, beta, nullptr, mean, rstd, H, eps, sh);
    else
      fold_row_cached<T, VEC>(row - M, W, gamma, beta, b, wc, r, bp, H, sh);
  }
}

// The fused backward's db[n] = sum_m dy[m,n]: fp32 partials part[chunk][N], then a
// fixed-order sum (ln_bwd_reduce): deterministic. A block is kColTx x kColTy threads:
// column vector tile blockIdx % gx (one VEC-vector per thread), the rows chunk, chunk +
// chunks, ... of chunk blockIdx / gx, kColUnroll rows' loads in flight per thread.
// Interleaved chunks make all blocks sweep dy together, from the last row down: the
// backward runs this after its dW GEMM, which read dy's rows in increasing order, so
// the sweep starts on the rows still in L2 (H100, bf16, 16384x1024x4096: 0.052 ms
// first in the backward, 0.041 here; 8192x4096x4096: 0.023 -> 0.021).
constexpr int kColTx = 64, kColTy = 4, kColUnroll = 8, kColChunks = 64;

template <typename T, int VEC>
__global__ void __launch_bounds__(kColTx * kColTy)
    lnlinear_colsum(const T* __restrict__ dy, acc_t<T>* __restrict__ part, int64_t gx, int64_t chunks, int64_t M,
                    int64_t N) {
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
      for (int u = 0; u < kColUnroll; ++u)
        load_pack<T, VEC, Ld::kStream>(q[u], dy + row(l + u * step) * N + cv * VEC);
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

// Columns x rows tiling: block (tx, ty) owns column tile tx (kEpiVecs vectors per
// thread, blockDim.x threads) and walks rows ty, ty + gridDim.y, ...  The per-column
// r and bp of its tile are loaded once into registers and reused for every row (the
// one-row-per-block form re-read them with scalar loads for every element: 16
// strided 4-byte loads per 16-byte z vector, ~8 L1 wavefronts each, which made the
// epilogue L1-bound at several times its DRAM time). The kEpiVecs z loads of a row
// are issued before any is used, for memory-level parallelism.
// Normal rows: y = rstd*(z - mean*r) + bp. Rows with a large mean (block-uniform
// branch): each warp recomputes the tile's outputs n as dot(normalised x row, W[n])
// + b[n] in the accumulate type.
// FIXUP_ONLY (after the sm_90a EVT GEMM, which already wrote y for every row): normal
// rows are skipped without touching z (only mean/rstd are read); large-mean rows are
// recomputed as above.
constexpr int kEpiVecs = 2;
constexpr int kEpiMaxThreads = 256;

template <typename T, int VEC, bool FIXUP_ONLY>
__global__ void __launch_bounds__(kEpiMaxThreads) lnlinear_epilogue(
    T* __restrict__ z, const T* __restrict__ x, const T* __restrict__ gamma, const T* __restrict__ beta,
    const T* __restrict__ W, const T* __restrict__ b, const acc_t<T>* __restrict__ mean,
    const acc_t<T>* __restrict__ rstd, const acc_t<T>* __restrict__ r, const acc_t<T>* __restrict__ bp, int64_t M,
    int64_t N, int64_t H) {
  using A = acc_t<T>;
  if constexpr (FIXUP_ONLY) pdl_wait();  // launched behind the GEMM that writes z (= y)
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int64_t nvec = N / VEC;
  const int64_t tile0 = (int64_t)blockIdx.x * blockDim.x * kEpiVecs;  // first vector of the tile
  A rr[kEpiVecs][VEC], bb[kEpiVecs][VEC];
#pragma unroll
  for (int k = 0; k < kEpiVecs; ++k) {
    const int64_t c = tile0 + threadIdx.x + (int64_t)k * blockDim.x;
    if (!FIXUP_ONLY && c < nvec) {
      load_pack<A, VEC>(rr[k], r + c * VEC);
      load_pack<A, VEC>(bb[k], bp + c * VEC);
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) rr[k][i] = bb[k][i] = A(0);
    }
  }
  const int64_t step = gridDim.y;
  for (int64_t row = blockIdx.y, k = 0; row < M; row += step, ++k) {
    if constexpr (FIXUP_ONLY) {
      // Mostly nothing to do: every blockDim.x rows of this block, one load per thread
      // finds out whether any of the next blockDim.x rows has a large mean, and skips
      // them all if none has (instead of one dependent mean/rstd load per row). The
      // loop and the barrier are block-uniform (row, k depend on blockIdx only).
      if (k % blockDim.x == 0) {
        const int64_t rt = row + (int64_t)threadIdx.x * step;
        bool big = false;
        if (rt < M) {
          const A m = mean[rt];
          big = (m < A(0) ? -m : m) * rstd[rt] > A(kLnLinearMaxMeanRatio);
        }
        if (!__syncthreads_or(big)) {
          row += (int64_t)(blockDim.x - 1) * step;
          k += blockDim.x - 1;
          continue;
        }
      }
    }
    const A mu = mean[row], rs = rstd[row];
    T* zr = z + row * N;
    if ((mu < A(0) ? -mu : mu) * rs > A(kLnLinearMaxMeanRatio)) {
      const T* xr = x + row * H;
      const int64_t n0 = tile0 * VEC, tile_end = (tile0 + (int64_t)blockDim.x * kEpiVecs) * VEC;
      const int64_t n1 = tile_end < N ? tile_end : N;
      for (int64_t n = n0 + warp; n < n1; n += nw) {
        const T* wr = W + n * H;
        A acc = 0;
        for (int64_t c = lane; c < H; c += 32)
          acc += ((to_acc<A>(xr[c]) - mu) * rs * to_acc<A>(gamma[c]) + to_acc<A>(beta[c])) * to_acc<A>(wr[c]);
        acc = warp_sum(acc);
        if (lane == 0) zr[n] = from_acc<T>(acc + (b != nullptr ? to_acc<A>(b[n]) : A(0)));
      }
    } else if constexpr (!FIXUP_ONLY) {
      T v[kEpiVecs][VEC];
#pragma unroll
      for (int k = 0; k < kEpiVecs; ++k) {
        const int64_t c = tile0 + threadIdx.x + (int64_t)k * blockDim.x;
        if (c < nvec) load_pack<T, VEC, Ld::kCoherent>(v[k], zr + c * VEC);
      }
#pragma unroll
      for (int k = 0; k < kEpiVecs; ++k) {
        const int64_t c = tile0 + threadIdx.x + (int64_t)k * blockDim.x;
        if (c < nvec) {
#pragma unroll
          for (int i = 0; i < VEC; ++i) v[k][i] = from_acc<T>(rs * (to_acc<A>(v[k][i]) - mu * rr[k][i]) + bb[k][i]);
          store_pack<T, VEC>(zr + c * VEC, v[k]);
        }
      }
    }
  }
}

// The curriculum's form: a single thread per row, everything serial.
template <typename T>
__global__ void lnlinear_naive(const T* __restrict__ x, const T* __restrict__ gamma, const T* __restrict__ beta,
                               const T* __restrict__ W, const T* __restrict__ b, T* __restrict__ y, int64_t M,
                               int64_t N, int64_t H, double eps) {
  using A = acc_t<T>;
  const int64_t row = blockIdx.x;
  if (row >= M || threadIdx.x != 0) return;
  const T* xr = x + row * H;
  // Sum x - x[0], not x: a constant row then gives mu == x[0] exactly and a zero
  // variance, instead of a rounding error that rstd (up to 1/sqrt(eps)) amplifies.
  const A k = to_acc<A>(xr[0]);
  A s = 0, q = 0;
  for (int64_t h = 0; h < H; ++h) s += to_acc<A>(xr[h]) - k;
  const A mu = k + s / A(H);
  for (int64_t h = 0; h < H; ++h) q += (to_acc<A>(xr[h]) - mu) * (to_acc<A>(xr[h]) - mu);
  const A rs = rsqrt_acc<A>(q / A(H) + A(eps));
  for (int64_t n = 0; n < N; ++n) {
    A acc = b != nullptr ? to_acc<A>(b[n]) : A(0);
    for (int64_t h = 0; h < H; ++h)
      acc += ((to_acc<A>(xr[h]) - mu) * rs * to_acc<A>(gamma[h]) + to_acc<A>(beta[h])) * to_acc<A>(W[n * H + h]);
    y[row * N + n] = from_acc<T>(acc);
  }
}

// ---- launch helpers --------------------------------------------------------------

// SMs of the current device (device_sm_count caches it per device: launchers ask on every
// call). A failed query clears the (non-sticky) error so the launcher's cudaGetLastError does
// not report it, and falls back to the H100's 132.
int sm_count() {
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  const int sms = e == cudaSuccess ? device_sm_count(dev, e) : 0;
  if (sms <= 0) {
    (void)cudaGetLastError();
    return 132;
  }
  return sms;
}

unsigned int row_grid(int64_t rows) {
  return static_cast<unsigned int>(rows < 1048576 ? rows : 1048576);  // grid-stride beyond
}

bool all_aligned(std::initializer_list<const void*> ps) {
  for (const void* p : ps)
    if (p != nullptr && (reinterpret_cast<uintptr_t>(p) & 15) != 0) return false;
  return true;
}

template <typename T> constexpr int vec_of() { return static_cast<int>(16 / sizeof(T)); }

// Threads for a cached kernel on rows of nvec vectors: whole warps, kCache vectors each.
int cached_threads(int64_t nvec) {
  int64_t t = (nvec + kCache - 1) / kCache;
  t = ((t + 31) / 32) * 32;
  return static_cast<int>(t < 32 ? 32 : t);
}

}  // namespace

LaunchStatus layer_norm_forward_cuda(const void* x, const void* gamma, const void* beta, void* y, void* mean,
                                     void* rstd, int64_t M, int64_t H, double eps, DType dtype,
                                     cudaStream_t stream) {
  if (M == 0) return cudaSuccess;
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    constexpr int V = vec_of<T>();
    const T *xp = static_cast<const T*>(x), *gp = static_cast<const T*>(gamma), *bp = static_cast<const T*>(beta);
    T* yp = static_cast<T*>(y);
    A *mp = static_cast<A*>(mean), *rp = static_cast<A*>(rstd);
    const bool vec = H % V == 0 && all_aligned({x, gamma, beta, y});
    const int64_t nvec = vec ? H / V : H;
    const unsigned grid = row_grid(M);
    if (nvec <= (int64_t)kCache * 32) {
      const unsigned wgrid = row_grid((M + kWarpRows - 1) / kWarpRows);
      if (vec)
        ln_fwd_warp<T, V><<<wgrid, 32 * kWarpRows, 0, stream>>>(xp, gp, bp, yp, mp, rp, M, H, eps);
      else
        ln_fwd_warp<T, 1><<<wgrid, 32 * kWarpRows, 0, stream>>>(xp, gp, bp, yp, mp, rp, M, H, eps);
    } else if (nvec <= (int64_t)kCache * kFwdMaxThreads) {
      const int threads = cached_threads(nvec);
      if (vec)
        ln_fwd_cached<T, V><<<grid, threads, 0, stream>>>(xp, gp, bp, yp, mp, rp, M, H, eps);
      else
        ln_fwd_cached<T, 1><<<grid, threads, 0, stream>>>(xp, gp, bp, yp, mp, rp, M, H, eps);
    } else if (vec) {
      ln_fwd_loop<T, V><<<grid, 1024, 0, stream>>>(xp, gp, bp, yp, mp, rp, M, H, eps);
    } else {
      ln_fwd_loop<T, 1><<<grid, 1024, 0, stream>>>(xp, gp, bp, yp, mp, rp, M, H, eps);
    }
    return 0;
  });
  return cudaGetLastError();
}

namespace {

// Backward plan: cached kernel or loop, threads, and a persistent grid of as many
// blocks as fit on the GPU at once (one wave), at most M.
struct BwdPlan {
  bool cached;
  bool vec;
  bool narrow;  // cached with one vector per thread (rows of at most kBwdNarrowVecs vectors)
  int threads;
  int64_t blocks;
};

// Rows per step of ln_bwd_cached: one vector per thread (narrow), kCache per thread.
constexpr int kBwdRowsNarrow = 4, kBwdRowsWide = 2;
constexpr int64_t kBwdNarrowVecs = kBwdMaxThreadsNarrow;  // rows of at most this many vectors: one per thread

// The kernel a plan runs. Rows up to 512 vectors
// take one vector per thread and 4 rows per step: fewer registers per row, more rows
// in flight (H100, bf16, dx/dgamma/dbeta without xn; benchmarks/lnlinear_prep_variants.cu):
//   8192x4096:  128 threads x 4 vectors, 2 rows 0.0986 ms; 512 x 1, 4 rows 0.0922
//   16384x1024: 128 x 1, 2 rows 0.0551;                    128 x 1, 4 rows 0.0477
// (4 vectors per thread put a 1024-wide bf16 row on one warp, each warp waiting alone on
// its loads: 0.074 ms there.) With xn written: 0.1212 -> 0.1120 and 0.0610 -> 0.0609.
// Prefetching the next step's rows (in ln_bwd_cached) came after these measurements.
// All have one signature; f gets KernelTag<kernel>, so the plan's occupancy query and the
// launch name the kernel in this one place.
template <auto K> struct KernelTag {
  static constexpr auto kernel = K;
};

template <typename T, class F>
auto with_bwd_kernel(bool cached, bool vec, bool narrow, bool xn, F&& f) {
  if (!cached) return f(KernelTag<&ln_bwd_loop<T>>{});
  auto pick = [&](auto vec_c, auto xn_c) {
    constexpr int VEC = decltype(vec_c)::value ? vec_of<T>() : 1;
    constexpr bool XN = decltype(xn_c)::value;
    return narrow ? f(KernelTag<&ln_bwd_cached<T, VEC, 1, kBwdRowsNarrow, XN>>{})
                  : f(KernelTag<&ln_bwd_cached<T, VEC, kCache, kBwdRowsWide, XN>>{});
  };
  using Y = std::true_type;
  using N = std::false_type;
  if (vec) return xn ? pick(Y{}, Y{}) : pick(Y{}, N{});
  return xn ? pick(N{}, Y{}) : pick(N{}, N{});
}

template <typename T>
BwdPlan bwd_plan(int64_t M, int64_t H, bool vec, bool xn) {
  constexpr int V = vec_of<T>();
  vec = vec && H % V == 0;
  const int64_t nvec = vec ? H / V : H;
  BwdPlan p{nvec <= (int64_t)kCache * kBwdMaxThreads, vec, nvec <= kBwdNarrowVecs, 512, 0};
  if (p.cached) p.threads = p.narrow ? static_cast<int>(((nvec + 31) / 32) * 32) : cached_threads(nvec);
  int per_sm = 0, dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess)  // cached per device and kernel: every backward call sizes its grid with it
    per_sm = with_bwd_kernel<T>(p.cached, vec, p.narrow, xn,
                                [&](auto k) { return blocks_per_sm<decltype(k)::kernel>(dev, p.threads, e); });
  if (e != cudaSuccess || per_sm < 1) {
    (void)cudaGetLastError();
    per_sm = 1;
  }
  int64_t g = (int64_t)per_sm * sm_count();
  // At least ~16 rows per block, so the partial sums stay a small part of the traffic.
  const int64_t by_rows = (M + 15) / 16 > sm_count() ? (M + 15) / 16 : sm_count();
  g = g < by_rows ? g : by_rows;
  // The cached kernel's blocks take R rows per step: no block without a row.
  const int64_t R = p.narrow ? kBwdRowsNarrow : kBwdRowsWide;
  const int64_t steps = p.cached ? (M + R - 1) / R : M;
  p.blocks = steps < g ? steps : g;
  return p;
}

}  // namespace

int64_t layer_norm_backward_blocks(int64_t M, int64_t H, DType dtype, bool xn) {
  // The workspace is sized for the vector plan; the scalar plan never needs more blocks
  // than it (fewer registers), but take the larger of the two to be safe.
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    const int64_t a = bwd_plan<T>(M, H, true, xn).blocks, b = bwd_plan<T>(M, H, false, xn).blocks;
    return a > b ? a : b;
  });
}

LaunchStatus layer_norm_backward_cuda(const void* dy, const void* x, const void* gamma, const void* mean,
                                      const void* rstd, void* dx, void* dgamma, void* dbeta, void* workspace,
                                      int64_t M, int64_t H, DType dtype, cudaStream_t stream, const void* beta,
                                      void* xn) {
  if (M == 0 || H == 0) return cudaSuccess;  // the host zero-fills dgamma/dbeta for M == 0
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    const T *dyp = static_cast<const T*>(dy), *xp = static_cast<const T*>(x), *gp = static_cast<const T*>(gamma);
    const A *mp = static_cast<const A*>(mean), *rp = static_cast<const A*>(rstd);
    T* dxp = static_cast<T*>(dx);
    A* part = static_cast<A*>(workspace);
    const T* bp = static_cast<const T*>(beta);
    T* xnp = static_cast<T*>(xn);
    const BwdPlan p =
        bwd_plan<T>(M, H, xn ? all_aligned({dy, x, gamma, dx, beta, xn}) : all_aligned({dy, x, gamma, dx}), xn != nullptr);
    const unsigned grid = static_cast<unsigned>(p.blocks);
    with_bwd_kernel<T>(p.cached, p.vec, p.narrow, xn != nullptr, [&](auto k) {
      constexpr auto kernel = decltype(k)::kernel;
      kernel<<<grid, p.threads, 0, stream>>>(dyp, xp, gp, mp, rp, dxp, part, bp, xnp, M, H);
      return 0;
    });
    ln_bwd_reduce<T><<<dim3(ceil_div_u(H, 32), 2), dim3(32, 8), 0, stream>>>(part, static_cast<T*>(dgamma),
                                                                            static_cast<T*>(dbeta), p.blocks, H);
    return 0;
  });
  return cudaGetLastError();
}

LaunchStatus lnlinear_fold_weight_cuda(const void* W, const void* gamma, const void* beta, const void* b, void* wc,
                                       void* r, void* bp, int64_t N, int64_t H, DType dtype, cudaStream_t stream) {
  if (N == 0) return cudaSuccess;
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    constexpr int V = vec_of<T>();
    auto launch = [&](auto kernel) {
      kernel<<<row_grid(N), 256, 0, stream>>>(static_cast<const T*>(W), static_cast<const T*>(gamma),
                                              static_cast<const T*>(beta), static_cast<const T*>(b),
                                              static_cast<T*>(wc), static_cast<A*>(r), static_cast<A*>(bp), N, H);
    };
    if (H % V == 0 && all_aligned({W, gamma, beta, wc}))
      launch(fold_weight<T, V>);
    else
      launch(fold_weight<T, 1>);
    return 0;
  });
  return cudaGetLastError();
}

LaunchStatus lnlinear_prep_cuda(const void* x, const void* W, const void* gamma, const void* beta, const void* b,
                                void* mean, void* rstd, void* wc, void* r, void* bp, int64_t M, int64_t N, int64_t H,
                                double eps, DType dtype, cudaStream_t stream) {
  if (M + N == 0) return cudaSuccess;
  const int status = dispatch_dtype(dtype, [&](auto tag) -> int {
    using T = decltype(tag);
    using A = acc_t<T>;
    constexpr int V = vec_of<T>();
    const int64_t nvec = H / V;
    // Rows that fit the registers, vector access: one launch (a warp per row for short
    // rows, a block per row for longer ones); otherwise the two passes.
    if (H == 0 || H % V != 0 || nvec > (int64_t)kCache * kFwdMaxThreads || !all_aligned({x, W, gamma, beta, wc}))
      return 1;
    auto launch = [&](auto kernel, unsigned grid, int threads) {
      kernel<<<grid, threads, 0, stream>>>(
          static_cast<const T*>(x), static_cast<const T*>(W), static_cast<const T*>(gamma),
          static_cast<const T*>(beta), static_cast<const T*>(b), static_cast<A*>(mean), static_cast<A*>(rstd),
          static_cast<T*>(wc), static_cast<A*>(r), static_cast<A*>(bp), M, N, H, eps);
    };
    if (nvec <= (int64_t)kPrepMaxVecs * 32)
      launch(lnlinear_prep<T, V, kPrepMaxVecs>, row_grid((M + N + kPrepWarps - 1) / kPrepWarps), 32 * kPrepWarps);
    else
      launch(lnlinear_prep_rows<T, V>, row_grid(M + N), cached_threads(nvec));
    return 0;
  });
  if (status != 0) {
    const LaunchStatus e = layer_norm_forward_cuda(x, gamma, beta, nullptr, mean, rstd, M, H, eps, dtype, stream);
    if (e != cudaSuccess) return e;
    return lnlinear_fold_weight_cuda(W, gamma, beta, b, wc, r, bp, N, H, dtype, stream);
  }
  return cudaGetLastError();
}

int64_t lnlinear_bias_grad_workspace(int64_t M, int64_t N) { return (M < kColChunks ? M : kColChunks) * N; }

LaunchStatus lnlinear_bias_grad_cuda(const void* dy, void* db, void* workspace, int64_t M, int64_t N, DType dtype,
                                     cudaStream_t stream) {
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
        launch(lnlinear_colsum<T, V>, V);
      else
        launch(lnlinear_colsum<T, 1>, 1);
    }
    // The partials' fixed-order sum: the LayerNorm backward's reducer, one output row (db);
    // M == 0 sums nothing (db = 0). (One thread per column, 64 serial loads each, took
    // 0.009 ms at N = 4096.)
    ln_bwd_reduce<T><<<dim3(ceil_div_u(N, 32), 1), dim3(32, 8), 0, stream>>>(part, static_cast<T*>(db), nullptr,
                                                                          chunks, N);
    return 0;
  });
  return cudaGetLastError();
}

namespace {

// Shared by the full epilogue and the large-mean fix-up (r, bp unused, may be null).
template <bool FIXUP_ONLY>
LaunchStatus epilogue_launch(void* z, const void* x, const void* gamma, const void* beta, const void* W,
                             const void* b, const void* mean, const void* rstd, const void* r, const void* bp,
                             int64_t M, int64_t N, int64_t H, DType dtype, cudaStream_t stream, bool pdl) {
  if (M == 0 || N == 0) return cudaSuccess;
  cudaError_t launch_err = cudaSuccess;
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    constexpr int V = vec_of<T>();
    // r and bp are loaded VEC at a time too (VEC * sizeof(A) is a multiple of 16).
    // The fix-up does no vector access; VEC only sets its column tile width there.
    const bool vec = N % V == 0 && (FIXUP_ONLY || all_aligned({z, r, bp}));
    const int64_t nvec = vec ? N / V : N;
    // Threads: whole warps, kEpiVecs vectors each, at most kEpiMaxThreads; column tiles
    // across grid.x; rows across grid.y, about one wave of resident blocks in all (each
    // block then walks M / grid.y rows, reusing its r/bp registers), at most M.
    int64_t t = (nvec + kEpiVecs - 1) / kEpiVecs;
    t = ((t + 31) / 32) * 32;
    const int threads = static_cast<int>(t < kEpiMaxThreads ? t : kEpiMaxThreads);
    const int64_t gx = (nvec + (int64_t)threads * kEpiVecs - 1) / ((int64_t)threads * kEpiVecs);
    const int64_t per_sm = 2048 / threads < 32 ? 2048 / threads : 32;
    int64_t gy = ((int64_t)sm_count() * per_sm + gx - 1) / gx;
    gy = gy < M ? gy : M;
    gy = gy < 65535 ? gy : 65535;
    gy = gy > 0 ? gy : 1;
    // gx <= N / 64 + 1 fits grid.x (2^31 - 1) for any N that fits in memory.
    const dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(gy));
    auto args = [&](auto kernel) {
      T* zp = static_cast<T*>(z);
      const T *xp = static_cast<const T*>(x), *gp = static_cast<const T*>(gamma), *bep = static_cast<const T*>(beta),
              *Wp = static_cast<const T*>(W), *bp_ = static_cast<const T*>(b);
      const A *mp = static_cast<const A*>(mean), *rsp = static_cast<const A*>(rstd), *rp = static_cast<const A*>(r),
              *bpp = static_cast<const A*>(bp);
      // Behind the sm_90a GEMM (fix-up, pdl): a programmatic dependent launch (the kernel
      // waits for the GEMM in pdl_wait before it touches memory); else a plain one.
      cudaLaunchAttribute attr[1];
      attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attr[0].val.programmaticStreamSerializationAllowed = 1;
      cudaLaunchConfig_t cfg = {};
      cfg.gridDim = grid;
      cfg.blockDim = dim3(threads);
      cfg.stream = stream;
      cfg.attrs = attr;
      cfg.numAttrs = FIXUP_ONLY && pdl ? 1 : 0;
      launch_err = cudaLaunchKernelEx(&cfg, kernel, zp, xp, gp, bep, Wp, bp_, mp, rsp, rp, bpp, M, N, H);
    };
    if (vec)
      args(lnlinear_epilogue<T, V, FIXUP_ONLY>);
    else
      args(lnlinear_epilogue<T, 1, FIXUP_ONLY>);
    return 0;
  });
  return launch_err != cudaSuccess ? launch_err : cudaGetLastError();
}

}  // namespace

LaunchStatus lnlinear_epilogue_cuda(void* z, const void* x, const void* gamma, const void* beta, const void* W,
                                    const void* b, const void* mean, const void* rstd, const void* r, const void* bp,
                                    int64_t M, int64_t N, int64_t H, DType dtype, cudaStream_t stream) {
  return epilogue_launch<false>(z, x, gamma, beta, W, b, mean, rstd, r, bp, M, N, H, dtype, stream, false);
}

LaunchStatus lnlinear_large_mean_fixup_cuda(void* y, const void* x, const void* gamma, const void* beta,
                                            const void* W, const void* b, const void* mean, const void* rstd,
                                            int64_t M, int64_t N, int64_t H, DType dtype, cudaStream_t stream,
                                            bool pdl) {
  return epilogue_launch<true>(y, x, gamma, beta, W, b, mean, rstd, nullptr, nullptr, M, N, H, dtype, stream, pdl);
}

LaunchStatus lnlinear_naive_cuda(const void* x, const void* gamma, const void* beta, const void* W, const void* b,
                                 void* y, int64_t M, int64_t N, int64_t H, double eps, DType dtype,
                                 cudaStream_t stream) {
  if (M == 0 || N == 0) return cudaSuccess;
  if (M > 2147483647LL) return cudaErrorInvalidValue;
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    lnlinear_naive<T><<<static_cast<unsigned>(M), 1, 0, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(gamma), static_cast<const T*>(beta), static_cast<const T*>(W),
        static_cast<const T*>(b), static_cast<T*>(y), M, N, H, eps);
    return 0;
  });
  return cudaGetLastError();
}

}  // namespace gpu_puzzles
