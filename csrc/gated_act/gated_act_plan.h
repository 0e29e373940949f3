// Which gated_act kernel runs a call, and its grid: a pure function of the problem and the
// device, torch-free (the launchers in gated_act_cuda.cu carry it out).
#pragma once
#include <algorithm>
#include <cstdint>

namespace gpu_puzzles {

struct GatedActPlan {
  int vec;         // elements per thread step: 16 bytes' worth where every row start allows, else 1
  int threads;     // per block
  int64_t grid_x;  // blocks over a row's I / vec steps
  int64_t grid_y;  // blocks over rows (each loops over rows with a stride of grid_y)
};

// elem: bytes per element; aligned: every row start of every operand on a 16-byte boundary.
// Enough blocks to fill the device several times over; rows beyond them are looped over,
// so the grid stays within gridDim.y's 65535.
inline GatedActPlan gated_act_plan(int64_t rows, int64_t I, int elem, bool aligned, int sms) {
  GatedActPlan p{};
  p.vec = aligned && (I * elem) % 16 == 0 ? 16 / elem : 1;
  const int64_t steps = (I + p.vec - 1) / p.vec;
  p.threads = static_cast<int>(std::min<int64_t>(256, std::max<int64_t>(32, (steps + 31) / 32 * 32)));
  p.grid_x = (steps + p.threads - 1) / p.threads;
  const int64_t want = std::max<int64_t>(1, int64_t(sms) * 8 / std::max<int64_t>(1, p.grid_x));
  p.grid_y = std::min<int64_t>({rows, want * 4, 65535});
  return p;
}

}  // namespace gpu_puzzles
