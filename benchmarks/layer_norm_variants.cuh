// Helpers shared by the LayerNorm variant benchmarks (layer_norm_fwd_variants.cu,
// layer_norm_bwd_variants.cu): bf16 packs of 8, warp/block sums, 16-byte loads and stores
// with or without the streaming hints (HINT: ld.global.nc.L1::no_allocate, st.global.cs).
#pragma once
#include <cuda_bf16.h>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "harness.cuh"  // CK, event_median_ms
typedef __nv_bfloat16 bf;

__device__ __forceinline__ float wsum(float v) {
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
// Each a[j] summed over the block of NW warps; sh holds 32*K floats.
template <int NW, int K>
__device__ __forceinline__ void bsum(float (&a)[K], float* sh) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
#pragma unroll
  for (int j = 0; j < K; ++j) a[j] = wsum(a[j]);
  if (NW == 1) return;
  __syncthreads();
  if (lane == 0) for (int j = 0; j < K; ++j) sh[j * 32 + w] = a[j];
  __syncthreads();
#pragma unroll
  for (int j = 0; j < K; ++j) a[j] = wsum(lane < NW ? sh[j * 32 + lane] : 0.f);
}
template <int NW>
__device__ __forceinline__ void bsum2(float& a, float& b, float* sh) {
  float t[2] = {a, b};
  bsum<NW, 2>(t, sh);
  a = t[0];
  b = t[1];
}
template <int HINT> __device__ __forceinline__ uint4 ld16(const void* p) {
  uint4 r;
  if (HINT) asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  else r = __ldg(reinterpret_cast<const uint4*>(p));
  return r;
}
template <int HINT> __device__ __forceinline__ void st16(void* p, uint4 v) {
  if (HINT) asm volatile("st.global.cs.v4.u32 [%0], {%1,%2,%3,%4};" :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
  else *reinterpret_cast<uint4*>(p) = v;
}
__device__ __forceinline__ void unpack(uint4 q, float (&f)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&q);
  for (int i = 0; i < 4; ++i) { float2 t = __bfloat1622float2(h[i]); f[2*i] = t.x; f[2*i+1] = t.y; }
}
__device__ __forceinline__ uint4 pack(const float (&f)[8]) {
  uint4 q; __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&q);
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2*i], f[2*i+1]);
  return q;
}
