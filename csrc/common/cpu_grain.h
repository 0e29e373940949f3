// The parallel grain of the CPU kernels: rows per at::parallel_for task step, so that
// a step holds at least kGrainElems elements (torch's own grain for cheap element work).
#pragma once
#include <algorithm>
#include <cstdint>

namespace gpu_puzzles {

constexpr int64_t kGrainElems = 32768;
inline int64_t grain_rows(int64_t row_elems) {
  return std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, row_elems));
}

}  // namespace gpu_puzzles
