// Hopper (sm_90a) attention backward with warpgroup MMA (wgmma), warp-specialised and
// TMA-fed: attention_bwd_sm90.cu. Built only with the CUTLASS/CuTe headers (setup.py:
// GPU_PUZZLES_WITH_SM90A); its image is the forward's (attention_forward_sm90_available).
// attention_bwd_plan (attention_plan.cu) decides when it runs.
// Same contract as attention_backward_cuda (attention.h), for fp16/bf16, D == Dv in
// {64, 128}, rows 16-byte aligned; dq's float32 sums are not bitwise reproducible.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "attention/attention.h"
#include "attention/attention_plan.h"  // AttnBwdPlan

namespace gpu_puzzles {

// Strides and sizes the kernel's TMA descriptors and int32 indices take (else the mma.sync backward).
bool attention_backward_sm90_supported(const AttentionBwdArgs& a);
// Its workspace: lse * log2(e) and delta per query row (padded), and the float32 dq accumulator.
int64_t attention_backward_sm90_workspace_bytes(const AttentionBwdArgs& a);
// Launches the prep kernel, the backward and dq's conversion (asynchronous), as plan p
// (attention_bwd_plan: p.kernel == Wgmma) says: its dQ scheme at D = 64 and its grid.
cudaError_t attention_backward_sm90(const AttentionBwdArgs& a, const AttnBwdPlan& p, void* workspace, int dev,
                                    cudaStream_t stream);

}  // namespace gpu_puzzles
