// rotary's CUDA kernel: q and k in one launch, each thread step rotating vec pairs
// (j, j + R/2) of one row (16-byte vectors where every row start allows) or copying vec
// elements past R. Memory-bound: x read and out written once, cos and sin rows (shared by
// every head) mostly from L2.
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "common/align.h"
#include "common/device.cuh"
#include "rotary/rotary.h"
#include "rotary/rotary_plan.h"

namespace gpu_puzzles {
namespace {

template <typename T, int V>
struct Lanes {  // V elements: a 16-byte-word vector, or one element
  Vec<T, V> v;
  __device__ __forceinline__ void load(const T* p) { load_vec(v, p); }
  __device__ __forceinline__ void store(T* p) const { store_vec(p, v); }
};
template <typename T>
struct Lanes<T, 1> {
  struct {
    T e[1];
  } v;
  __device__ __forceinline__ void load(const T* p) { v.e[0] = *p; }
  __device__ __forceinline__ void store(T* p) const { *p = v.e[0]; }
};

template <typename TI, typename TC, typename TO, int V>
__global__ void rotary_kernel(RotaryArgs a, int64_t steps) {
  using A = std::conditional_t<std::is_same<TI, double>::value, double, float>;
  const int64_t h = a.R / 2, pairs = h / V;
  const int64_t total0 = a.op[0].rows * steps, total = total0 + a.op[1].rows * steps;
  for (int64_t w = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; w < total; w += int64_t(gridDim.x) * blockDim.x) {
    const bool second = w >= total0;
    const RotaryOperand o = second ? a.op[1] : a.op[0];
    const int64_t wl = second ? w - total0 : w, r = wl / steps, c = wl % steps;
    const RowIndex ri = row_index(o.xr, r);
    const TI* x = static_cast<const TI*>(o.x) + row_start(o.xr, ri);
    TO* y = static_cast<TO*>(o.out) + r * a.D;
    if (c < pairs) {
      const int64_t j = c * V;
      const TC* cs = static_cast<const TC*>(a.cos) + row_start(o.cr, ri);
      const TC* sn = static_cast<const TC*>(a.sin) + row_start(o.sr, ri);
      Lanes<TI, V> x1, x2;
      Lanes<TC, V> c1, c2, s1, s2;
      Lanes<TO, V> y1, y2;
      x1.load(x + j);
      x2.load(x + h + j);
      c1.load(cs + j);
      c2.load(cs + h + j);
      s1.load(sn + j);
      s2.load(sn + h + j);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const A u = to_acc<A>(x1.v.e[i]), v = to_acc<A>(x2.v.e[i]);
        const A ca = to_acc<A>(c1.v.e[i]), cb = to_acc<A>(c2.v.e[i]);
        const A sa = to_acc<A>(s1.v.e[i]), sb = to_acc<A>(s2.v.e[i]);
        // forward: (u, v) -> (u ca - v sa, v cb + u sb); backward: its transpose.
        y1.v.e[i] = from_acc<TO>(a.backward ? u * ca + v * sb : u * ca - v * sa);
        y2.v.e[i] = from_acc<TO>(a.backward ? v * cb - u * sa : v * cb + u * sb);
      }
      y1.store(y + j);
      y2.store(y + h + j);
    } else {
      const int64_t j = a.R + (c - pairs) * V;
      Lanes<TI, V> in;
      Lanes<TO, V> out;
      in.load(x + j);  // the plan takes vec > 1 only where it divides D - R
#pragma unroll
      for (int i = 0; i < V; ++i) out.v.e[i] = from_acc<TO>(to_acc<A>(in.v.e[i]));
      out.store(y + j);
    }
  }
}

bool rows_aligned(const void* p, const RotaryRows& s, int elem) {
  const auto b = [&](int64_t stride) { return (stride * elem) % 16 == 0; };
  return aligned16(p) && b(s.s0) && b(s.s1) && b(s.s2);
}

template <typename TI, typename TC, typename TO>
LaunchStatus run(const RotaryArgs& a, int sms, cudaStream_t stream) {
  const int narrow = static_cast<int>(std::min({sizeof(TI), sizeof(TC), sizeof(TO)}));
  bool aligned = (a.D * sizeof(TO)) % 16 == 0;
  for (const RotaryOperand& o : a.op)
    aligned = aligned && rows_aligned(o.x, o.xr, sizeof(TI)) && aligned16(o.out) &&
              rows_aligned(a.cos, o.cr, sizeof(TC)) && rows_aligned(a.sin, o.sr, sizeof(TC));
  const RotaryPlan p = rotary_plan(a.op[0].rows + a.op[1].rows, a.R, a.D, narrow, aligned, sms);
  constexpr int kV = 16 / std::min({sizeof(TI), sizeof(TC), sizeof(TO)});
  if (p.vec == kV)
    rotary_kernel<TI, TC, TO, kV><<<static_cast<unsigned>(p.blocks), p.threads, 0, stream>>>(a, p.steps);
  else
    rotary_kernel<TI, TC, TO, 1><<<static_cast<unsigned>(p.blocks), p.threads, 0, stream>>>(a, p.steps);
  return cudaGetLastError();
}

// f(T{}) for the two half types.
template <typename F>
LaunchStatus dispatch_half(DType dt, F&& f) {
  return dt == DType::BFloat16 ? f(__nv_bfloat16{}) : f(__half{});
}

}  // namespace

// The element types come as x = out = cos (one dtype), or, for half q and k with float32
// cos and sin, float32 out (the forward, as PyTorch's promotion gives) or float32 x (the
// backward): the host checks which.
LaunchStatus rotary_cuda(const RotaryArgs& a, int dev, cudaStream_t stream) {
  if (a.op[0].rows + a.op[1].rows == 0) return cudaSuccess;
  int sms = 0;
  if (const cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev)) return e;
  if (a.in == a.out)
    return dispatch_dtype(a.in, [&](auto t) -> LaunchStatus {
      using T = decltype(t);
      return run<T, T, T>(a, sms, stream);
    });
  if (a.out == DType::Float32)
    return dispatch_half(a.in, [&](auto t) -> LaunchStatus { return run<decltype(t), float, float>(a, sms, stream); });
  return dispatch_half(a.out, [&](auto t) -> LaunchStatus { return run<float, float, decltype(t)>(a, sms, stream); });
}

}  // namespace gpu_puzzles
