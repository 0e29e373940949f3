// The kernel choice of the coalesced embedding kernels (embedding_cuda.cu), in one place:
// whether a row moves in 16-byte vectors or in scalars, and how its slots spread over the
// lanes of a group. Torch-free; the launchers carry the plan out. (The 2D grid and the
// atomic backward are the curriculum's, chosen by algorithm=, and have no plan.)
#pragma once
#include <cstdint>

#include "embedding/embedding.h"

namespace gpu_puzzles {
namespace embedding {

constexpr int kThreads = 256;
constexpr int kU = 4;  // vectors per lane per work unit (loads in flight)

// A row of nvec N-element slots is cut into chunks of G * kU slots; work unit
// (row, chunk) belongs to one group of G lanes, lane l taking slots
// chunk * G * kU + u * G + l (u < kU): each u step is one coalesced request.
struct Plan {
  bool vec;        // N = 16 / element size (one 16-byte vector a slot), else N = 1 (a scalar)
  int64_t nvec;    // slots per row
  int lg;          // log2 of the group size G
  int64_t chunks;  // chunks per row
};

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// Rows of E elements of `es` bytes; vec: 16-byte vectors (E, the row starts and the bases allow them).
inline Plan plan_rows(int64_t E, int64_t es, bool vec) {
  Plan p{};
  p.vec = vec;
  p.nvec = E / (vec ? 16 / es : 1);
  const int64_t per_lane = (p.nvec + kU - 1) / kU;
  int g = 1, lg = 0;
  while (g < 32 && g < per_lane) g <<= 1, ++lg;
  p.lg = lg;
  p.chunks = (p.nvec + (int64_t(g) * kU) - 1) / (int64_t(g) * kU);
  return p;
}

// The forward's: weight rows (every w_stride elements) read, out rows written, in vectors
// where every row of both starts 16-byte aligned.
inline Plan forward_plan(const EmbeddingFwdArgs& a, int64_t es) {
  const bool vec = (a.E * es) % 16 == 0 && (a.w_stride * es) % 16 == 0 && aligned16(a.weight) && aligned16(a.out);
  return plan_rows(a.E, es, vec);
}

// The sorted backward's: grad_out rows read at their row strides, grad_weight rows written.
inline Plan backward_plan(const EmbeddingBwdArgs& a, int64_t es) {
  const bool vec = (a.E * es) % 16 == 0 && (a.gs.s0 * es) % 16 == 0 && (a.gs.s1 * es) % 16 == 0 &&
                   aligned16(a.grad_out) && aligned16(a.grad_weight);
  return plan_rows(a.E, es, vec);
}

}  // namespace embedding
}  // namespace gpu_puzzles
