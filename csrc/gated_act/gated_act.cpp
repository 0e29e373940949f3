// gated_act host side: argument checks and the CPU/CUDA registrations (the CPU kernels are
// in gated_act_cpu.cpp, the CUDA ones in gated_act_cuda.cu). gate and up are (..., I) of one
// shape; the CUDA kernels read their rows in place (gate_up.chunk(2, -1)'s halves too).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>
#include <tuple>

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

#ifdef WITH_CUDA
GatedActArgs cuda_args(const at::Tensor& gate, const at::Tensor& up, GatedAct act) {
  TORCH_CHECK(gate.is_cuda(), "gated_act: gate must be a CUDA tensor for the CUDA kernel, got ", gate.device());
  GatedActArgs a{};
  a.I = gate.size(-1);
  a.rows = a.I == 0 ? 0 : gate.numel() / a.I;
  a.act = act;
  a.dtype = to_dtype(gate.scalar_type());
  return a;
}

at::Tensor gated_act_cuda(const at::Tensor& gate, const at::Tensor& up, c10::string_view activation) {
  check_inputs(gate, up, "gated_act");
  GatedActArgs a = cuda_args(gate, up, parse_activation(activation, "gated_act"));
  const c10::cuda::CUDAGuard guard(gate.device());
  const auto [gc, gs] = tensor_rows(gate, true);
  const auto [uc, us] = tensor_rows(up, true);
  at::Tensor out = at::empty(gate.sizes(), gate.options());
  a.gate = gc.data_ptr();
  a.up = uc.data_ptr();
  a.out = out.data_ptr();
  a.gs = gs;
  a.us = us;
  GP_CUDA_CHECK_STATUS(gated_act_fwd_cuda(a, gate.get_device(), current_stream()));
  return out;
}

std::tuple<at::Tensor, at::Tensor> gated_act_backward_cuda(const at::Tensor& grad_out, const at::Tensor& gate,
                                                           const at::Tensor& up, c10::string_view activation) {
  check_inputs(gate, up, "gated_act_backward");
  check_grad_out(grad_out, gate);
  GatedActArgs a = cuda_args(gate, up, parse_activation(activation, "gated_act_backward"));
  const c10::cuda::CUDAGuard guard(gate.device());
  const auto [gc, gs] = tensor_rows(gate, true);
  const auto [uc, us] = tensor_rows(up, true);
  const auto [dc, ds] = tensor_rows(grad_out, true);
  at::Tensor dgate = at::empty(gate.sizes(), gate.options()), dup = at::empty(gate.sizes(), gate.options());
  a.gate = gc.data_ptr();
  a.up = uc.data_ptr();
  a.grad_out = dc.data_ptr();
  a.out = dgate.data_ptr();
  a.dup = dup.data_ptr();
  a.gs = gs;
  a.us = us;
  a.ds = ds;
  GP_CUDA_CHECK_STATUS(gated_act_bwd_cuda(a, gate.get_device(), current_stream()));
  return {dgate, dup};
}
#endif

at::Tensor gated_act_cpu(const at::Tensor& gate, const at::Tensor& up, c10::string_view activation) {
  check_inputs(gate, up, "gated_act");
  const GatedAct act = parse_activation(activation, "gated_act");
  TORCH_CHECK(gate.device().is_cpu(), "gated_act: gate must be a CPU tensor for the CPU kernel, got ", gate.device());
  at::Tensor out = at::empty(gate.sizes(), gate.options());
  gated_act_forward_cpu_kernel(gate.contiguous(), up.contiguous(), out, act);
  return out;
}

std::tuple<at::Tensor, at::Tensor> gated_act_backward_cpu(const at::Tensor& grad_out, const at::Tensor& gate,
                                                          const at::Tensor& up, c10::string_view activation) {
  check_inputs(gate, up, "gated_act_backward");
  check_grad_out(grad_out, gate);
  const GatedAct act = parse_activation(activation, "gated_act_backward");
  at::Tensor dgate = at::empty(gate.sizes(), gate.options()), dup = at::empty(gate.sizes(), gate.options());
  gated_act_backward_cpu_kernel(grad_out.contiguous(), gate.contiguous(), up.contiguous(), dgate, dup, act);
  return {dgate, dup};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gpu_puzzles, m) {
  GP_IMPL(m, "gated_act", gated_act_cpu, gated_act_cuda);
  GP_IMPL(m, "gated_act_backward", gated_act_backward_cpu, gated_act_backward_cuda);
}

}  // namespace gpu_puzzles
