// Which rotary kernel runs a call, and its grid: a pure function of the problem and the
// device, torch-free (the launcher in rotary_cuda.cu carries it out).
#pragma once
#include <algorithm>
#include <cstdint>

namespace gpu_puzzles {

struct RotaryPlan {
  int vec;         // elements per thread step: 16 bytes of the narrowest type where allowed, else 1
  int64_t steps;   // thread steps per row: the R / 2 rotated pairs and the D - R copied elements, by vec
  int threads;     // per block
  int64_t blocks;  // a grid-stride loop covers the rest
};

// rows: q's and k's together; R: rotated width; D: row width; narrow: bytes of the narrowest
// element type of x, cos/sin and out; aligned: every row start of every operand on a 16-byte
// boundary. One thread step is vec pairs (j, j + R / 2) or vec copied elements.
inline RotaryPlan rotary_plan(int64_t rows, int64_t R, int64_t D, int narrow, bool aligned, int sms) {
  RotaryPlan p{};
  const int v = 16 / narrow;
  p.vec = aligned && (R / 2) % v == 0 && (D - R) % v == 0 ? v : 1;
  p.steps = (R / 2) / p.vec + (D - R + p.vec - 1) / p.vec;
  p.threads = 256;
  const int64_t work = rows * p.steps;
  p.blocks = std::max<int64_t>(1, std::min<int64_t>((work + p.threads - 1) / p.threads, int64_t(sms) * 16));
  return p;
}

}  // namespace gpu_puzzles
