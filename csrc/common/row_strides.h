// Rows of a tensor whose leading dims collapse to at most two levels of strides, read in
// place instead of copied (models hand over views such as logits[:, :-1, :] or
// input_ids[:, :-1]); shared by host code and kernels, torch-free.
#pragma once
#include <cstdint>

namespace gpu_puzzles {

// Row r starts (r / n1) * s0 + (r % n1) * s1 elements from the base; the elements of a
// row (or the single index of a token) are contiguous. One level of rows is {1, stride, 0}.
struct RowStrides {
  int64_t n1 = 1, s0 = 0, s1 = 0;
};

#ifdef __CUDACC__
#define GP_ROWS_FN __host__ __device__ __forceinline__
#else
#define GP_ROWS_FN inline
#endif

// Where row r starts, in host (CPU kernels) and device code. One level (the usual case)
// skips the 64-bit division.
GP_ROWS_FN int64_t row_offset(const RowStrides& L, int64_t r) {
  if (L.n1 == 1) return r * L.s0;
  return (r / L.n1) * L.s0 + (r % L.n1) * L.s1;
}

// The first `dims` dims (sizes, strides) as rows: size-1 dims dropped, a dim merged into
// the one inside it when its stride spans it exactly. Returns the number of levels left
// (0: at most one row, L = {1, 0, 0}), or -1 when more than two remain.
inline int collapse_rows(const int64_t* sizes, const int64_t* strides, int64_t dims, RowStrides& L) {
  int64_t sz[2] = {1, 1}, st[2] = {0, 0};  // innermost level first
  int n = 0;
  for (int64_t i = dims - 1; i >= 0; --i) {
    if (sizes[i] == 1) continue;
    if (n > 0 && strides[i] == st[n - 1] * sz[n - 1]) {
      sz[n - 1] *= sizes[i];
      continue;
    }
    if (n == 2) return -1;
    sz[n] = sizes[i];
    st[n] = strides[i];
    ++n;
  }
  if (n == 0)
    L = RowStrides{1, 0, 0};
  else if (n == 1)
    L = RowStrides{1, st[0], 0};
  else
    L = RowStrides{sz[0], st[1], st[0]};
  return n;
}

}  // namespace gpu_puzzles
