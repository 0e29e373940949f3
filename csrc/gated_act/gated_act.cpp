// gated_act host side: argument checks and the CPU/CUDA registrations (the CPU kernels are
// in gated_act_cpu.cpp, the CUDA ones in gated_act_cuda.cu). gate and up are (..., I) of one
// shape; the kernels read their rows in place (gate_up.chunk(2, -1)'s halves too).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>
#include <tuple>
#include <utility>

#include "common/checks.h"
#include "common/cuda_launch.h"
#include "common/register.h"
#include "common/tensor_rows.h"
#include "gated_act/gated_act.h"

namespace gpu_puzzles {
namespace {

GatedAct parse_activation(c10::string_view name, const char* op) {
  if (name == "silu") return GatedAct::Silu;
  if (name == "gelu_tanh") return GatedAct::GeluTanh;
  if (name == "gelu") return GatedAct::Gelu;
  TORCH_CHECK(false, op, ": activation must be one of 'silu', 'gelu_tanh', 'gelu', got '", std::string(name), "'");
}

void check_inputs(const at::Tensor& gate, const at::Tensor& up, const char* op) {
  const std::string o(op);
  TORCH_CHECK(gate.dim() >= 1, op, ": gate must have at least one dimension (..., I), got a 0-d tensor");
  check_float(gate, (o + ": gate").c_str());
  check_same_dtype(up, gate, (o + ": up").c_str(), "gate");
  check_same_device(up, gate, (o + ": up").c_str(), "gate");
  TORCH_CHECK(up.sizes() == gate.sizes(), op, ": up has shape ", up.sizes(), " but gate has shape ", gate.sizes(),
              "; they must match");
}

void check_grad_out(const at::Tensor& grad_out, const at::Tensor& gate) {
  check_same_dtype(grad_out, gate, "gated_act_backward: grad_out", "gate");
  check_same_device(grad_out, gate, "gated_act_backward: grad_out", "gate");
  TORCH_CHECK(grad_out.sizes() == gate.sizes(), "gated_act_backward: grad_out has shape ", grad_out.sizes(),
              " but gate has shape ", gate.sizes(), "; they must match");
}

// The kernels' arguments: rows of gate, up (and grad_out) read in place where their strides
// allow (gate_up.chunk(2, -1)'s halves), else from a contiguous copy held in `keep`.
GatedActArgs rows_of(const at::Tensor& gate, const at::Tensor& up, const at::Tensor* grad_out, GatedAct act,
                     at::Tensor (&keep)[3]) {
  GatedActArgs a{};
  a.I = gate.size(-1);
  a.rows = a.I == 0 ? 0 : gate.numel() / a.I;
  a.act = act;
  a.dtype = to_dtype(gate.scalar_type());
  std::tie(keep[0], a.gs) = tensor_rows(gate, true);
  std::tie(keep[1], a.us) = tensor_rows(up, true);
  a.gate = keep[0].data_ptr();
  a.up = keep[1].data_ptr();
  if (grad_out != nullptr) {
    std::tie(keep[2], a.ds) = tensor_rows(*grad_out, true);
    a.grad_out = keep[2].data_ptr();
  }
  return a;
}

// The forward (backward: bwd) kernel on gate's device.
void launch(const GatedActArgs& a, const at::Tensor& gate, bool bwd) {
  if (gate.device().is_cpu()) {
    bwd ? GP_CPU_CALL(gated_act_backward_cpu)(a) : GP_CPU_CALL(gated_act_forward_cpu)(a);
    return;
  }
#ifdef WITH_CUDA  // registered for CPU and CUDA only (GP_IMPL): not CPU is CUDA
  const c10::cuda::CUDAGuard guard(gate.device());
  GP_CUDA_CHECK_STATUS((bwd ? gated_act_bwd_cuda : gated_act_fwd_cuda)(a, gate.get_device(), current_stream()));
#endif
}

at::Tensor gated_act_any(const at::Tensor& gate, const at::Tensor& up, c10::string_view activation) {
  check_inputs(gate, up, "gated_act");
  at::Tensor keep[3];
  GatedActArgs a = rows_of(gate, up, nullptr, parse_activation(activation, "gated_act"), keep);
  at::Tensor out = at::empty(gate.sizes(), gate.options());
  a.out = out.data_ptr();
  launch(a, gate, false);
  return out;
}

std::tuple<at::Tensor, at::Tensor> gated_act_backward_any(const at::Tensor& grad_out, const at::Tensor& gate,
                                                          const at::Tensor& up, c10::string_view activation) {
  check_inputs(gate, up, "gated_act_backward");
  check_grad_out(grad_out, gate);
  at::Tensor keep[3];
  GatedActArgs a = rows_of(gate, up, &grad_out, parse_activation(activation, "gated_act_backward"), keep);
  at::Tensor dgate = at::empty(gate.sizes(), gate.options()), dup = at::empty(gate.sizes(), gate.options());
  a.out = dgate.data_ptr();
  a.dup = dup.data_ptr();
  launch(a, gate, true);
  return {dgate, dup};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gpu_puzzles, m) {
  GP_IMPL(m, "gated_act", gated_act_any, gated_act_any);
  GP_IMPL(m, "gated_act_backward", gated_act_backward_any, gated_act_backward_any);
}

}  // namespace gpu_puzzles
