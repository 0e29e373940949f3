// Device helpers shared by the LayerNorm and fused LayerNorm+Linear kernels
// (layer_norm_forward.cu, layer_norm_backward.cu, layernorm_linear_fused.cu): vector
// loads/stores, block sums, the row statistics and the host-side launch helpers.
// Everything is in an anonymous namespace: each .cu gets its own internal copy, as when
// they were one file. Index arithmetic is 64-bit: M*H and M*N may exceed 2^31.
#pragma once
#include <cuda_runtime.h>

#include <cstring>
#include <initializer_list>
#include <type_traits>

#include "common/align.h"
#include "common/device.cuh"
#include "common/func_attr.h"
#include "norms/layernorm_linear.h"
#include "norms/layernorm_linear_plan.h"

namespace gpu_puzzles {
namespace {

using namespace layernorm_linear;  // the plan's constants (kCache, kFwdMaxThreads, ...)

// Programmatic dependent launch (PDL, sm_90; the knob layernorm_linear_pdl=plain turns
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

// f(k, c) for each of this thread's C register slots k that holds a vector of the row:
// vector c = threadIdx.x + k * blockDim.x, those below nvec.
template <int C, typename F>
__device__ __forceinline__ void for_cached(int64_t nvec, F&& f) {
#pragma unroll
  for (int k = 0; k < C; ++k) {
    const int64_t c = threadIdx.x + (int64_t)k * blockDim.x;
    if (c < nvec) f(k, c);
  }
}

template <typename A>
__device__ __forceinline__ A rsqrt_acc(A v) {
  return A(1) / sqrt(v);
}
template <>
__device__ __forceinline__ float rsqrt_acc<float>(float v) {
  return rsqrtf(v);
}

// Row statistics, corrected two-pass: the first pass gives mu1 (shifted by x[0]); the
// second sums e = sum(x - mu1) and q = sum((x - mu1)^2). mu1 alone is off by
// ~eps_acc * |x[0] - mean| when x[0] is far out; e corrects it. The variance
// q/H - (e/H)^2 can round just below 0 on a constant row: clamped, so eps = 0 gives
// inf (as torch), not NaN. RMS: q = sum(x^2) (mu1 = 0, e unused), mu = 0.
template <typename A, bool RMS = false>
__device__ __forceinline__ void finish_stats(A mu1, A e, A q, int64_t H, double eps, A& mu, A& rs) {
  if constexpr (RMS) {
    mu = A(0);
    rs = rsqrt_acc<A>(q / A(H) + A(eps));
    return;
  }
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
// row re-reads (benchmarks/results/layer_norm_variants_h100.txt).
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
  } else if constexpr (VEC * sizeof(T) == 8) {  // four halves beside a float32 row (mixed dtypes)
    const uint2* src = reinterpret_cast<const uint2*>(p);
    uint2 q;
    if constexpr (P == Ld::kStream)
      asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(q.x), "=r"(q.y) : "l"(src));
    else if constexpr (P == Ld::kCoherent)
      q = *src;
    else
      q = __ldg(src);
    memcpy(reinterpret_cast<char*>(d), &q, 8);
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
  } else if constexpr (VEC * sizeof(T) == 8) {
    uint2 q;
    memcpy(&q, reinterpret_cast<const char*>(d), 8);
    if constexpr (P == St::kStream)
      asm volatile("st.global.cs.v2.u32 [%0], {%1,%2};" ::"l"(reinterpret_cast<uint2*>(p)), "r"(q.x), "r"(q.y)
                   : "memory");
    else
      *reinterpret_cast<uint2*>(p) = q;
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

// ---- row statistics ------------------------------------------------------------

// The end of a block's row statistics: e and q summed over the block, mu and rs from
// them (finish_stats, every thread gets them), and thread 0 stores them for row.
template <typename A, bool RMS = false>
__device__ __forceinline__ void finish_block_row(A mu1, A e, A q, int64_t H, double eps, int64_t row, A* mean, A* rstd,
                                                 A* sh, A& mu, A& rs) {
  block_sum2(q, e, sh);
  finish_stats<A, RMS>(mu1, e, q, H, eps, mu, rs);
  if (threadIdx.x == 0) {
    if constexpr (!RMS) mean[row] = mu;
    rstd[row] = rs;
  }
}

// Per-vector arithmetic of the LayerNorm forward, shared by its row kernels
// (ln_row_cached, warp_row_stats, ln_fwd_loop, ln_fwd_warp) and the backward's xn
// output. First pass: s += x - pivot. Second pass about mu1 (finish_stats):
// e += x - mu1, q += (x - mu1)^2. normalise: o = (x - mu) * rs * gamma + beta at
// vector column c. RMS (the mean forced to zero, no beta): the first pass is skipped,
// q += x^2, and o = x * rs * gamma.
template <typename T, int VEC>
__device__ __forceinline__ void sum_shifted(const T (&v)[VEC], acc_t<T> pivot, acc_t<T>& s) {
#pragma unroll
  for (int i = 0; i < VEC; ++i) s += to_acc<acc_t<T>>(v[i]) - pivot;
}

template <typename T, int VEC, bool RMS = false>
__device__ __forceinline__ void sum_centred(const T (&v)[VEC], acc_t<T> mu1, acc_t<T>& e, acc_t<T>& q) {
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    if constexpr (RMS) {
      const acc_t<T> d = to_acc<acc_t<T>>(v[i]);
      q += d * d;
    } else {
      const acc_t<T> d = to_acc<acc_t<T>>(v[i]) - mu1;
      e += d;
      q += d * d;
    }
  }
}

// O: the output's type, T's or (a float32 row under a half linear) the half type.
template <typename T, int VEC, bool RMS = false, typename O = T>
__device__ __forceinline__ void normalise(const T (&v)[VEC], acc_t<T> mu, acc_t<T> rs, const T* __restrict__ gamma,
                                          const T* __restrict__ beta, int64_t c, O (&o)[VEC]) {
  using A = acc_t<T>;
  T g[VEC];
  load_pack<T, VEC>(g, gamma + c * VEC);
  if constexpr (RMS) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) o[i] = from_acc<O>(to_acc<A>(v[i]) * rs * to_acc<A>(g[i]));
  } else {
    T b[VEC];
    load_pack<T, VEC>(b, beta + c * VEC);
#pragma unroll
    for (int i = 0; i < VEC; ++i) o[i] = from_acc<O>((to_acc<A>(v[i]) - mu) * rs * to_acc<A>(g[i]) + to_acc<A>(b[i]));
  }
}

