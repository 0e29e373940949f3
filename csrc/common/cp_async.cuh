// Ampere+ asynchronous global -> shared copies (cp.async, 16 bytes, L2 only).
// A thread's copies land in shared memory once it waits on their group; only
// that thread may rely on them without a barrier. Bodies are empty below sm_80
// (callers guard their use by architecture).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace gpu_puzzles {

// A generic pointer into shared memory as the 32-bit address PTX takes.
__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
#endif
}

// The same to a shared address; valid == false zero-fills the 16 bytes instead
// (gmem must still be a mapped address: callers pass the tensor base).
__device__ __forceinline__ void cp_async16_zfill(unsigned smem, const void* gmem, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem), "r"(valid ? 16 : 0)
               : "memory");
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Wait until at most N of this thread's committed groups are still pending.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// Copy rows [row0, row0 + ROWS) of a row-major (S, D) matrix whose rows are ld elements
// apart (D a multiple of 8; src and ld * sizeof(T) 16-byte aligned; ROWS * ld < 2^31) into
// the shared tile whose element (r, c) is at(r, c) (c a multiple of 8), 16 bytes per
// cp.async; rows >= S are zero-filled. NT threads cooperate. The offsets within the tile
// are 32-bit: a thread's chunk offsets then stay loop-invariant 32-bit registers, as with
// a compile-time row length, instead of 64-bit products.
template <int ROWS, int D, int NT, class At, class T>
__device__ __forceinline__ void load_rows_async(At&& at, const T* __restrict__ src, int64_t ld, int64_t row0, int64_t S,
                                                int tid) {
  constexpr int CPR = D / 8;  // 16-byte chunks per row
  constexpr int TOTAL = ROWS * CPR;
  const T* tile = src + row0 * ld;
  const int ld32 = static_cast<int>(ld);
#pragma unroll
  for (int it = 0; it < (TOTAL + NT - 1) / NT; ++it) {
    const int idx = tid + it * NT;
    if (TOTAL % NT == 0 || idx < TOTAL) {
      const int r = idx / CPR, ch = idx - r * CPR;
      const bool valid = row0 + r < S;
      const T* g = valid ? tile + (r * ld32 + ch * 8) : src;
      cp_async16_zfill(smem_addr(at(r, ch * 8)), g, valid);
    }
  }
}

// The same for a contiguous matrix (ld = D).
template <int ROWS, int D, int NT, class At, class T>
__device__ __forceinline__ void load_rows_async(At&& at, const T* __restrict__ src, int64_t row0, int64_t S, int tid) {
  load_rows_async<ROWS, D, NT>(at, src, static_cast<int64_t>(D), row0, S, tid);
}

}  // namespace gpu_puzzles
