// The op's EVT GEMM (EvtGemm, Big and Small configurations of layernorm_linear_evt_sm90.cu, bf16) and
// the same tile/cluster/schedule with CUTLASS's plain epilogue (D = acc), one per translation
// unit (-DEVTV=0..3), for epilogue_cost.cu: what the EVT epilogue and its vector loads cost.
#define NDEBUG
#include "layernorm_linear/layernorm_linear_evt_sm90.cuh"
using namespace gpu_puzzles;
using bf = cutlass::bfloat16_t;
using Coop = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using CoopE = cutlass::epilogue::TmaWarpSpecializedCooperative;
using Ping = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
using PingE = cutlass::epilogue::TmaWarpSpecialized;
#if EVTV == 0 || EVTV == 1
using TileS = Shape<_128, _256, _64>; using Cl = Shape<_2, _1, _1>; using KS = Coop; using ES = CoopE;
#else
using TileS = Shape<_128, _128, _64>; using Cl = Shape<_2, _1, _1>; using KS = Ping; using ES = PingE;
#endif
#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)
#if EVTV == 0 || EVTV == 2
using G = EvtGemm<bf, TileS, Cl, KS, ES>;
extern "C" int CAT(run_v, EVTV)(int M, int N, int K, const void* x, const void* wc, const float* mean, const float* rstd,
                            const float* r, const float* bp, void* y, void* ws, int sms, cudaStream_t s) {
  return G::run(M, N, K, x, wc, mean, rstd, r, bp, y, ws, 0, sms, s, false);
}
#else
struct Plain {
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileS, Cl, cutlass::epilogue::collective::EpilogueTileAuto,
      float, float, void, cutlass::layout::RowMajor, 8, bf, cutlass::layout::RowMajor, 8, ES>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, bf, cutlass::layout::RowMajor, 8, bf,
      cutlass::layout::ColumnMajor, 8, float, TileS, Cl,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KS>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};
extern "C" int CAT(run_v, EVTV)(int M, int N, int K, const void* x, const void* wc, const float*, const float*,
                            const float*, const float*, void* y, void* ws, int sms, cudaStream_t s) {
  using K_ = Plain::Kernel;
  auto sa = cutlass::make_cute_packed_stride(typename K_::StrideA{}, make_shape(M, K, 1));
  auto sb = cutlass::make_cute_packed_stride(typename K_::StrideB{}, make_shape(N, K, 1));
  auto sd = cutlass::make_cute_packed_stride(typename K_::StrideD{}, make_shape(M, N, 1));
  cutlass::KernelHardwareInfo hw; hw.device_id = 0; hw.sm_count = sms;
  typename Plain::Gemm::Arguments a{cutlass::gemm::GemmUniversalMode::kGemm, {M, N, K, 1},
      {static_cast<const bf*>(x), sa, static_cast<const bf*>(wc), sb},
      {{1.f, 0.f}, nullptr, {}, static_cast<bf*>(y), sd}, hw};
  Plain::Gemm g;
  if (g.can_implement(a) != cutlass::Status::kSuccess) return 100;
  if (Plain::Gemm::get_workspace_size(a) > (64u << 20)) return 101;
  if (g.initialize(a, ws, s) != cutlass::Status::kSuccess) return 102;
  if (g.run(s) != cutlass::Status::kSuccess) return 103;
  return 0;
}
#endif
