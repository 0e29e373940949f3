// Hopper (sm_90a) attention forward with warpgroup MMA (wgmma), attention_fwd_sm90.cu.
// Built only when setup.py finds the CUTLASS/CuTe headers (it then defines
// GPU_PUZZLES_WITH_SM90A and compiles this file for sm_90a). attention_fwd_plan
// (attention_plan.cu) decides when it runs.
// Same contract as attention_forward_cuda (attention.h): o in the input dtype,
// lse float32 natural-log log-sum-exp; lse = -inf and o = 0 when Sk == 0.
#pragma once
#include <cuda_runtime_api.h>

#include "attention/attention.h"
#include "attention/attention_plan.h"  // AttnGridPlan

namespace gpu_puzzles {

// True when device dev is a 9.x GPU and this build holds the kernel's sm_90a code for it.
// Errors from CUDA queries are returned in err (then false).
bool attention_forward_sm90_available(int dev, cudaError_t& err);

// Launches the wgmma forward (asynchronous) on a call of fp16/bf16, D == Dv in {64, 128},
// q/k/v/o 16-byte aligned; only where available() said true. warpgroups: 2 (BM = 128
// query rows per CTA) or 3 (BM = 192); see the .cu for the tilings.
cudaError_t attention_forward_sm90(const AttentionFwdArgs& a, int warpgroups, int dev, cudaStream_t stream);

// The warp-specialised, TMA-fed variant (knob attention_fwd=ws; variant 1 = ws2, each
// consumer's GEMMs overlapping its softmax; 2 = ws3, ws2 with the consumers taking turns;
// 3 = ws192, ws3 with three consumers, D = 64 only), for the same calls where ws_supported(a)
// also holds (strides the TMA takes, Sk > 0); same image as above. Causal grids run their
// heaviest blocks first (BlockOrder, attention_common.cuh), on a persistent grid where balanced
// (attn_grid_ctas): as `grid`, the plan's, says.
bool attention_forward_ws_supported(const AttentionFwdArgs& a);
cudaError_t attention_forward_sm90_ws(const AttentionFwdArgs& a, int variant, const AttnGridPlan& grid, int dev,
                                      cudaStream_t stream);

}  // namespace gpu_puzzles
