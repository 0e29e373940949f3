// The kernel choice of conv1d and conv1d_backward, in one place (torch-free): the path of
// algorithm="auto" (conv1d_auto_algo, asked by the host, conv1d.cpp) and how the fast path
// runs a call: its 16-byte form, the taps it is compiled for and, backward, how the batch
// is split (conv1d::fast_plan, asked by the launchers, conv1d_cuda.cu, which carry it out).
#pragma once
#include <cstdint>

#include "conv1d/conv1d.h"

namespace gpu_puzzles {

// "auto": the fast path where it takes K (any K on the CPU, whose one kernel takes every
// algorithm), else the tiled path while its shared memory holds the taps, else the naive one.
inline Conv1dAlgo conv1d_auto_algo(int64_t K, bool on_cuda) {
  if (!on_cuda || K <= kConv1dFastMaxK) return Conv1dAlgo::Fast;
  return K <= kConv1dTiledMaxK ? Conv1dAlgo::Tiled : Conv1dAlgo::Naive;
}

namespace conv1d {

constexpr int kE = 8;          // elements per lane in the fast path
constexpr int kWarps = 4;      // warps per block in the fast path
constexpr int kSeg = 32 * kE;  // elements per warp segment of a row

struct FastPlan {
  bool vec;           // 16-byte vectors: every row start aligned, L a whole number of lanes' chunks
  int kmax;           // taps the kernel is compiled for: 4, or kConv1dFastMaxK
  int64_t segs;       // warp segments a row
  int64_t bper, nbg;  // backward: batches a group, groups (the forward: 1, 1)
};

// 16-byte vectors need every row start aligned: the bases, and the row strides of the
// strided inputs (`rows`) in whole vectors.
inline bool vec_ok(const void* const* ptrs, int n, const RowStrides* rows, int nrows, int64_t L, int elem) {
  if ((L * elem) % 16 != 0 || L % kE != 0) return false;
  for (int i = 0; i < n; ++i)
    if (ptrs[i] && (reinterpret_cast<uintptr_t>(ptrs[i]) & 15) != 0) return false;
  for (int i = 0; i < nrows; ++i)
    if ((rows[i].s0 * elem) % 16 != 0 || (rows[i].s1 * elem) % 16 != 0) return false;
  return true;
}

// Split the batch so the backward grid has enough warps even for small C * L.
inline void batch_groups(int64_t B, int64_t C, int64_t segs, int64_t* bper, int64_t* nbg) {
  const int64_t want = 16384;
  if (C * segs == 0) {  // empty rows: nothing to split
    *bper = 1;
    *nbg = 1;
    return;
  }
  int64_t groups = (want + C * segs - 1) / (C * segs);
  if (groups < 1) groups = 1;
  if (groups > B) groups = B > 0 ? B : 1;
  *bper = (B + groups - 1) / groups;
  if (*bper < 1) *bper = 1;
  *nbg = (B + *bper - 1) / *bper;
}

// The fast path on rows of L, K taps; vec: vec_ok of the call's pointers and strides;
// backward: split the batch B over groups (batch_groups).
inline FastPlan fast_plan(int64_t B, int64_t C, int64_t L, int K, bool vec, bool backward) {
  FastPlan p{vec, K <= 4 ? 4 : kConv1dFastMaxK, (L + kSeg - 1) / kSeg, 1, 1};
  if (backward) batch_groups(B, C, p.segs, &p.bper, &p.nbg);
  return p;
}

}  // namespace conv1d
}  // namespace gpu_puzzles
