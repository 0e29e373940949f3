// Host-side argument checks. Every message names the argument, so a user sees
// which input is wrong instead of a crash or silent garbage.
#pragma once
#include <ATen/ATen.h>

#include <string>

#include "common/align.h"
#include "common/dtype.h"

namespace gpu_puzzles {

inline bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

inline bool is_half(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

// The type the kernels accumulate (and keep statistics) in: float64 for float64, else float32.
inline at::ScalarType acc_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

inline void check_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(is_supported_float(t.scalar_type()), name,
              " must be a float32, float64, float16 or bfloat16 tensor, got ", t.scalar_type());
}

inline void check_same_dtype(const at::Tensor& t, const at::Tensor& ref, const char* name, const char* ref_name) {
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), name, " has dtype ", t.scalar_type(), " but ", ref_name,
              " has dtype ", ref.scalar_type(), "; they must match");
}

inline void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* name, const char* ref_name) {
  TORCH_CHECK(t.device() == ref.device(), name, " is on ", t.device(), " but ", ref_name, " is on ", ref.device(),
              "; they must be on the same device");
}

inline void check_dim_in(const at::Tensor& t, int64_t lo, int64_t hi, const char* name) {
  TORCH_CHECK(t.dim() >= lo && t.dim() <= hi, name, " must have between ", lo, " and ", hi, " dimensions, got ",
              t.dim(), " (shape ", t.sizes(), ")");
}

inline DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return DType::Float32;
    case at::kDouble:
      return DType::Float64;
    case at::kHalf:
      return DType::Float16;
    case at::kBFloat16:
      return DType::BFloat16;
    default:
      TORCH_CHECK(false, "gpu_puzzles: unsupported dtype ", t);
  }
}

}  // namespace gpu_puzzles
