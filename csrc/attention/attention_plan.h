// Internal to the attention .cu files (torch-free): which kernel runs a call, decided in
// one place (attention_plan.cu), and the launchers of the kernel families it picks from:
//   attention_fwd_sm90.cu   wgmma forward, sm_90a (attention_fwd_sm90.h)
//   attention_fwd_sm80.cu   mma.sync forward, fp16/bf16, sm_80+
//   attention_bwd_sm80.cu   mma.sync backward, fp16/bf16, sm_80+
//   attention_simt.cu       SIMT forward and backward: any dtype, any D, Dv <= 256
// Every launcher takes the contract of attention.h and is asynchronous.
#pragma once
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>

#include "attention/attention.h"

namespace gpu_puzzles {

// ---- The sm_90a grids (for_ordered_grids, attention_common.cuh) -----------------------------
// The plan reads the knobs attention_order and attention_{fwd,bwd}_grid; the rules below take
// what only the launch knows (blocks a row, rows, SMs) and live here beside the plan's.

enum class AttnGrid {
  Balanced,    // persistent where that keeps the CTAs balanced (attn_grid_ctas), else one CTA a block
  Blocks,      // one CTA a block (knob attention_{fwd,bwd}_grid=blocks)
  Persistent,  // one CTA an SM, each running its blocks in turn (=persistent)
};

struct AttnGridPlan {
  AttnGrid grid = AttnGrid::Balanced;
  bool longest_first = true;  // causal grids: heaviest blocks first, by chunks of rows (attention_order=longest);
                              // false: (batch, head)-major (attention_order=rows)
};

// The CTAs of a launch of `blocks` blocks, in chunks of `chunk_blocks` (BlockOrder: gx * cb): a
// persistent grid (one CTA an SM, each running its blocks in turn, WorkCursor) where it keeps the
// CTAs balanced, else one CTA a block; g.grid forces one. The snake pairs a CTA's heavier and
// lighter blocks only over chunks of about two rounds or more: over chunks of one to two rounds,
// the CTAs of the first round take the heaviest blocks alone, chunk after chunk (the
// (4,32,4096,128) causal backward, chunks of 160 blocks on 132 SMs, ran 0.60x one CTA a block;
// benchmarks/results/attention_bwd_grid_h100.json). Full grids (blocks of equal work) are always
// balanced.
inline unsigned attn_grid_ctas(const AttnGridPlan& g, unsigned blocks, int64_t chunk_blocks, bool causal, int sms) {
  const bool balanced = !causal || blocks <= static_cast<unsigned>(sms) || chunk_blocks * 10 >= int64_t{19} * sms;
  const bool persistent = g.grid == AttnGrid::Persistent || (g.grid == AttnGrid::Balanced && balanced);
  return persistent ? std::min(blocks, static_cast<unsigned>(sms)) : blocks;
}

// Rows a chunk of a causal grid: as many as keep what they read under 16 MB of L2, and at least
// a wave of CTAs (one CTA an SM). All rows at once thrash the L2 (forward (4,32,4096,128): 1.57
// ms against 1.03); a chunk of fewer blocks than SMs leaves the order nothing to balance (a GQA
// backward's kv head reads 16 MB at 4096 keys and is 32 blocks: 1.29 ms as one-row chunks, 0.89
// as four) (benchmarks/results/attention_order_h100.txt). The chunks are of equal size (to a row):
// a short last chunk would start its heaviest blocks last. 1 for full grids, or in
// (batch, head)-major order (!g.longest_first).
inline int64_t attn_chunk_rows(const AttnGridPlan& g, bool causal, int64_t nbh, int gx, int sms,
                               int64_t bytes_per_row) {
  constexpr int64_t kL2Budget = int64_t{16} << 20;
  if (!causal || nbh <= 1 || !g.longest_first) return 1;
  const int64_t by_l2 = kL2Budget / std::max<int64_t>(bytes_per_row, 1);
  const int64_t one_wave = (std::max(sms, 1) + gx - 1) / std::max(gx, 1);
  const int64_t cb = std::max<int64_t>(1, std::min<int64_t>(nbh, std::max(by_l2, one_wave)));
  const int64_t chunks = (nbh + cb - 1) / cb;
  return (nbh + chunks - 1) / chunks;
}

// ---- The kernels ------------------------------------------------------------------------------

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
  AttnGridPlan grid{};  // WgmmaWs: its grid (knobs attention_order, attention_fwd_grid)
};

enum class AttnBwdKernel {
  Simt,   // attention_bwd_simt
  Mma,    // attention_bwd_mma: two deterministic passes (knob attention_bwd=mma)
  Wgmma,  // attention_backward_sm90: one warp-specialised pass, dq by float32 atomics (wgmma)
};

struct AttnBwdPlan {
  AttnBwdKernel kernel;
  bool dq_turns = false;  // Wgmma at D = 64: the consumers take turns over dQ (wgmma_turns), else
                          // each takes half its columns (wgmma_split)
  AttnGridPlan grid{};    // Wgmma: its grid (knobs attention_order, attention_bwd_grid)
};

// The forward's kernel for this call and device: the default heuristic, overridden by
// the knobs attention_fwd (mma | mma_r32 | wgmma | wgmma3) and attention_fwd_warps
// (4 | 8, for mma) where the kernel can take the call. Errors from CUDA queries are
// returned in err.
AttnFwdPlan attention_fwd_plan(const AttentionFwdArgs& a, int dev, cudaError_t& err);
// The backward's kernels: the default heuristic, overridden by the knob attention_bwd
// (mma | wgmma | wgmma_split | wgmma_turns) where the kernel can take the call.
AttnBwdPlan attention_bwd_plan(const AttentionBwdArgs& a, int dev, cudaError_t& err);

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
