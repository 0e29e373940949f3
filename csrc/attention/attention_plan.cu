// Fused (flash-style) attention on CUDA: out = softmax(q k^T * scale) v.
//
// Never materialises the S x S scores: keys/values stream through shared memory in
// tiles, the softmax is computed online (running max m and running sum l per query
// row), and the forward writes lse = m + log(l) per row so the backward can recompute
// the probabilities P = exp(s - lse) tile by tile. Extra memory: O(S).
//
// This file holds the one choice of kernel per call (attention_fwd_plan,
// attention_bwd_plan) and the entry points of attention.h that launch the choice; the
// kernel families live in the files listed in attention_plan.h.
#include "attention/attention_plan.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#include "common/func_attr.h"
#include "common/kernel_choice.h"
#if defined(GPU_PUZZLES_WITH_SM90A)
#include "attention/attention_bwd_sm90.h"
#include "attention/attention_fwd_sm90.h"
#endif

namespace gpu_puzzles {
namespace {

bool device_has_sm80(int dev, cudaError_t& err) {
  static std::atomic<int> major_plus1[kMaxCachedDevices];  // 0: not queried yet
  err = cudaSuccess;
  int major = cacheable_device(dev) ? major_plus1[dev].load(std::memory_order_relaxed) - 1 : -1;
  if (major < 0) {
    err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    if (err != cudaSuccess) return false;
    if (cacheable_device(dev)) major_plus1[dev].store(major + 1, std::memory_order_relaxed);
  }
  return major >= 8;
}

bool half_type(DType t) { return t == DType::Float16 || t == DType::BFloat16; }

// Rows 16-byte aligned (fp16 / bf16: 2 bytes an element; only they reach the tensor-core
// checks below), and rows close enough that a tile's offsets fit in 32 bits (the tile
// loaders, load_rows_async: up to 192 rows of a tile times the row stride).
bool rows16(const void* p, const AttnStrides& st) { return attn_rows_aligned16(p, st, 2) && st.s < (int64_t{1} << 23); }

// The tensor-core kernels' shapes: one head dim, 64 or 128, for q/k and v.
bool tc_head_dims(int64_t D, int64_t Dv) { return D == Dv && (D == 64 || D == 128); }

#if defined(GPU_PUZZLES_WITH_SM90A)
// Share of the SM slots a grid of `ctas` one-CTA-per-SM blocks keeps busy over its waves.
double wave_fill(int64_t ctas, int sms) {
  const int64_t waves = (ctas + sms - 1) / sms;
  return static_cast<double>(ctas) / static_cast<double>(waves * sms);
}

// The grid of an sm_90a launch from the knobs attention_order and `grid_knob` (its kernel's
// attention_{fwd,bwd}_grid); not overridden: longest first, persistent where balanced.
AttnGridPlan grid_plan(Knob grid_knob) {
  AttnGridPlan g;
  const int grid = knob(grid_knob);
  g.grid = grid == kKnobGridBlocks       ? AttnGrid::Blocks
           : grid == kKnobGridPersistent ? AttnGrid::Persistent
                                         : AttnGrid::Balanced;
  g.longest_first = knob(Knob::AttentionOrder) != kKnobOrderRows;
  return g;
}
#endif

}  // namespace

// Default, fp16/bf16 with D == Dv in {64, 128} and 16-byte aligned operands (else SIMT):
//  * on a 9.x GPU (sm_90a build), from 1024 keys, or from 512 where its 128-row CTAs fill
//    two waves of the SMs: the warp-specialised, TMA-fed kernel with its two consumer
//    warpgroups taking turns (ws3), D = 64 and 128, causal and full. There it ran a median
//    1.4x the best kernel below; with fewer keys its pipeline fill is not paid back (median
//    0.88x) (benchmarks/results/attention_sweep_h100.txt, attention_small_sweep_h100.txt).
//    At D = 64 from 2048 query rows, with three consumers (ws192): 1.03-1.09x ws3 there, and
//    0.95-0.97x at 512-1024 rows, where 192-row blocks pad more (attention_ws192_h100.txt).
//    Its grid is persistent, one CTA an SM, each running its share of the query blocks (the
//    next block's Q and K load while the last one finishes), where the causal order keeps the
//    CTAs balanced (attn_grid_ctas): 1.006-1.21x one CTA a block over twelve shapes,
//    GPT-2's (8,12,1024,64) causal 1.14x (attention_fwd_grid_h100.json; knob
//    attention_fwd_grid=blocks / persistent forces one).
//    Operands TMA cannot describe (stride-0 broadcast heads) and Sk = 0 also take the
//    choices below.
//  * D = 128 there otherwise: the wgmma kernel. 3 warpgroups (192 query rows per CTA) run
//    about 1.075x faster per CTA than 2 (128 rows), so 3 unless 2 fill the waves of the
//    one-CTA-per-SM grid better by more than that.
//  * D = 128 elsewhere: attn_fwd_mma_r32 at 32 rows per warp, 32-key tiles, 4 warps
//    (mma_r32); the other tilings measured slower (attention_sweep_h200.txt). 32-row
//    tiles with 64-key tiles spill at D = 128.
//  * D = 64 elsewhere: attn_fwd_mma ("mma"), 8 warps; 4 at D = 128 when forced to mma
//    (attention_fwd_warps overrides both).
AttnFwdPlan attention_fwd_plan(const AttentionFwdArgs& a, int dev, cudaError_t& err) {
  err = cudaSuccess;
  const AttnFwdPlan simt{AttnFwdKernel::Simt, 0, 0};
  const bool tc = half_type(a.dtype) && tc_head_dims(a.D, a.Dv) && rows16(a.q, a.sq) && rows16(a.k, a.sk) &&
                  rows16(a.v, a.sv) && rows16(a.o, a.so);
  if (!tc) return simt;
  const char* forced = knob_value(Knob::AttentionFwd);  // nullptr: the heuristic
  const auto is = [forced](const char* v) { return forced != nullptr && std::strcmp(forced, v) == 0; };
#if defined(GPU_PUZZLES_WITH_SM90A)
  int ws = is("ws") ? 0 : is("ws2") ? 1 : is("ws3") ? 2 : is("ws192") ? 3 : -1;
  if (ws == 3 && a.D != 64) ws = 2;  // three consumers are built for D = 64 only
  if (forced == nullptr && a.Sk >= 512) {
    const int sms = device_sm_count(dev, err);  // cached per device
    if (err != cudaSuccess) return simt;
    if (a.Sk >= 1024 || a.BH() * ((a.Sq + 127) / 128) >= 2 * int64_t{sms}) ws = a.D == 64 && a.Sq >= 2048 ? 3 : 2;
  }
  if (ws >= 0 && attention_forward_ws_supported(a)) {
    if (attention_forward_sm90_available(dev, err))
      return {AttnFwdKernel::WgmmaWs, 0, 3, ws, grid_plan(Knob::AttentionFwdGrid)};
    if (err != cudaSuccess) return simt;
  }
  int wg = is("wgmma") ? 2 : is("wgmma3") ? 3 : 0;
  if (forced == nullptr && a.D == 128) {
    const int sms = device_sm_count(dev, err);
    if (err != cudaSuccess) return simt;
    if (sms > 0) {
      const int64_t ctas3 = a.BH() * ((a.Sq + 191) / 192), ctas2 = a.BH() * ((a.Sq + 127) / 128);
      wg = 1.075 * wave_fill(ctas3, sms) >= wave_fill(ctas2, sms) ? 3 : 2;
    }
  }
  if (wg > 0) {  // where the device or the image cannot run it, the mma.sync kernels below
    if (attention_forward_sm90_available(dev, err)) return {AttnFwdKernel::Wgmma, 0, wg};
    if (err != cudaSuccess) return simt;
  }
#endif
  if (!device_has_sm80(dev, err)) return simt;
  if (is("mma_r32") || (!is("mma") && a.D == 128)) return {AttnFwdKernel::MmaR32, 4, 0};
  return {AttnFwdKernel::Mma, knob_int(Knob::AttentionFwdWarps, a.D >= 128 ? 4 : 8), 0};
}

// Default, fp16/bf16 with D == Dv in {64, 128} and 16-byte aligned operands (else SIMT): on
// a 9.x GPU (sm_90a build), unless deterministic algorithms are asked for, the warp-specialised
// wgmma backward (one pass, dq summed in float32 in any order); elsewhere, and for operands its
// TMA cannot describe, the two deterministic mma.sync passes.
//  * Its dQ scheme at D = 64: by turns where a CTA sweeps many query blocks (G * Sq >= 2048
//    rows): there it ran 1.018-1.031x the column split, at (8,12,1024) causal 0.971x and
//    (16,12,512) causal 0.954x, where fewer blocks leave the turns uneven
//    (benchmarks/results/attention_bwd_turns_h100.json). Knob attention_bwd: wgmma_turns /
//    wgmma_split force one.
//  * Its grid is persistent (one CTA an SM, each running its share of the key blocks: the next
//    block's Q / dO tiles load while the last one's GEMMs finish, and its K / V while the last
//    one's dK / dV are stored) where the causal order keeps the CTAs balanced (attn_grid_ctas):
//    1.007-1.015x one CTA a block on full grids, 1.067x at GPT-2's causal (8,12,1024,64); where
//    the causal order's chunks are of one to two rounds, 0.57-0.78x, so there one CTA a block
//    (attention_bwd_grid_h100.json; knob attention_bwd_grid=blocks / persistent forces one).
AttnBwdPlan attention_bwd_plan(const AttentionBwdArgs& a, int dev, cudaError_t& err) {
  err = cudaSuccess;
  const AttnBwdPlan simt{AttnBwdKernel::Simt};
  // o is read only by the delta kernels (16-byte loads where its rows allow): no alignment needed.
  const bool tc = half_type(a.dtype) && tc_head_dims(a.D, a.Dv) && rows16(a.q, a.sq) && rows16(a.k, a.sk) &&
                  rows16(a.v, a.sv) && rows16(a.dout, a.sdo) && rows16(a.dq, a.sdq) && rows16(a.dk, a.sdk) &&
                  rows16(a.dv, a.sdv);
  if (!tc) return simt;
#if defined(GPU_PUZZLES_WITH_SM90A)
  const int forced = knob(Knob::AttentionBwd);
  const bool want = forced == kKnobBwdWgmma || forced == kKnobBwdWgmmaSplit || forced == kKnobBwdWgmmaTurns ||
                    (forced == 0 && !a.deterministic);
  if (want && attention_backward_sm90_supported(a)) {
    if (attention_forward_sm90_available(dev, err)) {
      const bool turns =
          a.D == 64 && (forced == kKnobBwdWgmmaTurns || (forced != kKnobBwdWgmmaSplit && a.G() * a.Sq >= 2048));
      return {AttnBwdKernel::Wgmma, turns, grid_plan(Knob::AttentionBwdGrid)};
    }
    if (err != cudaSuccess) return simt;
  }
#endif
  return device_has_sm80(dev, err) ? AttnBwdPlan{AttnBwdKernel::Mma} : simt;
}

namespace {

// Head dims the CUDA kernels take.
bool head_dims_ok(int64_t D, int64_t Dv) {
  return D > 0 && Dv > 0 && D <= kAttentionMaxHeadDim && Dv <= kAttentionMaxHeadDim;
}

// p = plan(a) on the current device, dev; CUDA's error, if any, returned (p then as on error).
template <class Args, class Plan>
cudaError_t plan_on_device(const Args& a, Plan (*plan)(const Args&, int, cudaError_t&), Plan& p, int& dev) {
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) p = plan(a, dev, e);
  return e;
}

}  // namespace