// One row of LayerNorm held in registers by one block (blockDim.x threads, kCache
// vectors each; the caller sizes the block so the row fits). y null: statistics only.
template <typename T, int VEC, bool RMS = false, typename O = T>
__device__ __forceinline__ void ln_row_cached(int64_t row, const T* __restrict__ x, const T* __restrict__ gamma,
                                              const T* __restrict__ beta, O* __restrict__ y,
                                              acc_t<T>* __restrict__ mean, acc_t<T>* __restrict__ rstd, int64_t H,
                                              double eps, acc_t<T>* sh) {
  using A = acc_t<T>;
  const int64_t nvec = H / VEC;
  const T* xr = x + row * H;
  T v[kCache][VEC];
  // Sum x - x[0]: a shift close to the mean keeps the partial sums small, so
  // a large mean costs no accuracy in the first pass.
  const A pivot = to_acc<A>(xr[0]);
  // Every load issued before any sum: summing inside the guarded load loop would make
  // each vector wait for its own load, one in flight per thread
  // (benchmarks/results/layer_norm_variants_h100.txt).
  for_cached<kCache>(nvec, [&](int k, int64_t c) { load_pack<T, VEC, Ld::kStream>(v[k], xr + c * VEC); });
  A mu1 = A(0);
  if constexpr (!RMS) {
    A s = 0, unused = 0;
    for_cached<kCache>(nvec, [&](int k, int64_t c) { sum_shifted<T, VEC>(v[k], pivot, s); });
    block_sum2(s, unused, sh);
    mu1 = pivot + s / A(H);
  }
  A q = 0, e = 0;  // second pass about mu1 (finish_stats)
  for_cached<kCache>(nvec, [&](int k, int64_t c) { sum_centred<T, VEC, RMS>(v[k], mu1, e, q); });
  A mu, rs;
  finish_block_row<A, RMS>(mu1, e, q, H, eps, row, mean, rstd, sh, mu, rs);
  if (y != nullptr) {
    for_cached<kCache>(nvec, [&](int k, int64_t c) {
      O o[VEC];
      normalise<T, VEC, RMS>(v[k], mu, rs, gamma, beta, c, o);
      store_pack<O, VEC, St::kStream>(y + row * H + c * VEC, o);
    });
  }
}

