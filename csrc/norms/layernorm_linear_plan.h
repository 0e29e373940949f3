// The kernel choice of layer_norm, layer_norm_backward and fused_layernorm_linear, in
// one place: layernorm_linear_plan() decides for every stage how a row is spread over
// threads, whether it takes 16-byte vectors, and (fused forward) which GEMM runs; the
// launchers (.cu) and the host (layernorm_linear.cpp) only carry the plan out.
// Torch-free. The knobs layernorm_linear_plan, layernorm_linear_evt and
// layernorm_linear_pdl (common/kernel_choice.h, Python: gpu_puzzles.tuning.override)
// override the fused forward's plan and GEMM choice; they are read on every call.
#pragma once
#include <cstdint>

#include "common/kernel_choice.h"
#include "norms/layernorm_linear.h"  // kEvtBigTileMinK

namespace gpu_puzzles {
namespace layernorm_linear {

constexpr int kCache = 4;  // vectors per thread held in registers by the cached kernels
// Widest blocks of the cached kernels: with launch bounds their registers always
// fit an SM (the backward keeps ~150 per thread for bf16); longer rows loop.
constexpr int kFwdMaxThreads = 512;
constexpr int kBwdMaxThreads = 256;
constexpr int kBwdMaxThreadsNarrow = 512;  // one vector per thread (ln_bwd_cached with C == 1)
// Rows per block of the warp-per-row forward (ln_fwd_warp).
constexpr int kWarpRows = 8;
// The one-launch prep (statistics + fold, layernorm_linear_prep): warps per block, and
// the longest row it holds, in 16-byte vectors per lane (64 bytes of row in registers).
constexpr int kPrepWarps = 8;
constexpr int kPrepMaxVecs = 4;
// Rows per step of ln_bwd_cached: one vector per thread (narrow), kCache per thread.
constexpr int kBwdRowsNarrow = 4, kBwdRowsWide = 2;

// The knobs' values (common/kernel_choice.h: 1-based, in kKnobs' order; 0 = the heuristic).
enum LayerNormLinearEvtKnob : int { kKnobEvt = 1, kKnobCublas = 2 };
enum LayerNormLinearPdlKnob : int { kKnobPdl = 1, kKnobPlain = 2 };
enum LayerNormLinearPlanKnob : int { kKnobFold = 1, kKnobNormalize = 2 };

enum class Stage {
  kForward,   // layer_norm forward (ln_fwd_*)
  kBackward,  // layer_norm backward (ln_bwd_*), also the fused backward's
  kPrep,      // fused forward: statistics and weight fold before the GEMM
  kGemm,      // fused forward: the GEMM and the statistics epilogue
};

enum class Rows {
  kWarp,         // a warp per row, the row in registers (ln_fwd_warp, layernorm_linear_prep)
  kBlock,        // a block per row, kCache vectors per thread in registers (ln_fwd_cached,
                 // ln_bwd_cached, layernorm_linear_prep_rows)
  kBlockNarrow,  // backward: a block per row, one vector per thread, more rows per step
  kLoop,         // any row: loops re-reading it (ln_fwd_loop, ln_bwd_loop; kPrep: the
                 // statistics and the fold as two launches)
};

struct Plan {
  Rows rows = Rows::kLoop;
  bool vec = false;   // 16-byte vectors (H a multiple of the vector width, bases aligned)
  int threads = 0;    // per block
  bool evt = false;   // kGemm: the CUTLASS GEMM with the statistics in its epilogue (sm_90a);
                      // else cuBLAS + the epilogue pass
  bool pdl = false;   // kGemm with evt: the GEMM and the fix-up after it as programmatic
                      // dependent launches
  bool fold = false;  // fused forward (fused_forward_plan): fold gamma into W; else normalise
                      // x first and run one cuBLAS GEMM with the bias in its epilogue
};

// Threads for a cached kernel on rows of nvec vectors: whole warps, kCache vectors each.
inline int cached_threads(int64_t nvec) {
  int64_t t = (nvec + kCache - 1) / kCache;
  t = ((t + 31) / 32) * 32;
  return static_cast<int>(t < 32 ? 32 : t);
}

// The heuristic. H: row length; vec_width: elements per 16-byte vector; aligned: every
// base the stage reads or writes is 16-byte aligned; evt_possible (kGemm): the build,
// device, dtype, shapes and alignment allow the CUTLASS GEMM.
inline Plan layernorm_linear_plan(Stage stage, int64_t H, int vec_width, bool aligned, bool evt_possible = false) {
  Plan p;
  p.vec = aligned && H % vec_width == 0;
  const int64_t nvec = p.vec ? H / vec_width : H;
  switch (stage) {
    case Stage::kForward:
      // Short rows (H <= 1024 in bf16): a warp per row. A block per row would run one-warp
      // blocks there, and the SM's 32-block limit would cap it at half occupancy.
      if (nvec <= (int64_t)kCache * 32) {
        p.rows = Rows::kWarp;
        p.threads = 32 * kWarpRows;
      } else if (nvec <= (int64_t)kCache * kFwdMaxThreads) {
        p.rows = Rows::kBlock;
        p.threads = cached_threads(nvec);
      } else {
        p.rows = Rows::kLoop;
        p.threads = 1024;
      }
      break;
    case Stage::kBackward:
      // Rows up to kBwdMaxThreadsNarrow vectors take one vector per thread and
      // kBwdRowsNarrow rows per step: fewer registers per row, more rows in flight (see
      // benchmarks/results/lnlinear_prep_variants_h100.txt).
      if (nvec <= kBwdMaxThreadsNarrow) {
        p.rows = Rows::kBlockNarrow;
        p.threads = static_cast<int>(((nvec + 31) / 32) * 32);
      } else if (nvec <= (int64_t)kCache * kBwdMaxThreads) {
        p.rows = Rows::kBlock;
        p.threads = cached_threads(nvec);
      } else {
        p.rows = Rows::kLoop;
        p.threads = 512;
      }
      break;
    case Stage::kPrep:
      // One launch only for vector rows that fit the registers: a warp per row up to
      // kPrepMaxVecs vectors per lane (longer rows were slower that way than the two
      // passes, see benchmarks/results/lnlinear_prep_variants_h100.txt), a block per row
      // beyond. Else the two launches (forward statistics, fold).
      if (H == 0 || !p.vec || nvec > (int64_t)kCache * kFwdMaxThreads) {
        p.rows = Rows::kLoop;
      } else if (nvec <= (int64_t)kPrepMaxVecs * 32) {
        p.rows = Rows::kWarp;
        p.threads = 32 * kPrepWarps;
      } else {
        p.rows = Rows::kBlock;
        p.threads = cached_threads(nvec);
      }
      break;
    case Stage::kGemm:
      p.evt = evt_possible && knob(Knob::LayerNormLinearEvt) != kKnobCublas;
      p.pdl = p.evt && knob(Knob::LayerNormLinearPdl) != kKnobPlain;
      break;
  }
  return p;
}

// The fused forward's plan. Beyond what one GEMM on x and W must move, the fold plan reads
// x again for the statistics (M*K) and writes and reads the folded W (2*N*K); the
// normalise plan writes xn and reads it back (2*M*K). So fold saves traffic only for tall
// x (M > 2N), and it also pays its prep and fix-up launches and, at K >= 2048, the CUTLASS
// GEMM's big tile, which ran slower than cuBLAS. Measured over the bf16 sweep
// (benchmarks/results/lnlin_sweep_h100.json) it won, by 1-9%, only with the sm_90a epilogue
// GEMM, K < 2048, M >= 2N and M*N >= 2^23; elsewhere it lost by up to 30%. The fold kernels
// read W as (N, K) rows: a W that is not row-major (Conv1D's weight.t()) takes the
// normalise plan, whose cuBLAS GEMM reads any W with a unit stride as it is (a forced fold
// copies it). The knob layernorm_linear_plan (fold | normalize) overrides the choice.
constexpr int64_t kFoldMinOutput = int64_t(1) << 23;

// w_rows: W is (N, K) row-major (what the fold kernels read). evt_possible: as for
// Stage::kGemm. The result's evt/pdl apply to the fold plan only. one_dtype: x and W share
// a dtype; the fold runs its GEMM on x itself, so a float32 x under a half W (what autocast
// hands over) is always normalised first, whatever the knob says.
inline Plan fused_forward_plan(int64_t M, int64_t N, int64_t K, bool w_rows, bool evt_possible, bool one_dtype = true) {
  Plan p = layernorm_linear_plan(Stage::kGemm, K, 8, true, evt_possible);
  if (!one_dtype) return p;  // fold = false
  switch (knob(Knob::LayerNormLinearPlan)) {
    case kKnobFold:
      p.fold = true;
      break;
    case kKnobNormalize:
      p.fold = false;
      break;
    default:
      p.fold = w_rows && p.evt && K < kEvtBigTileMinK && M >= 2 * N && M * N >= kFoldMinOutput;
  }
  return p;
}

}  // namespace layernorm_linear
}  // namespace gpu_puzzles