int64_t attention_backward_workspace_bytes(const AttentionBwdArgs& a) {
  const int64_t elem = a.dtype == DType::Float64 ? 8 : 4;
  int64_t bytes = a.BH() * a.Sq * elem;  // delta = rowsum(dout * o), one per query row
#if defined(GPU_PUZZLES_WITH_SM90A)
  int dev = 0;
  AttnBwdPlan p{};  // an error here comes back from the launch's own query
  if (a.BH() > 0 && a.Sq > 0 && plan_on_device(a, attention_bwd_plan, p, dev) == cudaSuccess &&
      p.kernel == AttnBwdKernel::Wgmma)
    bytes = std::max(bytes, attention_backward_sm90_workspace_bytes(a));
#endif
  return (bytes + 255) / 256 * 256;
}

LaunchStatus attention_forward_cuda(const AttentionFwdArgs& a, cudaStream_t stream) {
  if (a.BH() <= 0 || a.Sq <= 0) return static_cast<LaunchStatus>(cudaSuccess);
  if (!head_dims_ok(a.D, a.Dv)) return static_cast<LaunchStatus>(cudaErrorInvalidValue);
  int dev = 0;
  AttnFwdPlan p{};
  const cudaError_t e = plan_on_device(a, attention_fwd_plan, p, dev);
  if (e != cudaSuccess) return static_cast<LaunchStatus>(e);
  switch (p.kernel) {
#if defined(GPU_PUZZLES_WITH_SM90A)
    case AttnFwdKernel::Wgmma:
      return static_cast<LaunchStatus>(attention_forward_sm90(a, p.warpgroups, dev, stream));
    case AttnFwdKernel::WgmmaWs:
      return static_cast<LaunchStatus>(attention_forward_sm90_ws(a, p.variant, p.grid, dev, stream));
#endif
    case AttnFwdKernel::Mma:
    case AttnFwdKernel::MmaR32:
      return static_cast<LaunchStatus>(attention_fwd_mma(a, p, dev, stream));
    default:
      return static_cast<LaunchStatus>(attention_fwd_simt(a, dev, stream));
  }
}

