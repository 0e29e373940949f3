// Cross-entropy rows on CUDA: a block per row (grid-stride over rows).
// Forward: one pass over the row, each thread keeping a running (max, sum of exp) in
// the accumulate type, merged across the block; the row's logits are read once, in
// their own dtype. Backward: one read and one write per element.
// A row is cut into a scalar head (up to the first 16-byte boundary), a body of
// 16-byte vectors and a scalar tail, so odd V (50257: rows at every alignment) keeps
// the vector loads. The backward's vectors need the input and output rows at the same
// offset within 16 bytes (always true in place and for contiguous logits); other
// rows take a coalesced scalar loop.
// A softcap (kCap) maps each logit to c * tanh(x / c) as it is read: the loss is over the
// capped logits, and the gradient gains the factor 1 - tanh(x / c)^2.
#include <cstdint>
#include <type_traits>

#include "common/device.cuh"
#include "common/row_strides.h"
#include "cross_entropy/cross_entropy.h"

namespace gpu_puzzles {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
// 16-byte vectors in flight per thread (float64: 2, its wider accumulators would spill
// under the forward's 64-register bound).
template <typename T>
constexpr int kUnrollOf = sizeof(T) == 8 ? 2 : 4;

// exp in the accumulate type's log2 domain: float values are pre-multiplied by log2(e)
// (one FFMA + MUFU.EX2 per element), double stays natural.
template <typename A>
struct Domain;
template <>
struct Domain<float> {
  static __device__ __forceinline__ float in(float x) { return x * kLog2e; }
  static __device__ __forceinline__ float ex(float x) { return exp2f(x); }
  static __device__ __forceinline__ float lse(float m, float s) { return (m + log2f(s)) * kLn2; }
};
template <>
struct Domain<double> {
  static __device__ __forceinline__ double in(double x) { return x; }
  static __device__ __forceinline__ double ex(double x) { return exp(x); }
  static __device__ __forceinline__ double lse(double m, double s) { return m + log(s); }
};

template <typename A>
__device__ __forceinline__ A neg_inf();
template <>
__device__ __forceinline__ float neg_inf<float>() {
  return -INFINITY;
}
template <>
__device__ __forceinline__ double neg_inf<double>() {
  return -static_cast<double>(INFINITY);
}

template <typename A>
__device__ __forceinline__ A max_of(A a, A b) {
  return a > b ? a : b;
}

// Running (max m, sum s of ex(x - m)) over values in the Domain. A NaN value makes s NaN
// (the max skips it), so the row's lse is NaN as in PyTorch; -inf values add 0.
template <typename A>
struct Online {
  A m, s;
  __device__ __forceinline__ Online() : m(neg_inf<A>()), s(A(0)) {}
  template <int N>
  __device__ __forceinline__ void add(const A (&v)[N]) {
    A mx = m;
#pragma unroll
    for (int k = 0; k < N; ++k) mx = max_of(mx, v[k]);
    // Only -inf so far (a thread past the row's head or tail, say): they add 0, and
    // ex(-inf - -inf) would be NaN.
    if (mx == neg_inf<A>()) return;
    if (mx > m) {  // a new max: rescale (m = -inf: s is 0, ex(-inf) = 0)
      s *= Domain<A>::ex(m - mx);
      m = mx;
    }
#pragma unroll
    for (int k = 0; k < N; ++k) s += Domain<A>::ex(v[k] - m);
  }
  __device__ __forceinline__ void merge(A om, A os) {
    const A nm = max_of(m, om);
    if (nm == neg_inf<A>()) return;  // both empty
    s = (m == neg_inf<A>() ? A(0) : s * Domain<A>::ex(m - nm)) +
        (om == neg_inf<A>() ? A(0) : os * Domain<A>::ex(om - nm));
    m = nm;
  }
};

template <typename A>
__device__ __forceinline__ void block_merge(Online<A>& o, A* sm, A* ss) {
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) {
    const A om = __shfl_xor_sync(0xffffffffu, o.m, d);
    const A os = __shfl_xor_sync(0xffffffffu, o.s, d);
    o.merge(om, os);
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
  if (nw == 1) return;
  if (lane == 0) {
    sm[warp] = o.m;
    ss[warp] = o.s;
  }
  __syncthreads();
  if (warp == 0) {  // every lane of warp 0 merges all warps in the same order: the result is the same in each
    Online<A> r;
    for (int w = 0; w < nw; ++w) r.merge(sm[w], ss[w]);
    o = r;
  }
}

// The soft-cap of the logits (kCap) or the identity: z = c * tanh(x / c), and dz/dx.
template <typename A>
__device__ __forceinline__ A tanh_of(A x);
template <>
__device__ __forceinline__ float tanh_of<float>(float x) {
  return tanhf(x);
}
template <>
__device__ __forceinline__ double tanh_of<double>(double x) {
  return tanh(x);
}
template <typename A, bool kCap>
struct Cap {
  A c, inv;  // c and 1 / c
  __device__ explicit Cap(double softcap) : c(A(softcap)), inv(kCap ? A(1.0 / softcap) : A(0)) {}
  __device__ __forceinline__ A operator()(A x) const { return kCap ? c * tanh_of(x * inv) : x; }
};

__device__ __forceinline__ int64_t target_at(const void* t, bool t64, const RowStrides& ts, int64_t r) {
  const int64_t off = row_offset(ts, r);
  return t64 ? static_cast<const int64_t*>(t)[off] : static_cast<int64_t>(static_cast<const int32_t*>(t)[off]);
}

// Elements before the first 16-byte boundary of p (at most V).
template <typename T>
__device__ __forceinline__ int64_t head_elems(const T* p, int64_t V) {
  constexpr int VEC = 16 / sizeof(T);
  const int mis = static_cast<int>((reinterpret_cast<uintptr_t>(p) & 15u) / sizeof(T));
  return mis == 0 ? 0 : (VEC - mis < V ? VEC - mis : V);
}

template <typename T, typename A, bool kCap>
__device__ __forceinline__ T grad_of(T xv, int64_t j, int64_t t, A lse_d, A g, const Cap<A, kCap>& cap) {
  A x = to_acc<A>(xv);
  if constexpr (kCap) {  // z = c * th, dz/dx = 1 - th^2
    const A th = tanh_of(x * cap.inv);
    x = cap.c * th;
    g *= A(1) - th * th;
  }
  const A xd = Domain<A>::in(x);
  const A p = Domain<A>::ex(xd - lse_d);
  return from_acc<T>((j == t ? p - A(1) : p) * g);
}

// One row of the gradient by the whole block: y[j] = (exp(x[j] - lse) - (j == t)) * g, or
// zeros for an ignored row. lse_d is the lse in the Domain. Plain loads, no __restrict__:
// y may be x (each element is read, then written, by the same thread).
template <typename T, typename A, bool kCap>
__device__ __forceinline__ void grad_row(const T* x, T* y, int64_t V, int64_t t, bool ign, A lse_d, A g,
                                         const Cap<A, kCap>& cap) {
  constexpr int VEC = 16 / sizeof(T);
  constexpr int kUnroll = kUnrollOf<T>;
  const int nt = blockDim.x, tid = threadIdx.x;
  const T zero = from_acc<T>(A(0));
  const bool same = ((reinterpret_cast<uintptr_t>(x) ^ reinterpret_cast<uintptr_t>(y)) & 15u) == 0;
  if (!same) {  // coalesced scalar loop
    for (int64_t j = tid; j < V; j += nt) y[j] = ign ? zero : grad_of<T, A>(x[j], j, t, lse_d, g, cap);
    return;
  }
  const int64_t head = head_elems(y, V);
  const int64_t nvec = (V - head) / VEC;
  const int64_t tail0 = head + nvec * VEC;
  if (tid < head) y[tid] = ign ? zero : grad_of<T, A>(x[tid], tid, t, lse_d, g, cap);
  if (tail0 + tid < V) y[tail0 + tid] = ign ? zero : grad_of<T, A>(x[tail0 + tid], tail0 + tid, t, lse_d, g, cap);
  const T* xb = x + head;
  T* yb = y + head;
  for (int64_t i = tid; i < nvec; i += int64_t(kUnroll) * nt) {
    Vec<T, VEC> q[kUnroll];
    if (!ign) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (i + int64_t(u) * nt < nvec) q[u].q[0] = *reinterpret_cast<const uint4*>(xb + (i + int64_t(u) * nt) * VEC);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t iv = i + int64_t(u) * nt;
      if (iv >= nvec) continue;
      if (ign) {
        zero_vec(q[u]);
      } else {
#pragma unroll
        for (int k = 0; k < VEC; ++k) q[u].e[k] = grad_of<T, A>(q[u].e[k], head + iv * VEC + k, t, lse_d, g, cap);
      }
      store_vec(yb + iv * VEC, q[u]);
    }
  }
}

