// Torch-free interface of the curriculum's attention chain (attention.cpp ->
// attention_unfused_cuda.cu): a shared-memory tiled transpose and a shared-memory
// tiled matmul (puzzle 14), batched over a leading dim. The softmax between them
// is the softmax op's own kernel. Every tensor contiguous; sizes int64.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/dtype.h"

namespace gpu_puzzles {

// out (B, N, M) = x (B, M, N) with the last two dims swapped.
LaunchStatus transpose_last2_cuda(const void* x, void* out, int64_t B, int64_t M, int64_t N, DType dt,
                                  cudaStream_t stream);

// c (B, M, N) = alpha * a (B, M, K) @ b (B, K, N); with causal_mask, c[m, n] = -inf
// where n > m (SDPA's top-left aligned is_causal mask, applied before softmax).
LaunchStatus matmul_cuda(const void* a, const void* b, void* c, int64_t B, int64_t M, int64_t N, int64_t K,
                         double alpha, bool causal_mask, DType dt, cudaStream_t stream);

}  // namespace gpu_puzzles