LaunchStatus attention_backward_cuda(const AttentionBwdArgs& a, void* workspace, cudaStream_t stream) {
  if (a.BH() <= 0) return static_cast<LaunchStatus>(cudaSuccess);
  if (!head_dims_ok(a.D, a.Dv)) return static_cast<LaunchStatus>(cudaErrorInvalidValue);
  if (a.Sq <= 0) {
    // No queries: no gradient reaches k or v. dk and dv are dense here (the host allocates
    // them so), whatever their order: numel elements from their base.
    const int64_t nk = a.BHkv() * a.Sk;
    const size_t es = a.dtype == DType::Float64 ? 8 : a.dtype == DType::Float32 ? 4 : 2;
    if (nk > 0) {
      cudaError_t e = cudaMemsetAsync(a.dk, 0, nk * a.D * es, stream);
      if (e == cudaSuccess) e = cudaMemsetAsync(a.dv, 0, nk * a.Dv * es, stream);
      if (e != cudaSuccess) return static_cast<LaunchStatus>(e);
    }
    return static_cast<LaunchStatus>(cudaSuccess);
  }
  int dev = 0;
  AttnBwdPlan p{};
  cudaError_t e = plan_on_device(a, attention_bwd_plan, p, dev);
  if (e != cudaSuccess) return static_cast<LaunchStatus>(e);
#if defined(GPU_PUZZLES_WITH_SM90A)
  if (p.kernel == AttnBwdKernel::Wgmma)
    return static_cast<LaunchStatus>(attention_backward_sm90(a, p, workspace, dev, stream));
#endif
  e = attention_bwd_delta(a, workspace, stream);
  if (e != cudaSuccess) return static_cast<LaunchStatus>(e);
  if (p.kernel == AttnBwdKernel::Mma)
    return static_cast<LaunchStatus>(attention_bwd_mma(a, static_cast<const float*>(workspace), dev, stream));
  return static_cast<LaunchStatus>(attention_bwd_simt(a, workspace, dev, stream));
}

}  // namespace gpu_puzzles
