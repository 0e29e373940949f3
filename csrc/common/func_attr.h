// Per-device host caches of kernel attributes: attribute queries and
// cudaFuncSetAttribute cost microseconds per call, so steady-state launches make
// none. Lock-free: a race only repeats an idempotent query/set. Devices past the
// table are served uncached.
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>

namespace gpu_puzzles {

constexpr int kMaxCachedDevices = 64;
inline bool cacheable_device(int dev) { return dev >= 0 && dev < kMaxCachedDevices; }

// SMs of device dev, cached per device; 0 when the query fails (err says why).
inline int device_sm_count(int dev, cudaError_t& err) {
  static std::atomic<int> sms[kMaxCachedDevices];  // 0: not queried yet
  err = cudaSuccess;
  int n = cacheable_device(dev) ? sms[dev].load(std::memory_order_relaxed) : 0;
  if (n == 0) {
    err = cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    if (err != cudaSuccess) return 0;
    if (cacheable_device(dev)) sms[dev].store(n, std::memory_order_relaxed);
  }
  return n;
}

// Resident blocks per SM of kernel Kern at `threads` threads per block and no dynamic
// shared memory, cached per device and thread count (multiples of 32 up to 1024; other
// counts are served uncached); 0 when the query fails (err says why).
template <auto Kern>
int blocks_per_sm(int dev, int threads, cudaError_t& err) {
  static std::atomic<int> tab[kMaxCachedDevices][33];  // by threads / 32; 0: not queried yet
  err = cudaSuccess;
  const int slot = threads / 32;
  const bool cache = cacheable_device(dev) && threads % 32 == 0 && slot >= 1 && slot <= 32;
  int n = cache ? tab[dev][slot].load(std::memory_order_relaxed) : 0;
  if (n == 0) {
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, Kern, threads, 0);
    if (err != cudaSuccess) return 0;
    if (cache && n > 0) tab[dev][slot].store(n, std::memory_order_relaxed);
  }
  return n;
}

// Opt kernel Kern in to `bytes` of dynamic shared memory on device dev (the current
// one). Remembers per device the largest size set (a kernel's size may depend on
// the shape), never lowering it under a larger launch.
template <auto Kern>
cudaError_t set_smem(int dev, size_t bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  static std::atomic<int> done[kMaxCachedDevices];  // largest size set so far, 0 = none
  const int b = static_cast<int>(bytes);
  const bool cache = cacheable_device(dev);
  if (cache && done[dev].load(std::memory_order_acquire) >= b) return cudaSuccess;
  const cudaError_t e = cudaFuncSetAttribute(Kern, cudaFuncAttributeMaxDynamicSharedMemorySize, b);
  if (e == cudaSuccess && cache) {
    int cur = done[dev].load(std::memory_order_relaxed);
    while (cur < b && !done[dev].compare_exchange_weak(cur, b, std::memory_order_release)) {
    }
  }
  return e;
}

}  // namespace gpu_puzzles
