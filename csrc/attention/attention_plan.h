// Internal to the attention .cu files (torch-free): which kernel runs a call, decided in
// one place (attention_plan.cu), and the launchers of the kernel families it picks from:
//   attention_fwd_sm90.cu   wgmma forward, sm_90a (attention_fwd_sm90.h)
//   attention_fwd_sm80.cu   mma.sync forward, fp16/bf16, sm_80+
//   attention_bwd_sm80.cu   mma.sync backward, fp16/bf16, sm_80+
//   attention_simt.cu       SIMT forward and backward: any dtype, any D, Dv <= 256
// Every launcher takes the contract of attention.h and is asynchronous.
#pragma once
#include <cuda_runtime_api.h>

#include "attention/attention.h"

namespace gpu_puzzles {

enum class AttnFwdKernel {
  Simt,     // attn_fwd_simt
  Mma,      // attn_fwd_mma: 16 query rows per warp, `warps` warps (knob attention_fwd=mma)
  MmaR32,   // attn_fwd_mma_r32, 32 rows per warp, 32-key tiles, 4 warps, 2 stages (mma_r32)
  Wgmma,    // attn_fwd_sm90 with `warpgroups` warpgroups (wgmma: 2, wgmma3: 3)
  WgmmaWs,  // attn_fwd_ws_sm90: TMA producer warpgroup + 2 or 3 consumer warpgroups
};

struct AttnFwdPlan {
  AttnFwdKernel kernel;
  int warps;       // Mma: 4 or 8
  int warpgroups;  // Wgmma: 2 or 3
  // WgmmaWs: 0 ws, 1 ws2 (consumers' GEMMs overlap their softmax), 2 ws3 (+ pingpong);
  // 3 ws192 (ws3 with 3 consumers, 192 rows; D = 64 only)
  int variant = 0;
};

enum class AttnBwdKernel {
  Simt,   // attention_bwd_simt
  Mma,    // attention_bwd_mma: two deterministic passes (knob attention_bwd=mma)
  Wgmma,  // attention_backward_sm90: one warp-specialised pass, dq by float32 atomics (wgmma)
};

// The forward's kernel for this call and device: the default heuristic, overridden by
// the knobs attention_fwd (mma | mma_r32 | wgmma | wgmma3) and attention_fwd_warps
// (4 | 8, for mma) where the kernel can take the call. Errors from CUDA queries are
// returned in err.
AttnFwdPlan attention_fwd_plan(const AttentionFwdArgs& a, int dev, cudaError_t& err);
// The backward's kernels: the default heuristic, overridden by the knob attention_bwd
// (mma | wgmma) where the kernel can take the call.
AttnBwdKernel attention_bwd_plan(const AttentionBwdArgs& a, int dev, cudaError_t& err);

// p.kernel is Mma or MmaR32; fp16/bf16, D == Dv in {64, 128}, 16-byte aligned, sm_80+.
cudaError_t attention_fwd_mma(const AttentionFwdArgs& a, const AttnFwdPlan& p, int dev, cudaStream_t stream);
// Same conditions (and dout, dq, dk, dv aligned); delta: float32 rowsum(dout * o) per query row.
cudaError_t attention_bwd_mma(const AttentionBwdArgs& a, const float* delta, int dev, cudaStream_t stream);

cudaError_t attention_fwd_simt(const AttentionFwdArgs& a, int dev, cudaStream_t stream);
// delta = rowsum(dout * o) per query row, in the accumulate type (float32, float64 for
// float64), written to the workspace; both backward families read it.
cudaError_t attention_bwd_delta(const AttentionBwdArgs& a, void* delta, cudaStream_t stream);
cudaError_t attention_bwd_simt(const AttentionBwdArgs& a, const void* delta, int dev, cudaStream_t stream);

}  // namespace gpu_puzzles
