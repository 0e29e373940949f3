// Autograd for gated_act (why in C++: common/autograd.h). Saves gate and up, which the
// Linears before it keep anyway; stock's act(gate) * up also keeps act(gate).
#include <string>

#include "common/autograd.h"

namespace gpu_puzzles {
namespace {

using Tensor = at::Tensor;
using ForwardSig = Tensor(const Tensor&, const Tensor&, c10::string_view);
using BackwardSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, c10::string_view);

struct GatedActFunction : public torch::autograd::Function<GatedActFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& gate, const Tensor& up, c10::string_view activation) {
    static const auto op = typed_op<ForwardSig>("gpu_puzzles::gated_act");
    ctx->save_for_backward({gate, up});
    ctx->saved_data["activation"] = std::string(activation);
    at::AutoDispatchBelowADInplaceOrView guard;
    return op.call(gate, up, activation);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op = typed_op<BackwardSig>("gpu_puzzles::gated_act_backward");
    const auto saved = ctx->get_saved_variables();
    const std::string activation = ctx->saved_data["activation"].toStringRef();
    auto [dgate, dup] = op.call(grads[0], saved[0], saved[1], activation);
    return {if_needed(ctx, 0, dgate), if_needed(ctx, 1, dup), Tensor()};
  }
};

Tensor gated_act_autograd(const Tensor& gate, const Tensor& up, c10::string_view activation) {
  return GatedActFunction::apply(gate, up, activation);
}

// The backward op: no derivative of its own (differentiated again, it raises naming the op).
std::tuple<Tensor, Tensor> gated_act_backward_autograd(const Tensor& g, const Tensor& gate, const Tensor& up,
                                                       c10::string_view activation) {
  static const auto op = typed_op<BackwardSig>("gpu_puzzles::gated_act_backward");
  return no_double_backward("gated_act_backward", below_autograd([&] { return op.call(g, gate, up, activation); }), g,
                            gate, up);
}

}  // namespace

TORCH_LIBRARY_IMPL(gpu_puzzles, Autograd, m) {
  m.impl("gated_act", &gated_act_autograd);
  m.impl("gated_act_backward", &gated_act_backward_autograd);
}

}  // namespace gpu_puzzles
