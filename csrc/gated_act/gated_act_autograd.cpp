// Autograd for gated_act (why in C++: common/autograd.h). Saves gate and up, which the
// Linears before it keep anyway; stock's act(gate) * up also keeps act(gate).
#include <string>
#include <utility>

#include "common/autograd.h"

namespace gpu_puzzles {
namespace {

using Tensor = at::Tensor;
using ForwardSig = Tensor(const Tensor&, const Tensor&, c10::string_view);
using BackwardSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, c10::string_view);

constexpr char kForward[] = "gpu_puzzles::gated_act";
constexpr char kBackward[] = "gpu_puzzles::gated_act_backward";
constexpr auto forward_op = op_handle<ForwardSig, kForward>;
constexpr auto backward_op = op_handle<BackwardSig, kBackward>;  // both autograd kernels below call it

struct GatedActFunction : public torch::autograd::Function<GatedActFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& gate, const Tensor& up, c10::string_view activation) {
    ctx->save_for_backward({gate, up});
    ctx->saved_data["activation"] = std::string(activation);
    at::AutoDispatchBelowADInplaceOrView guard;
    return forward_op().call(gate, up, activation);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto [dgate, dup] = backward_op().call(grads[0], saved[0], saved[1], ctx->saved_data["activation"].toStringRef());
    return {if_needed(ctx, 0, dgate), if_needed(ctx, 1, dup), Tensor()};
  }
};

// The forward's kernel and, below, the backward op's: no derivative of its own (differentiated
// again, it raises naming the op).
TORCH_LIBRARY_IMPL(gpu_puzzles, Autograd, m) {
  m.impl("gated_act", [](const Tensor& gate, const Tensor& up, c10::string_view activation) {
    if (!needs_autograd(gate, up)) return below_autograd([&] { return forward_op().call(gate, up, activation); });
    return GatedActFunction::apply(gate, up, activation);
  });
  m.impl("gated_act_backward", [](const Tensor& g, const Tensor& gate, const Tensor& up, c10::string_view activation) {
    auto out = below_autograd([&] { return backward_op().call(g, gate, up, activation); });
    return no_double_backward("gated_act_backward", std::move(out), g, gate, up);
  });
}

}  // namespace
}  // namespace gpu_puzzles
