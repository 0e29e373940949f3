// The one heuristic of cross_entropy and fused_linear_cross_entropy (torch-free, asked by the
// host, cross_entropy.cpp, once per call): the CUDA block size of the row kernels, and the rows
// per chunk of the fused linear cross-entropy (the knob cross_entropy_chunk overrides the latter).
#pragma once
#include <algorithm>
#include <cstdint>

#include "common/kernel_choice.h"

namespace gpu_puzzles {

struct CrossEntropyPlan {
  int threads;
  int64_t chunk_rows;
};

// Chunks hold at most this many bytes of logits: large enough that the three GEMMs of a
// chunk keep the GPU busy, small against the full (N, V) logits a stock model stores.
constexpr int64_t kCeChunkBytes = int64_t(256) << 20;

inline CrossEntropyPlan cross_entropy_plan(int64_t rows, int64_t V, int64_t elem_bytes) {
  CrossEntropyPlan p{};
  // About 8 vectors of 16 bytes per thread per row, 32 to 512 threads: several blocks per
  // SM stay resident, so one row's reduction tail overlaps other rows' loads.
  const int64_t nvec = (V * elem_bytes + 15) / 16;
  p.threads = 32;
  while (p.threads < 512 && int64_t(p.threads) * 8 < nvec) p.threads *= 2;
  // Fused: as few chunks as keep each under kCeChunkBytes, of equal size (8192 rows of
  // 50257 bf16: 4 x 2048, not 3 x 2670 + 182), so no GEMM runs on a sliver of rows.
  rows = std::max<int64_t>(rows, 1);
  const int64_t by_bytes = std::max<int64_t>(1, kCeChunkBytes / std::max<int64_t>(1, V * elem_bytes));
  const int64_t chunks = (rows + by_bytes - 1) / by_bytes;
  const int knob_rows = knob_int(Knob::CrossEntropyChunk, 0);  // the knob's values are row counts
  p.chunk_rows = knob_rows > 0 ? std::min<int64_t>(rows, knob_rows) : (rows + chunks - 1) / chunks;
  return p;
}

}  // namespace gpu_puzzles