// Mean and rstd of one row held by one warp: lane l loads vectors l, l + 32, ... (NV
// slots, those < nvec) into v, which the caller keeps. Same arithmetic as ln_row_cached
// (pivot shift, corrected two-pass from registers), warp shuffles only. STREAM: the loads
// skip L1 (rows read once). Every lane gets mu and rs.
template <bool STREAM, typename T, int VEC, int NV, bool RMS = false>
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
  A mu1 = A(0);
  if constexpr (!RMS) {
    A s = 0;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int64_t c = lane + (int64_t)k * 32;
      if (c < nvec) sum_shifted<T, VEC>(v[k], pivot, s);
    }
    s = warp_sum(s);
    mu1 = pivot + s / A(H);
  }
  A q = 0, e = 0;  // second pass about mu1 (finish_stats)
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t c = lane + (int64_t)k * 32;
    if (c < nvec) sum_centred<T, VEC, RMS>(v[k], mu1, e, q);
  }
  if constexpr (RMS)
    finish_stats<A, true>(mu1, e, warp_sum(q), H, eps, mu, rs);
  else
    finish_stats(mu1, warp_sum(e), warp_sum(q), H, eps, mu, rs);
}
// ---- launch helpers --------------------------------------------------------------

// SMs of the current device (device_sm_count caches it per device: launchers ask on
// every call); 0 with err set when a query fails.
inline int current_sm_count(cudaError_t& err) {
  int dev = 0;
  err = cudaGetDevice(&dev);
  return err == cudaSuccess ? device_sm_count(dev, err) : 0;
}

inline unsigned int row_grid(int64_t rows) {
  return static_cast<unsigned int>(rows < 1048576 ? rows : 1048576);  // grid-stride beyond
}

// Every non-null pointer 16-byte aligned.
inline bool all_aligned(std::initializer_list<const void*> ps) {
  for (const void* p : ps)
    if (p != nullptr && !aligned16(p)) return false;
  return true;
}

template <typename T>
constexpr int vec_of() {
  return static_cast<int>(16 / sizeof(T));
}

// f(element type of y / xn / dy): T's own, or for a float32 row the half type of the
// linear beside it (torch.autocast's mixed dtypes). Only float32 gets the half variants:
// the host asks for no other pair (layer_norm_*_cuda refuse it).
template <typename T, typename F>
auto with_out_dtype(T tag, DType out, F&& f) {
  if constexpr (std::is_same_v<T, float>) {
    if (out == DType::BFloat16) return f(__nv_bfloat16{});
    if (out == DType::Float16) return f(__half{});
  }
  return f(tag);
}

inline bool mixed_pair_ok(DType dtype, DType out) {
  return out == dtype || (dtype == DType::Float32 && (out == DType::BFloat16 || out == DType::Float16));
}

}  // namespace
}  // namespace gpu_puzzles
