// Interface between attention.cpp (ATen side: checks, reshapes, registration),
// the CPU kernels (attention_cpu.cpp) and the fused CUDA kernels (attention_plan.cu
// picks and launches them; the families: attention_plan.h). The CUDA side is
// torch-free: the CPU kernels take at::Tensor, declared here without ATen's headers.
//
// Layout (CPU kernels): every tensor contiguous, leading dims flattened into BH:
//   q (BH, Sq, D), k (BHkv, Sk, D), v (BHkv, Sk, Dv), o / dout (BH, Sq, Dv); query row bh
//   reads kv row bh / G (G = BH / BHkv: the group size, as the heads are the innermost
//   leading dim).
// Layout (CUDA kernels): each of q, k, v, o, dout, dq, dk, dv is viewed as (B, heads, S, Dlast)
//   with its own element strides (AttnStrides) and Dlast contiguous, so the views models
//   hand over (q/k/v transposed out of a fused projection) are read where they lie;
//   BH = B * H, and the grid's row bh is head bh % H of batch bh / H.
// Grouped k/v heads (GQA/MQA, SDPA's enable_gqa): q, o, dout, dq have H heads, k, v, dk, dv
//   Hkv, Hkv dividing H; query head h reads kv head h / G, G = H / Hkv (G = 1: plain
//   multi-head). k and v are never repeated: dk, dv of a kv head are the sums over its G
//   query heads, accumulated by the one block (CUDA) or task (CPU) that writes them.
// lse (BH, Sq), contiguous on both: natural-log log-sum-exp of the scaled, masked scores of each
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
void attention_fwd_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, at::Tensor& lse,
                       double scale, bool causal);
// Writes dq (BH, Sq, D), dk (BHkv, Sk, D), dv (BHkv, Sk, Dv).
void attention_bwd_cpu(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& o, const at::Tensor& lse, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
                       double scale, bool causal);
// The unfused chain (contiguous inputs, any float dtype): out (..., N, M) = x (..., M, N)
// transposed; c (..., M, N) = alpha * a @ b, -inf where n > m with causal.
void transpose_last2_cpu_kernel(const at::Tensor& x, at::Tensor& out);
void matmul_cpu_kernel(const at::Tensor& a, const at::Tensor& b, at::Tensor& c, double alpha, bool causal);

// ---- CUDA kernels ----------------------------------------------------------------

// Element strides of one operand viewed as (B, H, S, Dlast); Dlast has stride 1. The
// stride of a dim of size 1 is 0 (it never moves the pointer).
struct AttnStrides {
  int64_t b, h, s;
};

// Rows start 16-byte aligned for every (b, h, s): what the 16-byte vector and cp.async
// loads of the tensor-core kernels need.
inline bool attn_rows_aligned16(const void* p, const AttnStrides& st, int64_t elem_bytes) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0 && (st.b * elem_bytes) % 16 == 0 &&
         (st.h * elem_bytes) % 16 == 0 && (st.s * elem_bytes) % 16 == 0;
}

struct AttentionFwdArgs {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  void* lse;  // contiguous (BH, Sq)
  AttnStrides sq, sk, sv, so;
  int64_t B, H, Hkv, Sq, Sk, D, Dv;  // H % Hkv == 0
  float scale;
  bool causal;
  DType dtype;
  int64_t BH() const { return B * H; }
  int64_t G() const { return H / Hkv; }  // query heads per kv head
};

struct AttentionBwdArgs {
  const void* q;
  const void* k;
  const void* v;
  const void* o;
  const void* dout;
  const void* lse;  // contiguous (BH, Sq)
  void* dq;         // (B, H, Sq, D)
  void* dk;         // (B, Hkv, Sk, D)
  void* dv;         // (B, Hkv, Sk, Dv)
  AttnStrides sq, sk, sv, so, sdo, sdq, sdk, sdv;
  int64_t B, H, Hkv, Sq, Sk, D, Dv;  // H % Hkv == 0
  float scale;
  bool causal;
  DType dtype;
  bool deterministic;  // torch.use_deterministic_algorithms: bitwise reproducible gradients
  int64_t BH() const { return B * H; }
  int64_t BHkv() const { return B * Hkv; }
  int64_t G() const { return H / Hkv; }  // query heads per kv head
};

// Largest head dim (D and Dv) the CUDA kernels accept.
constexpr int64_t kAttentionMaxHeadDim = 256;

// Bytes of device scratch the backward needs (e.g. delta = rowsum(dout * o) and
// a float32 dq accumulator); the host allocates it uninitialised.
int64_t attention_backward_workspace_bytes(const AttentionBwdArgs& a);

LaunchStatus attention_forward_cuda(const AttentionFwdArgs& a, cudaStream_t stream);
LaunchStatus attention_backward_cuda(const AttentionBwdArgs& a, void* workspace, cudaStream_t stream);

// Knob values read as numbers (common/kernel_choice.h: 1-based, in kKnobs' order; 0 = the heuristic).
enum AttentionBwdKnob : int { kKnobBwdMma = 1, kKnobBwdWgmma = 2, kKnobBwdWgmmaSplit = 3, kKnobBwdWgmmaTurns = 4 };
enum AttentionOrderKnob : int { kKnobOrderRows = 1, kKnobOrderLongest = 2 };
enum AttentionGridKnob : int { kKnobGridBlocks = 1, kKnobGridPersistent = 2 };

}  // namespace gpu_puzzles