template <typename T, bool kCap>
// At most 64 registers: two blocks of 512 threads per SM, so one block's reduction and
// barrier overlap the other's loads.
__global__ void __launch_bounds__(512, 2) ce_fwd_kernel(CeFwdArgs a) {
  using A = acc_t<T>;
  using D = Domain<A>;
  constexpr int VEC = 16 / sizeof(T);
  constexpr int kUnroll = kUnrollOf<T>;
  __shared__ A sm[32], ss[32], row_lse;
  const T* logits = static_cast<const T*>(a.logits);
  A* loss = static_cast<A*>(a.loss);
  A* lse_out = static_cast<A*>(a.lse);
  const int nt = blockDim.x, tid = threadIdx.x;
  const Cap<A, kCap> cap(a.softcap);
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const int64_t t = target_at(a.target, a.target64, a.ts, row);
    const T* x = logits + row_offset(a.ls, row);
    const int64_t V = a.V;
    if (t == a.ignore_index) {  // block-uniform
      if (tid == 0) {
        loss[row] = A(0);
        lse_out[row] = A(0);
      }
      if (a.grad_in_place) grad_row<T, A>(x, const_cast<T*>(x), V, t, true, A(0), A(0), cap);
      continue;
    }
    const int64_t head = head_elems(x, V);
    const int64_t nvec = (V - head) / VEC;
    const int64_t tail0 = head + nvec * VEC;
    Online<A> o;
    {  // head and tail: at most VEC - 1 elements each, one per thread
      A v[1];
      v[0] = tid < head ? D::in(cap(to_acc<A>(x[tid]))) : neg_inf<A>();
      o.add(v);
      v[0] = tail0 + tid < V ? D::in(cap(to_acc<A>(x[tail0 + tid]))) : neg_inf<A>();
      o.add(v);
    }
    const T* xb = x + head;
    for (int64_t i = tid; i < nvec; i += int64_t(kUnroll) * nt) {
      Vec<T, VEC> q[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (i + int64_t(u) * nt < nvec) load_vec(q[u], xb + (i + int64_t(u) * nt) * VEC);
      // Max on the raw values (Domain::in is a positive scale), then one FFMA + exp per
      // element, converting from the loaded words twice instead of keeping kUnroll * VEC
      // converted values live (register pressure: resident blocks per SM). The cap is
      // monotonic: the capped max is the max's cap.
      A mx = neg_inf<A>();
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (i + int64_t(u) * nt < nvec)
#pragma unroll
          for (int k = 0; k < VEC; ++k) mx = max_of(mx, to_acc<A>(q[u].e[k]));
      const A mxd = D::in(cap(mx));
      if (mxd > o.m) {  // a new max: rescale (o.m = -inf: o.s is 0, ex(-inf) = 0)
        o.s *= D::ex(o.m - mxd);
        o.m = mxd;
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (i + int64_t(u) * nt < nvec)
#pragma unroll
          for (int k = 0; k < VEC; ++k) o.s += D::ex(D::in(cap(to_acc<A>(q[u].e[k]))) - o.m);
    }
    block_merge(o, sm, ss);
    if (tid == 0) {
      const A l = D::lse(o.m, o.s);
      lse_out[row] = l;
      // Out-of-range target: NaN, and no read outside the row.
      loss[row] = (t >= 0 && t < V) ? l - cap(to_acc<A>(x[t])) : A(NAN);
      row_lse = l;
    }
    __syncthreads();  // sm/ss/row_lse are reused by the next row
    if (a.grad_in_place) {
      // Every thread has read its loads of the row before the barrier above: in place is safe.
      const A g = *static_cast<const A*>(a.scale);
      grad_row<T, A>(x, const_cast<T*>(x), V, t, false, D::in(row_lse), g, cap);
      __syncthreads();  // row_lse is read above before the next row's thread 0 writes it
    }
  }
}

template <typename T, bool kCap>
__global__ void __launch_bounds__(512) ce_bwd_kernel(CeBwdArgs a) {
  using A = acc_t<T>;
  const Cap<A, kCap> cap(a.softcap);
  const T* logits = static_cast<const T*>(a.logits);
  T* grad = static_cast<T*>(a.grad);
  const A* lse = static_cast<const A*>(a.lse);
  const A* scale = static_cast<const A*>(a.scale);
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const int64_t t = target_at(a.target, a.target64, a.ts, row);
    const bool ign = t == a.ignore_index;
    const A lse_d = ign ? A(0) : Domain<A>::in(lse[row]);
    const A g = ign ? A(0) : scale[a.scale_per_row ? row : 0];
    grad_row<T, A>(logits + row_offset(a.ls, row), grad + row * a.grad_stride, a.V, t, ign, lse_d, g, cap);
  }
}

