// Pointer alignment, shared by host code (.cpp) and launchers (.cu); torch-free.
#pragma once
#include <cstdint>

namespace gpu_puzzles {

// The 16-byte vector paths (uint4 loads, cp.async, TMA) need 16-byte aligned bases.
inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace gpu_puzzles
