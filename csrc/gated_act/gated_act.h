// Interface between gated_act.cpp (host checks) and the torch-free kernels: gated_act_cpu.cpp
// and gated_act_cuda.cu.
// out = act(gate) * up, the gated MLP's middle (SwiGLU: silu; GeGLU: tanh- or erf-GELU).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/cpu_isa.h"
#include "common/dtype.h"
#include "common/row_strides.h"

namespace gpu_puzzles {

// The activation applied to the gate; its name in the op's schema in the comment.
enum class GatedAct : int {
  Silu = 0,      // "silu": g * sigmoid(g) (SwiGLU)
  GeluTanh = 1,  // "gelu_tanh": 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) (GeGLU, Gemma)
  Gelu = 2,      // "gelu": 0.5 g (1 + erf(g / sqrt(2)))
};

// `rows` rows of I elements: gate, up (and grad_out) read through their row strides (the two
// halves of one projection's output are views with a row stride of 2 I); out, dgate, dup
// contiguous. Statistics-free and elementwise: float32 math (float64 for float64).
struct GatedActArgs {
  const void* gate;
  const void* up;
  const void* grad_out;  // backward only
  void* out;             // forward: act(gate) * up; backward: dgate
  void* dup;             // backward only
  int64_t rows, I;
  RowStrides gs, us, ds;  // gate, up, grad_out
  GatedAct act;
  DType dtype;
};

// CPU kernels (gated_act_cpu.cpp, one copy per SIMD level: call through GP_CPU_CALL).
GP_CPU_DECLARE(void, gated_act_forward_cpu, const GatedActArgs& a)
GP_CPU_DECLARE(void, gated_act_backward_cpu, const GatedActArgs& a)

LaunchStatus gated_act_fwd_cuda(const GatedActArgs& a, int dev, cudaStream_t stream);
LaunchStatus gated_act_bwd_cuda(const GatedActArgs& a, int dev, cudaStream_t stream);

}  // namespace gpu_puzzles