constexpr int kReduceThreads = 1024;

// Sums in double and counts in int64, each thread over rows tid, tid + 1024, ..., then a
// fixed tree: the same bits on every run.
template <typename T>
__global__ void __launch_bounds__(kReduceThreads) ce_reduce_kernel(CeReduceArgs a) {
  using A = acc_t<T>;
  __shared__ double ssum[32];
  __shared__ long long scnt[32];
  const A* rows = static_cast<const A*>(a.loss_rows);
  double s = 0;
  long long n = 0;
  for (int64_t r = threadIdx.x; r < a.rows; r += blockDim.x) {
    const bool keep = target_at(a.target, a.target64, a.ts, r) != a.ignore_index;
    n += keep;
    if (rows != nullptr) s += static_cast<double>(rows[r]);  // 0 at ignored rows
  }
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) {
    s += __shfl_xor_sync(0xffffffffu, s, d);
    n += __shfl_xor_sync(0xffffffffu, n, d);
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
  if (lane == 0) {
    ssum[warp] = s;
    scnt[warp] = n;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  s = 0;
  n = 0;
  for (int w = 0; w < nw; ++w) {
    s += ssum[w];
    n += scnt[w];
  }
  const double cnt = static_cast<double>(n);  // 0: 0 / 0 = nan for a mean, as PyTorch
  if (rows != nullptr) {
    *static_cast<T*>(a.out) = from_acc<T>(static_cast<A>(a.mean ? s / cnt : s));
  } else {
    const double g = a.grad_loss ? static_cast<double>(to_acc<A>(*static_cast<const T*>(a.grad_loss))) : 1.0;
    *static_cast<A*>(a.out) = static_cast<A>(a.mean ? g / cnt : g);
  }
}

template <typename T>
int rows_grid(int64_t rows) {
  // Rows beyond the grid loop in the kernel; 2^31 - 1 is the x-dim limit.
  return static_cast<int>(rows < 0x7fffffff ? rows : 0x7fffffff);
}

// A row kernel's launch for a's dtype T, with the softcap's template argument decided here:
// kernel(tag, cap) gives the kernel for T (tag: a value of it) and kCap (cap: a
// std::bool_constant). Nothing for no rows.
template <typename Args, typename K>
LaunchStatus launch_rows(const Args& a, cudaStream_t stream, K&& kernel) {
  if (a.rows == 0) return cudaSuccess;
  return dispatch_dtype(a.dtype, [&](auto tag) -> LaunchStatus {
    using T = decltype(tag);
    const auto k = a.softcap > 0 ? kernel(tag, std::true_type{}) : kernel(tag, std::false_type{});
    k<<<rows_grid<T>(a.rows), a.threads, 0, stream>>>(a);
    return cudaGetLastError();
  });
}

}  // namespace

LaunchStatus cross_entropy_forward_cuda(const CeFwdArgs& a, cudaStream_t stream) {
  return launch_rows(a, stream, [](auto tag, auto cap) { return &ce_fwd_kernel<decltype(tag), decltype(cap)::value>; });
}

LaunchStatus cross_entropy_backward_cuda(const CeBwdArgs& a, cudaStream_t stream) {
  return launch_rows(a, stream, [](auto tag, auto cap) { return &ce_bwd_kernel<decltype(tag), decltype(cap)::value>; });
}

LaunchStatus cross_entropy_reduce_cuda(const CeReduceArgs& a, cudaStream_t stream) {
  return dispatch_dtype(a.dtype, [&](auto tag) -> LaunchStatus {
    using T = decltype(tag);
    ce_reduce_kernel<T><<<1, kReduceThreads, 0, stream>>>(a);
    return cudaGetLastError();
  });
}

}  // namespace gpu_puzzles
