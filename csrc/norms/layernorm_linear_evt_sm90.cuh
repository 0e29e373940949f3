// The LayerNorm+Linear EVT GEMM: one CUTLASS sm_90a warp-specialized GEMM
// z = x @ Wc^T whose epilogue visitor tree applies the row statistics,
//   y[i,j] = rstd_i * (acc_ij - mean_i * r_j) + bp_j,
// templated on tile, cluster and schedules. layernorm_linear_evt_sm90.cu instantiates two
// configurations; benchmarks/evt_sweep times ten with this same type.
// Include only in a CUTLASS build, after defining NDEBUG (see layernorm_linear_evt_sm90.cu).
// The anonymous namespace keeps the kernels internal to the including file.
#pragma once

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "norms/layernorm_linear.h"

namespace gpu_puzzles {
namespace {

using namespace cute;
namespace fus = cutlass::epilogue::fusion;
constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;

template <class T, class TileShape, class ClusterShape, class KSched, class ESched>
struct EvtGemm {
  // Per row i (broadcast along N): mean, rstd. Per column j (broadcast along M): r, bp.
  using PerRow = fus::Sm90ColBroadcast<0, TileShape, float, float, Stride<_1, _0, int64_t>>;
  using PerCol = fus::Sm90RowBroadcast<0, TileShape, float, float, Stride<_0, _1, int64_t>>;
  using MeanR = fus::Sm90EVT<fus::Sm90Compute<cutlass::multiplies, float, float, kRound>, PerRow, PerCol>;
  using Centred = fus::Sm90EVT<fus::Sm90Compute<cutlass::minus, float, float, kRound>, fus::Sm90AccFetch, MeanR>;
  // rstd * (acc - mean*r) + bp, rounded to T once.
  using Epi =
      fus::Sm90EVT<fus::Sm90Compute<cutlass::homogeneous_multiply_add, T, float, kRound>, PerRow, Centred, PerCol>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, cutlass::layout::RowMajor, 8, T,
      cutlass::layout::RowMajor, 8, ESched, Epi>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, T, cutlass::layout::RowMajor, 8, T,
      cutlass::layout::ColumnMajor, 8, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KSched>::CollectiveOp;
  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static typename Gemm::Arguments args(int M, int N, int K, const void* x, const void* wc, const void* mean,
                                       const void* rstd, const void* r, const void* bp, void* y, int device, int sms) {
    using SA = typename Kernel::StrideA;
    using SB = typename Kernel::StrideB;
    using SD = typename Kernel::StrideD;
    const SA sa = cutlass::make_cute_packed_stride(SA{}, make_shape(M, K, 1));
    const SB sb = cutlass::make_cute_packed_stride(SB{}, make_shape(N, K, 1));
    const SD sd = cutlass::make_cute_packed_stride(SD{}, make_shape(M, N, 1));
    cutlass::KernelHardwareInfo hw;
    hw.device_id = device;
    hw.sm_count = sms;
    typename Gemm::Arguments a{cutlass::gemm::GemmUniversalMode::kGemm,
                               {M, N, K, 1},
                               {static_cast<const T*>(x), sa, static_cast<const T*>(wc), sb},
                               {{}, nullptr, {}, static_cast<T*>(y), sd},
                               hw};
    // Arguments mirror the tree: {rstd, {acc, {mean, r, mul}, minus}, bp, fma}.
    a.epilogue.thread = {{static_cast<const float*>(rstd)},
                         {{}, {{static_cast<const float*>(mean)}, {static_cast<const float*>(r)}, {}}, {}},
                         {static_cast<const float*>(bp)},
                         {}};
    return a;
  }

  static size_t workspace(int M, int N, int K, int device, int sms) {
    return Gemm::get_workspace_size(
        args(M, N, K, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, device, sms));
  }

  static LaunchStatus run(int M, int N, int K, const void* x, const void* wc, const void* mean, const void* rstd,
                          const void* r, const void* bp, void* y, void* ws, int device, int sms, cudaStream_t s,
                          bool pdl) {
    auto a = args(M, N, K, x, wc, mean, rstd, r, bp, y, device, sms);
    Gemm gemm;
    // can_implement checks the TMA alignment and sizes: report "not supported" so a
    // caller that skipped its own checks gets an error, never a wrong result.
    if (gemm.can_implement(a) != cutlass::Status::kSuccess) return cudaErrorNotSupported;
    if (gemm.initialize(a, ws, s) != cutlass::Status::kSuccess) {
      const cudaError_t e = cudaGetLastError();
      return e != cudaSuccess ? e : cudaErrorUnknown;
    }
    // pdl: a programmatic dependent launch (the kernel waits for the previous one itself).
    if (gemm.run(s, nullptr, pdl) != cutlass::Status::kSuccess) {
      const cudaError_t e = cudaGetLastError();
      return e != cudaSuccess ? e : cudaErrorUnknown;
    }
    return cudaGetLastError();
  }

  // Whether the kernel in this binary is the real sm_90a one (not a stub, not PTX
  // of another architecture JIT-compiled by the driver).
  static bool compiled_for_sm90a() {
    cudaFuncAttributes fa{};
    if (cudaFuncGetAttributes(&fa, cutlass::device_kernel<Kernel>) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return fa.ptxVersion == 90 && fa.binaryVersion == 90;
  }
};

}  // namespace
}  // namespace gpu_puzzles
