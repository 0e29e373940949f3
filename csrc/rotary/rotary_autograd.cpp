// Autograd for rotary (why in C++: common/autograd.h). Saves only cos and sin: the map is
// linear in q and k, so the backward applies its transpose to the outputs' gradients.
#include <utility>

#include "common/autograd.h"

namespace gpu_puzzles {
namespace {

using Tensor = at::Tensor;
using Pair = std::tuple<Tensor, Tensor>;
using ForwardSig = Pair(const Tensor&, const Tensor&, const Tensor&, const Tensor&);
using BackwardSig = Pair(const Tensor&, const Tensor&, const Tensor&, const Tensor&, at::ScalarType);

constexpr char kForward[] = "gpu_puzzles::rotary";
constexpr char kBackward[] = "gpu_puzzles::rotary_backward";
constexpr auto forward_op = op_handle<ForwardSig, kForward>;
constexpr auto backward_op = op_handle<BackwardSig, kBackward>;  // both autograd kernels below call it

struct RotaryFunction : public torch::autograd::Function<RotaryFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& cos,
                               const Tensor& sin) {
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["dtype"] = q.scalar_type();
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [qo, ko] = forward_op().call(q, k, cos, sin);
    return {qo, ko};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto [dq, dk] = backward_op().call(grads[0], grads[1], saved[0], saved[1], ctx->saved_data["dtype"].toScalarType());
    return {if_needed(ctx, 0, dq), if_needed(ctx, 1, dk), Tensor(), Tensor()};
  }
};

TORCH_LIBRARY_IMPL(gpu_puzzles, Autograd, m) {
  m.impl("rotary", [](const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin) -> Pair {
    // transformers computes cos and sin without grad; a gradient to them would be dropped.
    // (Checked here: Function::forward runs with grad mode off.)
    TORCH_CHECK(!at::GradMode::is_enabled() || (!cos.requires_grad() && !sin.requires_grad()),
                "rotary: cos and sin must not require grad (the op gives no gradient for them); pass them detached");
    if (!needs_autograd(q, k, cos, sin)) return below_autograd([&] { return forward_op().call(q, k, cos, sin); });
    auto out = RotaryFunction::apply(q, k, cos, sin);
    return {out[0], out[1]};
  });
  m.impl("rotary_backward",
         [](const Tensor& gq, const Tensor& gk, const Tensor& cos, const Tensor& sin, at::ScalarType dtype) -> Pair {
           auto out = below_autograd([&] { return backward_op().call(gq, gk, cos, sin, dtype); });
           return no_double_backward("rotary_backward", std::move(out), gq, gk, cos, sin);
         });
}

}  // namespace
}  // namespace gpu_puzzles
