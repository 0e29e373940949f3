// The kernel choice of softmax / log_softmax (torch-free): the knobs' values as the
// tuning of a call (softmax_tuning, read once per op call by the host, softmax.cpp), and
// the Plan that make_plan (softmax_plan.cu) fills from the call and its tuning, which the
// kernel families' launchers (softmax_rows.cu, softmax_cluster.cu, softmax_cols.cu) carry out.
#pragma once
#include <cstdint>

namespace gpu_puzzles {

// The values of the softmax_rows and softmax_cols knobs: each is its 1-based index in the knob
// table (common/kernel_choice.cpp), named as the knob's value there.
enum SoftmaxRowsKernel : int { kRowsCluster = 1, kRowsStaged = 2, kRowsSmem = 3, kRowsBulk = 4 };
enum SoftmaxColsKernel : int { kColsInner = 1, kColsStaged = 2 };

// Kernel variants of the Auto forward / backward. Each field is the value of
// its knob (common/kernel_choice.h: softmax_rows, softmax_cluster, ...) when
// overridden, else the default; softmax_tuning() decides both in one place.
struct SoftmaxTuning {
  int rows = 0;     // long rows, a SoftmaxRowsKernel: cluster (the row in a cluster's registers),
                    // staged (forward: persistent clusters, copies in flight), smem (the slice in
                    // shared memory, cp.async; forward and backward, any alignment), bulk (the
                    // same, one bulk copy)
  int cluster = 0;  // staged rows kernel: preferred cluster size, 4 (smem/bulk only), 8 or 16; smem/bulk:
                    // the cluster size of a 512 KB row (the slice is 512 KB / cluster)
  int stages = 0;   // staged kernels: copies in flight per block, 2 or 3; columns: 1 = one tile at a
                    // time (smaller blocks, several per SM)
  int cols = 0;     // non-last dim, a SoftmaxColsKernel: inner (tiles across the inner columns), staged
                    // (staged column tiles, forward and backward)
  int col_rows_fwd = 0, col_rows_bwd = 0;  // staged column kernel: rows per thread, 4, 8 or 16
  int smem_align = 0;  // smem/bulk rows: the most specialised kernel allowed, 1 aligned (rows 16-byte
                       // aligned, N % V == 0), 2 same (inputs at the output's offset in 16 bytes),
                       // 3 shifted (any); each is taken only where the layout allows it
  int grid = 0;        // one-stage staged kernels and smem/bulk rows: clusters launched per resident
                       // cluster, 1 (every cluster resident, looping) or 4 (blocks come and go)
};

// The tuning of this call: the knobs' overrides, else the built-in defaults.
// Read once per op call, so the workspace size and the launch see the same plan.
SoftmaxTuning softmax_tuning();

namespace softmax_detail {

// A call's kernel and its shape: make_plan (softmax_plan.cu) fills it from the call and its
// tuning, once for the workspace size and once for the launch (a pure function of both).
enum class Kind {
  WarpRows,
  RowWarp,
  BlockRows,
  ClusterRows,
  ClusterFwd,
  StagedRows,
  SmemRows,
  Split,
  Inner,
  InnerCluster,
  StagedCols,
  Looped
};

struct Plan {
  Kind kind;
  int ch = 1;       // chunks per thread (register paths)
  int lanes = 32;   // lanes per row (WarpRows)
  int threads = 0;  // block size (BlockRows, ClusterRows), TC (Inner)
  int64_t S = 1;    // chunks per row (Split), blocks per cluster (ClusterRows, ClusterFwd, InnerCluster)
  bool cache = false;
  int64_t smem = 0;   // dynamic shared memory bytes (Inner, StagedRows, StagedCols)
  int stages = 2;     // StagedRows, StagedCols: copies in flight per thread, in rows / tiles;
                      // 1: one at a time, several blocks per SM (grid: see `grid`)
  int64_t sv = 0;     // SmemRows: 16-byte vectors of the output a block writes per row
  int64_t sb = 0;     // SmemRows: 16-byte vectors of shared memory per input (sv, or sv + 1 where
                      // an input may be misaligned against the output)
  bool bulk = false;  // SmemRows: the slice arrives by one bulk copy (TMA), not per-thread cp.async
  int align = 2;      // SmemRows: 0 every row 16-byte aligned and N % V == 0, 1 every input row at the
                      // output row's offset within 16 bytes (smem_own_rows_kernel), 2 any (smem_rows_kernel)
  int grid = 1;       // StagedCols with 1 stage, SmemRows: clusters launched per resident cluster
  // InnerCluster keeps threads / cache / smem of the Inner plan: its fallback
  // when the cluster launch is refused.
};

}  // namespace softmax_detail
}  // namespace gpu_puzzles
