// Proves that the compute-sanitizer runs in device_run.sh can fail: kernels
// with a deliberate shared-memory race and a deliberately invalid warp barrier.
// The racy kernel sits in namespace gpu_puzzles, so the kernel-name filter
// (kns=gpu_puzzles) used for racecheck/synccheck must instrument it; the copy
// outside the namespace must be skipped by that filter.
#include <cstdio>
#include <cuda_runtime.h>

namespace gpu_puzzles {
__global__ void selfcheck_race(int* out) {
  __shared__ int s[32];
  s[threadIdx.x % 32] = threadIdx.x;  // many threads write the same word, no barrier
  out[threadIdx.x] = s[(threadIdx.x + 1) % 32];
}
__global__ void selfcheck_bad_syncwarp(int* out) {
  // Lane 1 names a mask that excludes itself: an invalid __syncwarp for synccheck.
  if (threadIdx.x == 1) __syncwarp(0x1u);
  out[threadIdx.x] = threadIdx.x;
}
}  // namespace gpu_puzzles

__global__ void unfiltered_race(int* out) {
  __shared__ int s[32];
  s[threadIdx.x % 32] = threadIdx.x;
  out[threadIdx.x] = s[(threadIdx.x + 1) % 32];
}

int main(int argc, char** argv) {
  int* out = nullptr;
  cudaMalloc(&out, 256 * sizeof(int));
  const bool sync = argc > 1;
  if (sync) {
    gpu_puzzles::selfcheck_bad_syncwarp<<<1, 32>>>(out);
  } else {
    gpu_puzzles::selfcheck_race<<<1, 256>>>(out);
    unfiltered_race<<<1, 256>>>(out);
  }
  const cudaError_t e = cudaDeviceSynchronize();
  std::printf("selfcheck %s: %s\n", sync ? "synccheck" : "racecheck", cudaGetErrorString(e));
  cudaFree(out);
  return 0;
}
