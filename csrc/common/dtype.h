// Scalar types shared by host (.cpp) and device (.cu) code. The .cu files never
// include torch headers (build time): the host side maps at::ScalarType to this
// enum and passes plain pointers.
#pragma once
#include <cstdint>

namespace gpu_puzzles {

enum class DType : int { Float32 = 0, Float64 = 1, Float16 = 2, BFloat16 = 3 };

// Return code of a launcher: 0 on success, else a cudaError_t value.
using LaunchStatus = int;

}  // namespace gpu_puzzles
