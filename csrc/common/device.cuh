// Device-side building blocks shared by every kernel: dtype dispatch, accumulate
// types, conversions, 16-byte vector access and warp/block reductions.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/dtype.h"

namespace gpu_puzzles {

// Half types accumulate in float; float64 stays in float64.
template <typename T>
struct Acc {
  using type = float;
};
template <>
struct Acc<double> {
  using type = double;
};
template <typename T>
using acc_t = typename Acc<T>::type;

// Element <-> accumulator conversions: the half types to and from float through their
// intrinsics (the build turns their implicit conversions off), anything else by a cast.
template <typename To, typename From>
__device__ __forceinline__ To convert_to(From v) {
  constexpr bool kToFloat = std::is_same<To, float>::value, kFromFloat = std::is_same<From, float>::value;
  if constexpr (kToFloat && std::is_same<From, __half>::value)
    return __half2float(v);
  else if constexpr (kToFloat && std::is_same<From, __nv_bfloat16>::value)
    return __bfloat162float(v);
  else if constexpr (kFromFloat && std::is_same<To, __half>::value)
    return __float2half_rn(v);
  else if constexpr (kFromFloat && std::is_same<To, __nv_bfloat16>::value)
    return __float2bfloat16_rn(v);
  else
    return static_cast<To>(v);
}

template <typename A, typename T>
__device__ __forceinline__ A to_acc(T v) {
  return convert_to<A>(v);
}

template <typename T, typename A>
__device__ __forceinline__ T from_acc(A v) {
  return convert_to<T>(v);
}

// N elements of T moved as whole 16-byte words (N * sizeof(T) must be a multiple of 16).
template <typename T, int N>
struct alignas(16) Vec {
  static_assert((N * sizeof(T)) % 16 == 0, "Vec must be whole 16-byte words");
  static constexpr int kWords = N * sizeof(T) / 4;
  union {
    T e[N];
    uint32_t w[kWords];
    uint4 q[N * sizeof(T) / 16];
  };
  __device__ __forceinline__ Vec() {}
};

template <typename T, int N>
__device__ __forceinline__ void load_vec(Vec<T, N>& v, const T* __restrict__ p) {
  const uint4* src = reinterpret_cast<const uint4*>(p);
#pragma unroll
  for (int i = 0; i < N * (int)sizeof(T) / 16; ++i) v.q[i] = __ldg(src + i);
}

template <typename T, int N>
__device__ __forceinline__ void store_vec(T* __restrict__ p, const Vec<T, N>& v) {
  uint4* dst = reinterpret_cast<uint4*>(p);
#pragma unroll
  for (int i = 0; i < N * (int)sizeof(T) / 16; ++i) dst[i] = v.q[i];
}

template <typename T, int N>
__device__ __forceinline__ void zero_vec(Vec<T, N>& v) {
#pragma unroll
  for (int i = 0; i < Vec<T, N>::kWords; ++i) v.w[i] = 0u;
}

template <typename A>
__device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <typename A>
__device__ __forceinline__ A warp_max(A v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Quad (4 consecutive lanes) reductions: in an mma/wgmma accumulator fragment the 4 lanes
// sharing one row.
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Call a functor templated on the CUDA element type that matches `dt`.
template <typename F>
inline auto dispatch_dtype(DType dt, F&& f) {
  switch (dt) {
    case DType::Float64:
      return f(double{});
    case DType::Float16:
      return f(__half{});
    case DType::BFloat16:
      return f(__nv_bfloat16{});
    case DType::Float32:
    default:
      return f(float{});
  }
}

inline unsigned int ceil_div_u(long long a, long long b) { return static_cast<unsigned int>((a + b - 1) / b); }

}  // namespace gpu_puzzles
