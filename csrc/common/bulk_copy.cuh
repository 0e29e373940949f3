// Hopper bulk copies (the TMA unit's 1D form, no tensor map) and the shared-memory
// barrier that counts their bytes. One thread issues a copy of a whole contiguous
// range; every thread waits on the barrier's phase. Bodies are empty below sm_90
// (callers guard their use by architecture).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "common/cp_async.cuh"  // smem_addr

namespace gpu_puzzles {

// Expects one arrival per phase (the issuing thread's expect_tx).
__device__ __forceinline__ void mbar_init(uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_addr(bar)) : "memory");
  // Make the initialised barrier visible to the async (TMA) proxy.
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

// The arrival of this phase, announcing `bytes` of copies that will complete on it.
__device__ __forceinline__ void mbar_arrive_expect(uint64_t* bar, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
#endif
}

// global -> this block's shared memory, `bytes` a multiple of 16, both addresses
// 16-byte aligned. Ordered after the caller's earlier generic-proxy accesses to
// the destination by the fence (the block's reads of the previous contents).
__device__ __forceinline__ void bulk_load(void* smem, const void* gmem, unsigned bytes, uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_addr(smem)),
               "l"(gmem), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
#endif
}

// Blocks until the barrier's phase `parity` (0, 1, 0, ...) has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  unsigned done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  } while (!done);
#endif
}

}  // namespace gpu_puzzles
