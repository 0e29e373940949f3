// One configuration of the LayerNorm+Linear EVT GEMM (EvtGemm, the op's own type from
// csrc/layernorm_linear/layernorm_linear_evt_sm90.cuh, bf16) per translation unit (-DCFG=n), for
// the tile/cluster sweep in main.cu; standalone (no torch) so ten configurations build in
// parallel.
#define NDEBUG  // as in layernorm_linear_evt_sm90.cu: CUTLASS's device asserts serialise the pipeline
#include "layernorm_linear/layernorm_linear_evt_sm90.cuh"
using namespace gpu_puzzles;
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
using G = EvtGemm<cutlass::bfloat16_t, TileS, Cl, KS, ES>;
#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)
// need != nullptr: only report the workspace size. Returns 0 or the cudaError_t of EvtGemm::run.
extern "C" int CAT(run_cfg_, CFG)(int M, int N, int K, const void* x, const void* wc, const float* mean, const float* rstd,
                                 const float* r, const float* bp, void* y, void* ws, int sms, cudaStream_t s, size_t* need) {
  if (need) {
    *need = G::workspace(M, N, K, 0, sms);
    return 0;
  }
  return G::run(M, N, K, x, wc, mean, rstd, r, bp, y, ws, 0, sms, s, false);
}
