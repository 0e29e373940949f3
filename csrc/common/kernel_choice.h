// One typed channel to override the per-op kernel heuristics, for tests and tuning
// sweeps (Python: gpu_puzzles.tuning.override). Each op's plan reads its knobs here;
// a knob at 0 leaves the choice to the op's heuristic. Only the plans (<op>_plan.h, and
// the .cu files beside them) read it: torch-free, so plans the launchers ask may include
// it too. Process-wide: an override applies to every thread.
#pragma once

namespace gpu_puzzles {

// The order matches kKnobs in kernel_choice.cpp (one row per knob: name and values).
enum class Knob : int {
  SoftmaxRows,          // long rows: cluster | staged | smem | bulk (SoftmaxRowsKernel)
  SoftmaxCluster,       // 4 | 8 | 16
  SoftmaxStages,        // 1 | 2 | 3
  SoftmaxCols,          // non-last dim: inner | staged (SoftmaxColsKernel)
  SoftmaxColRowsFwd,    // 4 | 8 | 16
  SoftmaxColRowsBwd,    // 4 | 8 | 16
  SoftmaxGrid,          // 1 | 4
  SoftmaxSmemAlign,     // smem/bulk rows, the most specialised kernel allowed: aligned | same | shifted
  AttentionFwd,         // forward kernel: mma | mma_r32 | wgmma | wgmma3 | ws | ws2 | ws3 | ws192
  AttentionFwdWarps,    // mma kernel's warps per block: 4 | 8
  AttentionBwd,         // backward: mma (two passes, deterministic) | wgmma (sm_90a, dq in any order) |
                        // wgmma_split | wgmma_turns (wgmma, D = 64: dQ by column halves | by turns)
  AttentionOrder,       // sm_90a causal grids: rows ((batch, head)-major) | longest (heaviest blocks first)
  AttentionFwdGrid,     // ws forward's grid: blocks (one CTA a query block) | persistent (default where balanced)
  AttentionBwdGrid,     // wgmma backward's grid: blocks (one CTA a key block) | persistent (default where balanced)
  LayerNormLinearEvt,   // sm_90 fused forward: evt (CUTLASS epilogue) | cublas
  LayerNormLinearPdl,   // EVT launches: pdl (programmatic dependent) | plain
  LayerNormLinearPlan,  // fused forward: fold (gamma into W) | normalize (xn, then cuBLAS)
  CpuSimd,              // CPU kernels' SIMD level, a cap: baseline | avx2 | avx512 (common/cpu_isa.h)
  CrossEntropyChunk,    // fused linear cross-entropy: rows per chunk
  Count
};

// 0: not overridden; i >= 1: the knob's i-th value (1-based, in its table order).
int knob(Knob k);

// The overriding value as written in the table ("smem", "16"), or nullptr.
const char* knob_value(Knob k);

// The overriding value as a number ("16" -> 16), or `fallback` when not overridden.
int knob_int(Knob k, int fallback);

}  // namespace gpu_puzzles
