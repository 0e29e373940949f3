// gated_act's CUDA kernels: out = act(gate) * up and its backward, elementwise over rows
// read in place (the halves of one projection's output included), 16-byte vectors where
// every row start is aligned. Memory-bound: the forward moves 3 elements per output, the
// backward 5 (grad_out, gate, up in; dgate, dup out), with nothing saved but gate and up.
#include <cuda_runtime.h>

#include "common/align.h"
#include "common/device.cuh"
#include "gated_act/gated_act.h"
#include "gated_act/gated_act_plan.h"

namespace gpu_puzzles {
namespace {

// act(g) and act'(g) in the accumulate type.
template <typename A>
struct ActDeriv {
  A act, grad;
};

template <typename A>
__device__ __forceinline__ A act_only(A g, GatedAct act) {
  if (act == GatedAct::Silu) return g / (A(1) + exp(-g));
  if (act == GatedAct::GeluTanh) {
    const A k = A(0.7978845608028654), c = A(0.044715);
    return A(0.5) * g * (A(1) + tanh(k * (g + c * g * g * g)));
  }
  return A(0.5) * g * (A(1) + erf(g * A(0.7071067811865476)));
}

template <typename A>
__device__ __forceinline__ ActDeriv<A> act_and_grad(A g, GatedAct act) {
  if (act == GatedAct::Silu) {
    const A s = A(1) / (A(1) + exp(-g));
    return {g * s, s * (A(1) + g * (A(1) - s))};
  }
  if (act == GatedAct::GeluTanh) {
    const A k = A(0.7978845608028654), c = A(0.044715);
    const A t = tanh(k * (g + c * g * g * g));
    return {A(0.5) * g * (A(1) + t), A(0.5) * (A(1) + t) + A(0.5) * g * (A(1) - t * t) * k * (A(1) + A(3) * c * g * g)};
  }
  const A cdf = A(0.5) * (A(1) + erf(g * A(0.7071067811865476)));
  return {g * cdf, cdf + g * exp(A(-0.5) * g * g) * A(0.3989422804014327)};
}

// Element c0 of row r of a strided operand.
template <typename T>
__device__ __forceinline__ const T* row_at(const void* p, const RowStrides& s, int64_t r, int64_t c0) {
  return static_cast<const T*>(p) + row_offset(s, r) + c0;
}

// f(r, c0) for every row this thread covers: V consecutive elements from c0 (V = 1 is the
// unaligned path), the rows looping with a stride of gridDim.y.
template <int V, typename F>
__device__ __forceinline__ void each_row(const GatedActArgs& a, F&& f) {
  const int64_t c0 = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * V;
  if (c0 >= a.I) return;
  for (int64_t r = blockIdx.y; r < a.rows; r += gridDim.y) f(r, c0);
}

template <typename T, int V>
__global__ void gated_act_fwd_kernel(GatedActArgs a) {
  using A = acc_t<T>;
  each_row<V>(a, [&](int64_t r, int64_t c0) {
    const T* g = row_at<T>(a.gate, a.gs, r, c0);
    const T* u = row_at<T>(a.up, a.us, r, c0);
    T* o = static_cast<T*>(a.out) + r * a.I + c0;
    if constexpr (V > 1) {
      Vec<T, V> gv, uv, ov;
      load_vec(gv, g);
      load_vec(uv, u);
#pragma unroll
      for (int i = 0; i < V; ++i) ov.e[i] = from_acc<T>(act_only(to_acc<A>(gv.e[i]), a.act) * to_acc<A>(uv.e[i]));
      store_vec(o, ov);
    } else {
      *o = from_acc<T>(act_only(to_acc<A>(*g), a.act) * to_acc<A>(*u));
    }
  });
}

template <typename T, int V>
__global__ void gated_act_bwd_kernel(GatedActArgs a) {
  using A = acc_t<T>;
  each_row<V>(a, [&](int64_t r, int64_t c0) {
    const T *g = row_at<T>(a.gate, a.gs, r, c0), *u = row_at<T>(a.up, a.us, r, c0);
    const T* d = row_at<T>(a.grad_out, a.ds, r, c0);
    T *dg = static_cast<T*>(a.out) + r * a.I + c0, *du = static_cast<T*>(a.dup) + r * a.I + c0;
    if constexpr (V > 1) {
      Vec<T, V> gv, uv, dv, dgv, duv;
      load_vec(gv, g);
      load_vec(uv, u);
      load_vec(dv, d);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const ActDeriv<A> f = act_and_grad(to_acc<A>(gv.e[i]), a.act);
        const A dy = to_acc<A>(dv.e[i]);
        dgv.e[i] = from_acc<T>(dy * to_acc<A>(uv.e[i]) * f.grad);
        duv.e[i] = from_acc<T>(dy * f.act);
      }
      store_vec(dg, dgv);
      store_vec(du, duv);
    } else {
      const ActDeriv<A> f = act_and_grad(to_acc<A>(*g), a.act);
      const A dy = to_acc<A>(*d);
      *dg = from_acc<T>(dy * to_acc<A>(*u) * f.grad);
      *du = from_acc<T>(dy * f.act);
    }
  });
}

bool rows_aligned(const void* p, const RowStrides& s, int elem) {
  const auto b = [&](int64_t stride) { return (stride * elem) % 16 == 0; };
  return aligned16(p) && b(s.s0) && b(s.s1);
}

template <bool Bwd>
LaunchStatus launch(const GatedActArgs& a, int dev, cudaStream_t stream) {
  if (a.rows == 0 || a.I == 0) return cudaSuccess;
  int sms = 0;
  if (const cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev)) return e;
  return dispatch_dtype(a.dtype, [&](auto t) -> LaunchStatus {
    using T = decltype(t);
    const int elem = sizeof(T);
    bool aligned = rows_aligned(a.gate, a.gs, elem) && rows_aligned(a.up, a.us, elem) && aligned16(a.out);
    if (Bwd) aligned = aligned && rows_aligned(a.grad_out, a.ds, elem) && aligned16(a.dup);
    const GatedActPlan p = gated_act_plan(a.rows, a.I, elem, aligned, sms);
    const dim3 grid(static_cast<unsigned>(p.grid_x), static_cast<unsigned>(p.grid_y));
    constexpr int kV = 16 / sizeof(T);
    if (p.vec == kV) {
      if (Bwd)
        gated_act_bwd_kernel<T, kV><<<grid, p.threads, 0, stream>>>(a);
      else
        gated_act_fwd_kernel<T, kV><<<grid, p.threads, 0, stream>>>(a);
    } else {
      if (Bwd)
        gated_act_bwd_kernel<T, 1><<<grid, p.threads, 0, stream>>>(a);
      else
        gated_act_fwd_kernel<T, 1><<<grid, p.threads, 0, stream>>>(a);
    }
    return cudaGetLastError();
  });
}

}  // namespace

LaunchStatus gated_act_fwd_cuda(const GatedActArgs& a, int dev, cudaStream_t stream) {
  return launch<false>(a, dev, stream);
}
LaunchStatus gated_act_bwd_cuda(const GatedActArgs& a, int dev, cudaStream_t stream) {
  return launch<true>(a, dev, stream);
}

}  // namespace gpu_puzzles
