// Host helpers shared by the standalone CUDA benchmarks (evt_sweep/, layer_norm_*_variants.cu,
// experiments/lone_sm_bw.cu): a CUDA error check, deterministic uniform fills (an LCG, so
// every run times the same data) and the event-timed median of a batch of calls.
#pragma once
#include <cuda_bf16.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s line %d\n", cudaGetErrorString(e), __LINE__); exit(1);} } while (0)
// bf16 values uniform in [-sc/2, sc/2)
inline void fillb(void* p, size_t n, unsigned seed, float sc) { std::vector<__nv_bfloat16> h(n); unsigned s = seed; for (size_t i = 0; i < n; ++i) { s = s * 1664525u + 1013904223u; h[i] = __float2bfloat16(((s >> 8) / 16777216.f - 0.5f) * sc); } CK(cudaMemcpy(p, h.data(), n * 2, cudaMemcpyHostToDevice)); }
// float values uniform in [off - sc/2, off + sc/2)
inline void fillf(float* p, size_t n, unsigned seed, float sc, float off) { std::vector<float> h(n); unsigned s = seed; for (size_t i = 0; i < n; ++i) { s = s * 1664525u + 1013904223u; h[i] = ((s >> 8) / 16777216.f - 0.5f) * sc + off; } CK(cudaMemcpy(p, h.data(), n * 4, cudaMemcpyHostToDevice)); }
// Median of R calls f(0) .. f(R-1), each bracketed by a pair of events, queued as they come:
// the caller warms up and decides what the GPU runs before the batch.
template <class F> float event_median_ms(F f, int R) {
  std::vector<cudaEvent_t> ev(2 * R); for (auto& e : ev) cudaEventCreate(&e);
  for (int i = 0; i < R; ++i) { cudaEventRecord(ev[2*i]); f(i); cudaEventRecord(ev[2*i+1]); }
  CK(cudaDeviceSynchronize());
  std::vector<float> t(R); for (int i = 0; i < R; ++i) cudaEventElapsedTime(&t[i], ev[2*i], ev[2*i+1]);
  for (auto& e : ev) cudaEventDestroy(e);
  std::sort(t.begin(), t.end()); return t[R / 2];
}
