// Autograd for cross_entropy and fused_linear_cross_entropy (why in C++: common/autograd.h).
// cross_entropy keeps the logits, target and per-row lse; its backward is one pass over
// the logits. fused_linear_cross_entropy computes its gradients in the forward (the
// logits exist only chunk by chunk there), for a loss of 1; the backward scales them.
#include <array>
#include <string>

#include <ATen/core/grad_mode.h>

#include "common/autograd.h"

namespace gpu_puzzles {
namespace {

using Tensor = at::Tensor;
using Tensor2 = std::tuple<Tensor, Tensor>;
using Tensor4 = std::tuple<Tensor, Tensor, Tensor, Tensor>;

struct CrossEntropyFunction : public torch::autograd::Function<CrossEntropyFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& logits, const Tensor& target, int64_t ignore_index,
                               c10::string_view reduction) {
    static const auto op =
        typed_op<Tensor2(const Tensor&, const Tensor&, int64_t, c10::string_view)>("gpu_puzzles::cross_entropy");
    Tensor loss, lse;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      std::tie(loss, lse) = op.call(logits, target, ignore_index, reduction);
    }
    ctx->save_for_backward({logits, target, lse});
    non_differentiable(ctx, {lse});
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["reduction"] = std::string(reduction);
    return {loss, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op = typed_op<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t,
                                           c10::string_view)>("gpu_puzzles::cross_entropy_backward");
    if (!grads[0].defined() || !ctx->needs_input_grad(0)) return variable_list(4);
    const auto s = ctx->get_saved_variables();
    const std::string reduction = ctx->saved_data["reduction"].toStringRef();
    const Tensor g = op.call(grads[0], s[0], s[1], s[2], ctx->saved_data["ignore_index"].toInt(), reduction);
    return {g, Tensor(), Tensor(), Tensor()};
  }
};

using FusedSig = Tensor4(const Tensor&, const Tensor&, const Tensor&, const c10::optional<Tensor>&, int64_t,
                         c10::string_view, std::array<bool, 3>);

struct FusedLinearCeFunction : public torch::autograd::Function<FusedLinearCeFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& hidden, const Tensor& weight, const Tensor& target,
                               const c10::optional<Tensor>& bias, int64_t ignore_index, c10::string_view reduction,
                               bool need_h, bool need_w, bool need_b) {
    static const auto op = typed_op<FusedSig>("gpu_puzzles::fused_linear_cross_entropy");
    Tensor loss, gh, gw, gb;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      std::tie(loss, gh, gw, gb) = op.call(hidden, weight, target, bias, ignore_index, reduction,
                                           std::array<bool, 3>{need_h, need_w, need_b});
    }
    ctx->save_for_backward({gh, gw, gb});
    non_differentiable(ctx, {gh, gw, gb});
    ctx->saved_data["need_h"] = need_h;
    ctx->saved_data["need_w"] = need_w;
    ctx->saved_data["need_b"] = need_b;
    return {loss, gh, gw, gb};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list out(9);
    if (!grads[0].defined()) return out;
    const auto s = ctx->get_saved_variables();
    const bool mask[3] = {ctx->saved_data["need_h"].toBool(), ctx->saved_data["need_w"].toBool(),
                          ctx->saved_data["need_b"].toBool()};
    // The saved gradients are those of a loss of 1: scale by grad_loss (0-d).
    const int slot[3] = {0, 1, 3};
    for (int i = 0; i < 3; ++i)
      if (mask[i] && ctx->needs_input_grad(slot[i])) out[slot[i]] = s[i].mul(grads[0].to(s[i].scalar_type()));
    return out;
  }
};

Tensor4 fused_autograd(const Tensor& hidden, const Tensor& weight, const Tensor& target,
                       const c10::optional<Tensor>& bias, int64_t ignore_index, c10::string_view reduction,
                       std::array<bool, 3> output_mask) {
  // Gradients only where autograd will ask for them (or the caller did).
  const bool grad = at::GradMode::is_enabled();
  const bool has_bias = bias.has_value() && bias->defined();
  const bool need_h = output_mask[0] || (grad && hidden.requires_grad());
  const bool need_w = output_mask[1] || (grad && weight.requires_grad());
  const bool need_b = output_mask[2] || (grad && has_bias && bias->requires_grad());
  auto r = FusedLinearCeFunction::apply(hidden, weight, target, bias, ignore_index, reduction, need_h, need_w, need_b);
  return {r[0], r[1], r[2], r[3]};
}

Tensor2 cross_entropy_autograd(const Tensor& logits, const Tensor& target, int64_t ignore_index,
                               c10::string_view reduction) {
  auto r = CrossEntropyFunction::apply(logits, target, ignore_index, reduction);
  return {r[0], r[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(gpu_puzzles, Autograd, m) {
  m.impl("cross_entropy", &cross_entropy_autograd);
  m.impl("fused_linear_cross_entropy", &fused_autograd);
}

}  // namespace gpu_puzzles
