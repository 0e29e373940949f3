// Interface between attention.cpp (ATen side: checks, reshapes, registration),
// the CPU kernels (attention_cpu.cpp) and the fused CUDA kernels (attention_plan.cu
// picks and launches them; the families: attention_plan.h). The CUDA side is
// torch-free: the CPU kernels take at::Tensor, declared here without ATen's headers.
//
// Layout: every tensor contiguous, leading dims flattened into BH:
//   q (BH, Sq, D), k (BH, Sk, D), v (BH, Sk, Dv), o / dout (BH, Sq, Dv),
//   lse (BH, Sq): natural-log log-sum-exp of the scaled, masked scores of each
//   query row, float32 for float32/float16/bfloat16 inputs and float64 for
//   float64 inputs. The forward writes it; the backward reads it, so the S x S
//   probabilities are never stored.
// causal follows SDPA's is_causal: key j is visible to query i iff j <= i
// (mask aligned to the top-left corner, also when Sq != Sk).
// Sizes are int64 and index arithmetic must be 64-bit: BH * Sq * D can pass 2^31.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/dtype.h"

namespace at {
class Tensor;
}

namespace gpu_puzzles {

// ---- CPU kernels (attention_cpu.cpp): float32 or float64, the layout above ----

// Writes out (BH, Sq, Dv) and lse (BH, Sq); Sk == 0 gives zeros and lse = -inf.
void attention_fwd_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                       at::Tensor& lse, double scale, bool causal);
// Writes dq (BH, Sq, D), dk (BH, Sk, D), dv (BH, Sk, Dv).
void attention_bwd_cpu(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& o, const at::Tensor& lse, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
                       double scale, bool causal);
// The unfused chain (contiguous inputs, any float dtype): out (..., N, M) = x (..., M, N)
// transposed; c (..., M, N) = alpha * a @ b, -inf where n > m with causal.
void transpose_last2_cpu_kernel(const at::Tensor& x, at::Tensor& out);
void matmul_cpu_kernel(const at::Tensor& a, const at::Tensor& b, at::Tensor& c, double alpha, bool causal);

// ---- CUDA kernels ----------------------------------------------------------------

struct AttentionFwdArgs {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  void* lse;
  int64_t BH, Sq, Sk, D, Dv;
  float scale;
  bool causal;
  DType dtype;
};

struct AttentionBwdArgs {
  const void* q;
  const void* k;
  const void* v;
  const void* o;
  const void* dout;
  const void* lse;
  void* dq;  // (BH, Sq, D)
  void* dk;  // (BH, Sk, D)
  void* dv;  // (BH, Sk, Dv)
  int64_t BH, Sq, Sk, D, Dv;
  float scale;
  bool causal;
  DType dtype;
};

// Largest head dim (D and Dv) the CUDA kernels accept.
constexpr int64_t kAttentionMaxHeadDim = 256;

// Bytes of device scratch the backward needs (e.g. delta = rowsum(dout * o) and
// a float32 dq accumulator); the host allocates it uninitialised.
int64_t attention_backward_workspace_bytes(const AttentionBwdArgs& a);

LaunchStatus attention_forward_cuda(const AttentionFwdArgs& a, cudaStream_t stream);
LaunchStatus attention_backward_cuda(const AttentionBwdArgs& a, void* workspace, cudaStream_t stream);

}  // namespace gpu_puzzles
