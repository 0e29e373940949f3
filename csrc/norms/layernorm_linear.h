// Torch-free interface between layernorm_linear.cpp (ATen side), the CUDA files
// (layer_norm_forward.cu, layer_norm_backward.cu, layernorm_linear_fused.cu,
// layernorm_linear_evt_sm90.cu) and the CPU kernels (layernorm_linear_cpu.cpp). Rows are
// contiguous (M, H); statistics (mean, rstd) and the folded vectors are in the accumulate
// type: float, or double for float64.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/cpu_isa.h"
#include "common/dtype.h"

namespace gpu_puzzles {

// Rows whose |mean| * rstd exceeds this are recomputed normalise-first by the
// fused forward (the folded rewrite loses ~ratio * eps_acc * sqrt(H) there).
constexpr double kLayerNormLinearMaxMeanRatio = 16.0;

// The norm a kernel computes. kRms: y = x * rstd * gamma, rstd = rsqrt(mean(x^2) + eps):
// LayerNorm with the mean forced to zero and no beta, so the same kernels serve both
// (one instantiation each); for kRms, mean/beta/dbeta are unused and may be null.
enum class Norm : int { kLayer = 0, kRms = 1 };

// mean/rstd of every row; y = (x - mean) * rstd * gamma + beta when y != null
// (kRms: rstd only, y = x * rstd * gamma). y has dtype `out`: dtype, or for a float32 x
// a half type (the operand of a half linear under autocast, written without a float32 copy).
LaunchStatus layer_norm_forward_cuda(const void* x, const void* gamma, const void* beta, void* y, void* mean,
                                     void* rstd, int64_t M, int64_t H, double eps, DType dtype, cudaStream_t stream,
                                     Norm norm, DType out);

// Blocks of the backward (each owns one row of partial dgamma/dbeta sums);
// the workspace holds 2 * blocks * H accumulate-type elements. An error when a device
// query fails.
LaunchStatus layer_norm_backward_blocks(int64_t M, int64_t H, DType dtype, DType grad_dtype, bool xn, int64_t& blocks,
                                        Norm norm);

// dx, dgamma, dbeta from dy (grad of the LayerNorm output). Deterministic:
// per-block partials reduced in a fixed order. With xn (and beta) non-null it also
// writes the LayerNorm output xn = gamma * xhat + beta (the fused backward's dW operand).
// dx may be dy (in place, one dtype). kRms: dbeta, mean and beta unused (xn = gamma * x * rstd).
// dy and xn have grad_dtype: dtype, or for a float32 x a half type (the fused backward
// under autocast: dy from the half GEMM, xn its operand), the rest dtype.
LaunchStatus layer_norm_backward_cuda(const void* dy, const void* x, const void* gamma, const void* mean,
                                      const void* rstd, void* dx, void* dgamma, void* dbeta, void* workspace, int64_t M,
                                      int64_t H, DType dtype, DType grad_dtype, cudaStream_t stream, const void* beta,
                                      void* xn, Norm norm);

// Fold the LayerNorm affine into the linear layer, per output row n:
//   wc[n,:] = W[n,:]*gamma - mean_h(W[n,:]*gamma)   (stored in T: the GEMM operand)
//   r[n]    = sum_h wc[n,h] as stored (the centring's rounding residual)
//   bp[n]   = b[n] + sum_h W[n,h]*beta[h]            (b may be null)
LaunchStatus layernorm_linear_fold_weight_cuda(const void* W, const void* gamma, const void* beta, const void* b,
                                               void* wc, void* r, void* bp, int64_t N, int64_t H, DType dtype,
                                               cudaStream_t stream);

// The statistics (as layer_norm_forward_cuda with y null) and the fold (as
// layernorm_linear_fold_weight_cuda) in one launch when a row fits registers (16-byte vectors;
// a warp per row up to H*sizeof(T) = 2 KiB, a block per row up to 32 KiB); otherwise
// the two launches.
LaunchStatus layernorm_linear_prep_cuda(const void* x, const void* W, const void* gamma, const void* beta,
                                        const void* b, void* mean, void* rstd, void* wc, void* r, void* bp, int64_t M,
                                        int64_t N, int64_t H, double eps, DType dtype, cudaStream_t stream);

// The fused backward's db[n] = sum_m dy[m,n] (fp32 partials in the workspace, then
// summed in a fixed order: deterministic; M == 0 gives zeros). The workspace holds
// layernorm_linear_bias_grad_workspace(M, N) accumulate-type elements (possibly 0).
int64_t layernorm_linear_bias_grad_workspace(int64_t M, int64_t N);
LaunchStatus layernorm_linear_bias_grad_cuda(const void* dy, void* db, void* workspace, int64_t M, int64_t N,
                                             DType dtype, cudaStream_t stream);

// In place on z = x @ wc^T (M, N): y = rstd*(z - mean*r) + bp; then rows with
// |mean|*rstd > kLayerNormLinearMaxMeanRatio are recomputed as (normalised x) @ W^T + b.
LaunchStatus layernorm_linear_epilogue_cuda(void* z, const void* x, const void* gamma, const void* beta, const void* W,
                                            const void* b, const void* mean, const void* rstd, const void* r,
                                            const void* bp, int64_t M, int64_t N, int64_t H, DType dtype,
                                            cudaStream_t stream);

// After layernorm_linear_evt_gemm_cuda: recompute only the rows with |mean|*rstd >
// kLayerNormLinearMaxMeanRatio in y (M, N), as layernorm_linear_epilogue_cuda does; other rows
// are left untouched (only their mean/rstd are read). pdl: launched as a programmatic
// dependent of the GEMM before it (sm_90; the kernel waits for that GEMM itself).
LaunchStatus layernorm_linear_large_mean_fixup_cuda(void* y, const void* x, const void* gamma, const void* beta,
                                                    const void* W, const void* b, const void* mean, const void* rstd,
                                                    int64_t M, int64_t N, int64_t H, DType dtype, cudaStream_t stream,
                                                    bool pdl = false);

// sm_90a only (layernorm_linear_evt_sm90.cu, built with CUTLASS): one GEMM x @ wc^T (x (M, K),
// wc (N, K), both row-major) whose epilogue writes y = rstd*(acc - mean*r) + bp
// (fp32 statistics and vectors). bf16 / fp16.
// Possible: built with CUTLASS, the current device is compute capability 9.0 and runs
// the real sm_90a kernels, N % 8 == 0, K % 8 == 0, 16-byte aligned x and wc, and
// 1 <= M, N, K < 2^31. The GEMM returns cudaErrorNotSupported, launching nothing, for a
// problem CUTLASS refuses (y unaligned, say).
bool layernorm_linear_evt_possible(const void* x, const void* wc, int64_t M, int64_t N, int64_t K, DType dtype);
// From this K the GEMM takes its big tile (128x256, cooperative), below it 128x128 pingpong; the
// fused forward's plan (layernorm_linear_plan.h) weighs the big tile against cuBLAS.
constexpr int64_t kEvtBigTileMinK = 2048;
size_t layernorm_linear_evt_workspace_bytes(int64_t M, int64_t N, int64_t K, DType dtype);
// pdl: a programmatic dependent launch (the kernel waits for the launch before it).
LaunchStatus layernorm_linear_evt_gemm_cuda(const void* x, const void* wc, const void* mean, const void* rstd,
                                            const void* r, const void* bp, void* y, void* workspace, int64_t M,
                                            int64_t N, int64_t K, DType dtype, cudaStream_t stream, bool pdl = false);

// CPU kernels (layernorm_linear_cpu.cpp, one copy per SIMD level: call through
// GP_CPU_CALL). They compute what the CUDA launchers of the same names compute.
// layer_norm_forward_cpu: y may be null (statistics only); stats_given: mean/rstd are
// inputs and only y is written (the fused backward's normalised activation).
GP_CPU_DECLARE(void, layer_norm_forward_cpu, const void* x, const void* gamma, const void* beta, void* y, void* mean,
               void* rstd, int64_t M, int64_t H, double eps, DType dtype, bool stats_given, Norm norm)
GP_CPU_DECLARE(void, layer_norm_backward_cpu, const void* dy, const void* x, const void* gamma, const void* mean,
               const void* rstd, void* dx, void* dgamma, void* dbeta, int64_t M, int64_t H, DType dtype, Norm norm)
GP_CPU_DECLARE(void, layernorm_linear_fold_weight_cpu, const void* W, const void* gamma, const void* beta,
               const void* b, void* wc, void* r, void* bp, int64_t N, int64_t H, DType dtype)
GP_CPU_DECLARE(void, layernorm_linear_epilogue_cpu, void* z, const void* x, const void* gamma, const void* beta,
               const void* W, const void* b, const void* mean, const void* rstd, const void* r, const void* bp,
               int64_t M, int64_t N, int64_t H, DType dtype)

// The curriculum's fused kernel (puzzle 20): one thread per row computes the
// statistics and then all N outputs. Kept for the notebook's comparison only.
LaunchStatus layernorm_linear_naive_cuda(const void* x, const void* gamma, const void* beta, const void* W,
                                         const void* b, void* y, int64_t M, int64_t N, int64_t H, double eps,
                                         DType dtype, cudaStream_t stream);

}  // namespace gpu_puzzles
