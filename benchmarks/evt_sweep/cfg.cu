// One configuration of the LayerNorm+Linear EVT GEMM (csrc/layernorm_linear/lnlinear_evt_sm90.cu,
// same tree and arguments, bf16) per translation unit (-DCFG=n), for the tile/cluster
// sweep in main.cu; standalone (no torch) so ten configurations build in parallel.
#define NDEBUG
#include <cstdio>
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
using namespace cute;
namespace fus = cutlass::epilogue::fusion;
constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;
using T = cutlass::bfloat16_t;
using Coop = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using CoopE = cutlass::epilogue::TmaWarpSpecializedCooperative;
using Ping = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
using PingE = cutlass::epilogue::TmaWarpSpecialized;
#if CFG == 0
using TileS = Shape<_128, _256, _64>; using Cl = Shape<_2, _1, _1>; using KS = Coop; using ES = CoopE;
#elif CFG == 1
using TileS = Shape<_128, _128, _64>; using Cl = Shape<_1, _2, _1>; using KS = Ping; using ES = PingE;
#elif CFG == 2
using TileS = Shape<_256, _128, _64>; using Cl = Shape<_1, _2, _1>; using KS = Coop; using ES = CoopE;
#elif CFG == 3
using TileS = Shape<_256, _128, _64>; using Cl = Shape<_2, _1, _1>; using KS = Coop; using ES = CoopE;
#elif CFG == 4
using TileS = Shape<_128, _256, _64>; using Cl = Shape<_1, _2, _1>; using KS = Coop; using ES = CoopE;
#elif CFG == 5
using TileS = Shape<_128, _128, _64>; using Cl = Shape<_2, _1, _1>; using KS = Ping; using ES = PingE;
#elif CFG == 6
using TileS = Shape<_128, _256, _64>; using Cl = Shape<_1, _1, _1>; using KS = Coop; using ES = CoopE;
#elif CFG == 7
using TileS = Shape<_64, _256, _64>; using Cl = Shape<_1, _2, _1>; using KS = Ping; using ES = PingE;
#elif CFG == 8
using TileS = Shape<_128, _128, _64>; using Cl = Shape<_1, _2, _1>; using KS = Coop; using ES = CoopE;
#elif CFG == 9
using TileS = Shape<_256, _128, _64>; using Cl = Shape<_1, _1, _1>; using KS = Coop; using ES = CoopE;
#endif
using PerRow = fus::Sm90ColBroadcast<0, TileS, float, float, Stride<_1, _0, int64_t>>;
using PerCol = fus::Sm90RowBroadcast<0, TileS, float, float, Stride<_0, _1, int64_t>>;
using MeanR = fus::Sm90EVT<fus::Sm90Compute<cutlass::multiplies, float, float, kRound>, PerRow, PerCol>;
using Centred = fus::Sm90EVT<fus::Sm90Compute<cutlass::minus, float, float, kRound>, fus::Sm90AccFetch, MeanR>;
using Epi = fus::Sm90EVT<fus::Sm90Compute<cutlass::homogeneous_multiply_add, T, float, kRound>, PerRow, Centred, PerCol>;
using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileS, Cl, cutlass::epilogue::collective::EpilogueTileAuto,
    float, float, void, cutlass::layout::RowMajor, 8, T, cutlass::layout::RowMajor, 8, ES, Epi>::CollectiveOp;
using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, T, cutlass::layout::RowMajor, 8, T, cutlass::layout::ColumnMajor, 8,
    float, TileS, Cl,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
    KS>::CollectiveOp;
using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop, CollectiveEpilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)
extern "C" int CAT(run_cfg_, CFG)(int M, int N, int K, const void* x, const void* wc, const float* mean, const float* rstd,
                                 const float* r, const float* bp, void* y, void* ws, size_t ws_bytes, int sms, cudaStream_t s,
                                 size_t* need) {
  using SA = typename Kernel::StrideA; using SB = typename Kernel::StrideB; using SD = typename Kernel::StrideD;
  cutlass::KernelHardwareInfo hw; hw.device_id = 0; hw.sm_count = sms;
  typename Gemm::Arguments a{cutlass::gemm::GemmUniversalMode::kGemm, {M, N, K, 1},
      {static_cast<const T*>(x), cutlass::make_cute_packed_stride(SA{}, make_shape(M, K, 1)), static_cast<const T*>(wc),
       cutlass::make_cute_packed_stride(SB{}, make_shape(N, K, 1))},
      {{}, nullptr, {}, static_cast<T*>(y), cutlass::make_cute_packed_stride(SD{}, make_shape(M, N, 1))}, hw};
  a.epilogue.thread = {{rstd}, {{}, {{mean}, {r}, {}}, {}}, {bp}, {}};
  if (need) { *need = Gemm::get_workspace_size(a); return 0; }
  Gemm g;
  if (g.can_implement(a) != cutlass::Status::kSuccess) return 1;
  if (g.initialize(a, ws, s) != cutlass::Status::kSuccess) return 2;
  if (g.run(s) != cutlass::Status::kSuccess) return 3;
  return 0;
}
