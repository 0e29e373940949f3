// The ATen side of row_strides.h: a tensor's rows as (tensor, RowStrides) for the kernels,
// read in place when they collapse to two levels, else from one contiguous copy.
#pragma once
#include <ATen/ATen.h>

#include <utility>

#include "common/row_strides.h"

namespace gpu_puzzles {

// rows = true: the rows of t's last dim (which must be contiguous, else t is copied);
// rows = false: every element is a row (indices, targets).
inline std::pair<at::Tensor, RowStrides> tensor_rows(const at::Tensor& t, bool rows) {
  const int64_t dims = rows ? t.dim() - 1 : t.dim();
  const bool inner_ok = !rows || t.size(-1) <= 1 || t.stride(-1) == 1;
  RowStrides s;
  if (inner_ok && collapse_rows(t.sizes().data(), t.strides().data(), dims, s) >= 0) return {t, s};
  const at::Tensor c = t.contiguous();
  collapse_rows(c.sizes().data(), c.strides().data(), dims, s);
  return {c, s};
}

}  // namespace gpu_puzzles
