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

// Rows per chunk of the fused linear cross-entropy: 4096, fewer where a chunk's logits would
// pass kCeChunkBytes. Each chunk adds the float32 (V, H) weight gradient once (read and
// written), so small chunks turn the op memory-bound: on an H100 (fwd+bwd, N = 8192, bf16;
// benchmarks/results/cross_entropy_chunk_sweep_h100.json) 4096-row chunks against the old 256-MiB ones
// ran GPT-2's head 4.22 -> 3.94 ms, a Llama-3 head (2048 -> 128256) 24.8 -> 21.3 ms and
// Gemma 2's (2304 -> 256000, capped) 76.0 -> 52.9 ms, each with a lower peak than
// torch.compile's (626 / 2036 / 4286 MiB vs 945 / 2537 / 5161); 8192 rows gained < 2% more
// for 1.5-2x the memory.
constexpr int64_t kCeChunkRows = 4096;
constexpr int64_t kCeChunkBytes = int64_t(2) << 30;

inline CrossEntropyPlan cross_entropy_plan(int64_t rows, int64_t V, int64_t elem_bytes) {
  CrossEntropyPlan p{};
  // About 8 vectors of 16 bytes per thread per row, 32 to 512 threads: several blocks per
  // SM stay resident, so one row's reduction tail overlaps other rows' loads.
  const int64_t nvec = (V * elem_bytes + 15) / 16;
  p.threads = 32;
  while (p.threads < 512 && int64_t(p.threads) * 8 < nvec) p.threads *= 2;
  // Fused: as few chunks as keep each within both limits, of equal size (10000 rows: 3 x 3334,
  // not 2 x 4096 + 1808), so no GEMM runs on a sliver of rows.
  rows = std::max<int64_t>(rows, 1);
  const int64_t by_bytes = std::max<int64_t>(1, kCeChunkBytes / std::max<int64_t>(1, V * elem_bytes));
  const int64_t most = std::min(kCeChunkRows, by_bytes);
  const int64_t chunks = (rows + most - 1) / most;
  const int knob_rows = knob_int(Knob::CrossEntropyChunk, 0);  // the knob's values are row counts
  p.chunk_rows = knob_rows > 0 ? std::min<int64_t>(rows, knob_rows) : (rows + chunks - 1) / chunks;
  return p;
}

}  // namespace gpu_puzzles
