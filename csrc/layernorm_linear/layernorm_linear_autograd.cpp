// Autograd for layer_norm, rms_norm and their fused +Linear ops (why in C++:
// common/autograd.h). The forwards return (y, mean, rstd) (RMSNorm: (y, rstd)); only y
// is differentiable, and the backward keeps x and the per-row statistics, never the
// normalised activation.
#include "common/autograd.h"

namespace gpu_puzzles {
namespace {

using Tensor = at::Tensor;
using Tensor2 = std::tuple<Tensor, Tensor>;
using Tensor3 = std::tuple<Tensor, Tensor, Tensor>;
using Tensor4 = std::tuple<Tensor, Tensor, Tensor, Tensor>;
using Tensor5 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>;

struct LayerNormFunction : public torch::autograd::Function<LayerNormFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, const Tensor& bias,
                               double eps) {
    static const auto op =
        typed_op<Tensor3(const Tensor&, const Tensor&, const Tensor&, double)>("gpu_puzzles::layer_norm");
    Tensor y, mean, rstd;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      std::tie(y, mean, rstd) = op.call(x, weight, bias, eps);
    }
    ctx->save_for_backward({x, weight, mean, rstd});
    non_differentiable(ctx, {mean, rstd});
    return {y, mean, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op =
        typed_op<Tensor3(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&)>(
            "gpu_puzzles::layer_norm_backward");
    if (!grads[0].defined()) return {Tensor(), Tensor(), Tensor(), Tensor()};
    const auto s = ctx->get_saved_variables();
    auto [dx, dw, db] = op.call(grads[0], s[0], s[1], s[2], s[3]);
    return {if_needed(ctx, 0, dx), if_needed(ctx, 1, dw), if_needed(ctx, 2, db), Tensor()};
  }
};

struct FusedFunction : public torch::autograd::Function<FusedFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& ln_weight,
                               const Tensor& ln_bias, const Tensor& linear_weight,
                               const c10::optional<Tensor>& linear_bias, double eps) {
    static const auto op = typed_op<Tensor3(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                            const c10::optional<Tensor>&, double)>(
        "gpu_puzzles::fused_layernorm_linear");
    Tensor y, mean, rstd;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      std::tie(y, mean, rstd) = op.call(x, ln_weight, ln_bias, linear_weight, linear_bias, eps);
    }
    ctx->save_for_backward({x, ln_weight, ln_bias, linear_weight, mean, rstd});
    non_differentiable(ctx, {mean, rstd});
    ctx->saved_data["has_bias"] = linear_bias.has_value();
    return {y, mean, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op = typed_op<Tensor5(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                            const Tensor&, const Tensor&, const Tensor&)>(
        "gpu_puzzles::fused_layernorm_linear_backward");
    if (!grads[0].defined()) return variable_list(6);
    const auto s = ctx->get_saved_variables();
    auto [dx, dlw, dlb, dW, db] = op.call(grads[0], s[0], s[1], s[2], s[3], s[4], s[5]);
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    return {if_needed(ctx, 0, dx), if_needed(ctx, 1, dlw), if_needed(ctx, 2, dlb), if_needed(ctx, 3, dW),
            has_bias ? if_needed(ctx, 4, db) : Tensor(), Tensor()};
  }
};

struct RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, double eps) {
    static const auto op = typed_op<Tensor2(const Tensor&, const Tensor&, double)>("gpu_puzzles::rms_norm");
    Tensor y, rstd;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      std::tie(y, rstd) = op.call(x, weight, eps);
    }
    ctx->save_for_backward({x, weight, rstd});
    non_differentiable(ctx, {rstd});
    return {y, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op = typed_op<Tensor2(const Tensor&, const Tensor&, const Tensor&, const Tensor&)>(
        "gpu_puzzles::rms_norm_backward");
    if (!grads[0].defined()) return {Tensor(), Tensor(), Tensor()};
    const auto s = ctx->get_saved_variables();
    auto [dx, dw] = op.call(grads[0], s[0], s[1], s[2]);
    return {if_needed(ctx, 0, dx), if_needed(ctx, 1, dw), Tensor()};
  }
};

struct FusedRmsFunction : public torch::autograd::Function<FusedRmsFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& norm_weight,
                               const Tensor& linear_weight, const c10::optional<Tensor>& linear_bias, double eps) {
    static const auto op =
        typed_op<Tensor2(const Tensor&, const Tensor&, const Tensor&, const c10::optional<Tensor>&, double)>(
            "gpu_puzzles::fused_rmsnorm_linear");
    Tensor y, rstd;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      std::tie(y, rstd) = op.call(x, norm_weight, linear_weight, linear_bias, eps);
    }
    ctx->save_for_backward({x, norm_weight, linear_weight, rstd});
    non_differentiable(ctx, {rstd});
    ctx->saved_data["has_bias"] = linear_bias.has_value();
    return {y, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op = typed_op<Tensor4(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                            const Tensor&, bool)>("gpu_puzzles::fused_rmsnorm_linear_backward");
    if (!grads[0].defined()) return variable_list(5);
    const auto s = ctx->get_saved_variables();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    auto [dx, dnw, dW, db] = op.call(grads[0], s[0], s[1], s[2], s[3], has_bias);
    return {if_needed(ctx, 0, dx), if_needed(ctx, 1, dnw), if_needed(ctx, 2, dW),
            has_bias ? if_needed(ctx, 3, db) : Tensor(), Tensor()};
  }
};

Tensor2 rms_norm_autograd(const Tensor& x, const Tensor& weight, double eps) {
  auto r = RmsNormFunction::apply(x, weight, eps);
  return {r[0], r[1]};
}

Tensor2 fused_rms_autograd(const Tensor& x, const Tensor& norm_weight, const Tensor& linear_weight,
                           const c10::optional<Tensor>& linear_bias, double eps) {
  auto r = FusedRmsFunction::apply(x, norm_weight, linear_weight, linear_bias, eps);
  return {r[0], r[1]};
}

Tensor3 layer_norm_autograd(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  auto r = LayerNormFunction::apply(x, weight, bias, eps);
  return {r[0], r[1], r[2]};
}

Tensor3 fused_autograd(const Tensor& x, const Tensor& ln_weight, const Tensor& ln_bias, const Tensor& linear_weight,
                       const c10::optional<Tensor>& linear_bias, double eps) {
  auto r = FusedFunction::apply(x, ln_weight, ln_bias, linear_weight, linear_bias, eps);
  return {r[0], r[1], r[2]};
}

}  // namespace

TORCH_LIBRARY_IMPL(gpu_puzzles, Autograd, m) {
  m.impl("layer_norm", &layer_norm_autograd);
  m.impl("fused_layernorm_linear", &fused_autograd);
  m.impl("rms_norm", &rms_norm_autograd);
  m.impl("fused_rmsnorm_linear", &fused_rms_autograd);
}

}  // namespace gpu_puzzles
