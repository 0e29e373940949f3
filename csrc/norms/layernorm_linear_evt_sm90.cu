// Fused LayerNorm+Linear forward on sm_90a: ONE CUTLASS warp-specialized GEMM
// z = x @ Wc^T whose epilogue (an epilogue visitor tree, EVT) applies the row
// statistics before the store:
//   y[i,j] = rstd_i * (acc_ij - mean_i * r_j) + bp_j
// acc in fp32, stats and folded vectors in fp32, one rounding to T at the store.
// This saves the separate in-place epilogue pass of the cuBLAS path
// (layernorm_linear_epilogue), which reads and writes z once more, and rounds acc to T
// once instead of twice. Rows with a large mean are still recomputed afterwards by
// layernorm_linear_large_mean_fixup_cuda.
//
// Built only with GPU_PUZZLES_WITH_SM90A (setup.py finds the CUTLASS headers);
// the kernels exist only in the sm_90a image: other architectures get CUTLASS's
// empty stubs, and evt_available() says false there.

// NDEBUG, for this translation unit only: CUTLASS/CuTe keep device-side assert()s
// without it, and ptxas then serialises the wgmma pipeline. Safe here: this file includes no torch headers and nothing
// else in the project includes CUTLASS, so no inline function is compiled both ways.
#ifndef NDEBUG
#define NDEBUG
#endif
// PDL: the GEMM kernel waits (griddepcontrol.wait) for the prep launch before its
// first global read, so it can be launched while the prep's last blocks run
// (EvtGemm::run launches it that way when asked), and signals the fix-up behind it early.
#define CUTLASS_ENABLE_GDC_FOR_SM90 1

#include <atomic>
#include <cstdint>

#include "norms/layernorm_linear.h"

#ifdef GPU_PUZZLES_WITH_SM90A
#include "common/align.h"
#include "common/func_attr.h"                   // device_sm_count
#include "norms/layernorm_linear_evt_sm90.cuh"  // EvtGemm

// A plain sm_90 image of this file would hold stubs that print an error and write
// nothing; setup.py maps 9.0 to 9.0a, and this makes any other build loud.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "layernorm_linear_evt_sm90.cu must be built for sm_90a (TORCH_CUDA_ARCH_LIST=9.0a), not sm_90"
#endif
#endif

namespace gpu_puzzles {

#ifdef GPU_PUZZLES_WITH_SM90A
namespace {

using namespace cute;

// Two configurations: the cooperative 128x256 tile (Big) for K >= 2048, ping-pong
// 128x128 (Small) below, where a short K leaves the big tile's long epilogue unhidden
// and ping-pong overlaps one warp group's epilogue with the other's MMAs. A 2x1
// cluster: the two CTAs of a pair (rows m, m+1, same columns) share each W tile through
// one TMA multicast. Chosen from the sweep in benchmarks/evt_sweep (results:
// benchmarks/results/lnlinear_evt_sweep_h100.txt).
template <class T>
using Big = EvtGemm<T, Shape<_128, _256, _64>, Shape<_2, _1, _1>, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                    cutlass::epilogue::TmaWarpSpecializedCooperative>;
template <class T>
using Small = EvtGemm<T, Shape<_128, _128, _64>, Shape<_2, _1, _1>, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                      cutlass::epilogue::TmaWarpSpecialized>;

std::atomic<int> g_avail[kMaxCachedDevices];  // 0 = not checked, 1 = yes, 2 = no

// The current device and its SM count (device_sm_count caches it); false past the
// availability table or when a query fails (the error cleared).
bool current_device(int& dev, int& sms) {
  cudaError_t e = cudaGetDevice(&dev);
  sms = e == cudaSuccess && cacheable_device(dev) ? device_sm_count(dev, e) : 0;
  if (sms <= 0) {
    (void)cudaGetLastError();
    return false;
  }
  return true;
}

template <class F>
auto dispatch(DType dt, int64_t K, F&& f) {
  if (dt == DType::BFloat16) {
    if (K >= kEvtBigTileMinK) return f(Big<cutlass::bfloat16_t>{});
    return f(Small<cutlass::bfloat16_t>{});
  }
  if (K >= kEvtBigTileMinK) return f(Big<cutlass::half_t>{});
  return f(Small<cutlass::half_t>{});
}

bool shapes_ok(int64_t M, int64_t N, int64_t K, DType dt) {
  const int64_t kMax = 2147483647LL;
  return (dt == DType::BFloat16 || dt == DType::Float16) && M >= 1 && N >= 1 && K >= 1 && M <= kMax && N <= kMax &&
         K <= kMax && N % 8 == 0 && K % 8 == 0;
}

// The sm_90a kernels run on the current device (cached per device).
bool evt_available() {
  int dev = 0, sms = 0;
  if (!current_device(dev, sms)) return false;
  int st = g_avail[dev].load(std::memory_order_relaxed);
  if (st == 0) {
    int major = 0, minor = 0;
    bool ok = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
              cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) == cudaSuccess && major == 9 &&
              minor == 0;
    if (!ok) (void)cudaGetLastError();
    ok = ok && Big<cutlass::bfloat16_t>::compiled_for_sm90a() && Small<cutlass::bfloat16_t>::compiled_for_sm90a() &&
         Big<cutlass::half_t>::compiled_for_sm90a() && Small<cutlass::half_t>::compiled_for_sm90a();
    st = ok ? 1 : 2;
    g_avail[dev].store(st, std::memory_order_relaxed);
  }
  return st == 1;
}

}  // namespace

bool layernorm_linear_evt_possible(const void* x, const void* wc, int64_t M, int64_t N, int64_t K, DType dt) {
  return shapes_ok(M, N, K, dt) && aligned16(x) && aligned16(wc) && evt_available();
}

size_t layernorm_linear_evt_workspace_bytes(int64_t M, int64_t N, int64_t K, DType dt) {
  int dev = 0, sms = 0;
  if (!shapes_ok(M, N, K, dt) || !current_device(dev, sms)) return 0;
  return dispatch(dt, K, [&](auto g) {
    return decltype(g)::workspace(static_cast<int>(M), static_cast<int>(N), static_cast<int>(K), dev, sms);
  });
}

LaunchStatus layernorm_linear_evt_gemm_cuda(const void* x, const void* wc, const void* mean, const void* rstd,
                                            const void* r, const void* bp, void* y, void* workspace, int64_t M,
                                            int64_t N, int64_t K, DType dt, cudaStream_t stream, bool pdl) {
  int dev = 0, sms = 0;
  if (!shapes_ok(M, N, K, dt) || !evt_available() || !current_device(dev, sms)) return cudaErrorNotSupported;
  return dispatch(dt, K, [&](auto g) {
    return decltype(g)::run(static_cast<int>(M), static_cast<int>(N), static_cast<int>(K), x, wc, mean, rstd, r, bp, y,
                            workspace, dev, sms, stream, pdl);
  });
}

#endif

}  // namespace gpu_puzzles
