// Torch-free interface between softmax.cpp (ATen side), the CUDA files and the CPU
// kernels (softmax_cpu.cpp). Every tensor is viewed as (outer, N, inner), N the
// reduced dim; outputs are contiguous, inputs contiguous except the CUDA rows
// (inner == 1) of the auto algorithm, whose rows may sit at any strides (RowStrides).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/cpu_isa.h"
#include "common/dtype.h"
#include "common/row_strides.h"

namespace gpu_puzzles {

// Auto: the fastest kernel for the shape. The other three are the curriculum's
// steps, kept for the notebook; they run one block per row over a contiguous
// last dim (the host moves another dim last first):
//   Tree    : the seed's shared-memory tree reduction, three passes (max, sum, write);
//   Shuffle : warp-shuffle block reduction, three passes;
//   Online  : single-pass running (max, sum), then one write pass.
enum class SoftmaxAlgo : int { Auto = 0, Tree = 1, Shuffle = 2, Online = 3 };

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

struct SoftmaxArgs {
  const void* a;  // forward: x;     backward: y (the forward's output)
  const void* b;  // forward: null;  backward: dy
  void* out;      // forward: y;     backward: dx
  int64_t outer, N, inner;
  bool log;  // log_softmax instead of softmax
  DType dtype;
  SoftmaxTuning tune;  // softmax_tuning(), filled by the caller
  // Row starts of a and b (common/row_strides.h; inner == 1 only: the CPU and the
  // other CUDA paths take contiguous inputs, {1, N, 0}); `out` is always contiguous.
  RowStrides la, lb;
};

// Bytes of scratch the launch needs (the split path for very long rows keeps
// per-chunk partial statistics there); 0 when none.
int64_t softmax_workspace_bytes(const SoftmaxArgs& a, SoftmaxAlgo algo, bool backward);

// CPU kernels (softmax_cpu.cpp, one copy per SIMD level: call through GP_CPU_CALL).
// Every algorithm runs the same CPU kernel; `tune` is ignored. N >= 1, outer * inner >= 1.
GP_CPU_DECLARE(void, softmax_forward_cpu, const SoftmaxArgs& a)
GP_CPU_DECLARE(void, softmax_backward_cpu, const SoftmaxArgs& a)

LaunchStatus softmax_forward_cuda(const SoftmaxArgs& a, SoftmaxAlgo algo, void* workspace, cudaStream_t stream);
LaunchStatus softmax_backward_cuda(const SoftmaxArgs& a, SoftmaxAlgo algo, void* workspace, cudaStream_t stream);

}  // namespace gpu_puzzles
