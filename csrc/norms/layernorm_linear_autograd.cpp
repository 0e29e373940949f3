// Autograd for layer_norm, rms_norm and their fused +Linear ops, and for their backward
// ops (double backward; why in C++: common/autograd.h). The forwards return (y, mean, rstd)
// (RMSNorm: (y, rstd)); only y is differentiable, and the backward keeps x and the per-row
// statistics, never the normalised activation.
#include "common/autograd.h"
#include "common/checks.h"

namespace gpu_puzzles {
namespace {

using Tensor = at::Tensor;
using Tensor2 = std::tuple<Tensor, Tensor>;
using Tensor3 = std::tuple<Tensor, Tensor, Tensor>;
using Tensor4 = std::tuple<Tensor, Tensor, Tensor, Tensor>;
using Tensor5 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>;

struct LayerNormFunction : public torch::autograd::Function<LayerNormFunction> {
  static const auto& forward_op() {
    static const auto handle =
        typed_op<Tensor3(const Tensor&, const Tensor&, const Tensor&, double)>("gpu_puzzles::layer_norm");
    return handle;
  }

  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, const Tensor& bias,
                               double eps) {
    Tensor y, mean, rstd;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      std::tie(y, mean, rstd) = forward_op().call(x, weight, bias, eps);
    }
    ctx->save_for_backward({x, weight, mean, rstd});
    non_differentiable(ctx, {mean, rstd});
    return {y, mean, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op = typed_op<Tensor3(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&)>(
        "gpu_puzzles::layer_norm_backward");
    if (!grads[0].defined()) return {Tensor(), Tensor(), Tensor(), Tensor()};
    const auto s = ctx->get_saved_variables();
    auto [dx, dw, db] = op.call(grads[0], s[0], s[1], s[2], s[3]);
    return {if_needed(ctx, 0, dx), if_needed(ctx, 1, dw), if_needed(ctx, 2, db), Tensor()};
  }
};

struct FusedFunction : public torch::autograd::Function<FusedFunction> {
  static const auto& forward_op() {
    static const auto handle =
        typed_op<Tensor3(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const c10::optional<Tensor>&,
                         double)>("gpu_puzzles::fused_layernorm_linear");
    return handle;
  }

  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& ln_weight, const Tensor& ln_bias,
                               const Tensor& linear_weight, const c10::optional<Tensor>& linear_bias, double eps) {
    Tensor y, mean, rstd;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      std::tie(y, mean, rstd) = forward_op().call(x, ln_weight, ln_bias, linear_weight, linear_bias, eps);
    }
    ctx->save_for_backward({x, ln_weight, ln_bias, linear_weight, mean, rstd});
    non_differentiable(ctx, {mean, rstd});
    ctx->saved_data["has_bias"] = linear_bias.has_value();
    return {y, mean, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op =
        typed_op<Tensor5(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                         const Tensor&)>("gpu_puzzles::fused_layernorm_linear_backward");
    if (!grads[0].defined()) return variable_list(6);
    const auto s = ctx->get_saved_variables();
    auto [dx, dlw, dlb, dW, db] = op.call(grads[0], s[0], s[1], s[2], s[3], s[4], s[5]);
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    return {if_needed(ctx, 0, dx),
            if_needed(ctx, 1, dlw),
            if_needed(ctx, 2, dlb),
            if_needed(ctx, 3, dW),
            has_bias ? if_needed(ctx, 4, db) : Tensor(),
            Tensor()};
  }
};

struct RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
  static const auto& forward_op() {
    static const auto handle = typed_op<Tensor2(const Tensor&, const Tensor&, double)>("gpu_puzzles::rms_norm");
    return handle;
  }

  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, double eps) {
    Tensor y, rstd;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      std::tie(y, rstd) = forward_op().call(x, weight, eps);
    }
    ctx->save_for_backward({x, weight, rstd});
    non_differentiable(ctx, {rstd});
    return {y, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op =
        typed_op<Tensor2(const Tensor&, const Tensor&, const Tensor&, const Tensor&)>("gpu_puzzles::rms_norm_backward");
    if (!grads[0].defined()) return {Tensor(), Tensor(), Tensor()};
    const auto s = ctx->get_saved_variables();
    auto [dx, dw] = op.call(grads[0], s[0], s[1], s[2]);
    return {if_needed(ctx, 0, dx), if_needed(ctx, 1, dw), Tensor()};
  }
};

struct FusedRmsFunction : public torch::autograd::Function<FusedRmsFunction> {
  static const auto& forward_op() {
    static const auto handle =
        typed_op<Tensor2(const Tensor&, const Tensor&, const Tensor&, const c10::optional<Tensor>&, double)>(
            "gpu_puzzles::fused_rmsnorm_linear");
    return handle;
  }

  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& norm_weight,
                               const Tensor& linear_weight, const c10::optional<Tensor>& linear_bias, double eps) {
    Tensor y, rstd;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      std::tie(y, rstd) = forward_op().call(x, norm_weight, linear_weight, linear_bias, eps);
    }
    ctx->save_for_backward({x, norm_weight, linear_weight, rstd});
    non_differentiable(ctx, {rstd});
    ctx->saved_data["has_bias"] = linear_bias.has_value();
    return {y, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op =
        typed_op<Tensor4(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool)>(
            "gpu_puzzles::fused_rmsnorm_linear_backward");
    if (!grads[0].defined()) return variable_list(5);
    const auto s = ctx->get_saved_variables();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    auto [dx, dnw, dW, db] = op.call(grads[0], s[0], s[1], s[2], s[3], has_bias);
    return {if_needed(ctx, 0, dx), if_needed(ctx, 1, dnw), if_needed(ctx, 2, dW),
            has_bias ? if_needed(ctx, 3, db) : Tensor(), Tensor()};
  }
};

// ---- the backward ops ------------------------------------------------------------
// layer_norm_backward and rms_norm_backward differentiated again (create_graph=True) run as
// ATen math, which autograd differentiates; otherwise our kernels, below autograd. mean and
// rstd are the forward's non-differentiable outputs: the math takes their values and puts
// their dependence on x back (straight through: value + (f(x) - f(x).detach()), with f's
// first derivative), so the second derivative sees it. Half inputs in float32.

// mean (or 0 for RMS) and rstd as (..., 1), x-dependent to first order.
std::tuple<Tensor, Tensor> stats_through(const Tensor& xf, const Tensor& mean, const Tensor& rstd, bool rms) {
  const Tensor mu_c = rms ? Tensor() : xf.mean(-1, true);
  const Tensor var_c = rms ? xf.pow(2).mean(-1, true) : (xf - mu_c).pow(2).mean(-1, true);
  Tensor rs = rstd.to(xf.scalar_type()).unsqueeze(-1);
  rs = rs - 0.5 * rs.pow(3) * (var_c - var_c.detach());  // d rstd / d var = -rstd^3 / 2
  Tensor mu = rms ? at::zeros_like(rs) : mean.to(xf.scalar_type()).unsqueeze(-1) + (mu_c - mu_c.detach());
  return {mu, rs};
}

// (dx, dgamma, dbeta) of a LayerNorm (rms: without the mean and beta; dbeta undefined).
Tensor3 norm_backward_math(const Tensor& g, const Tensor& x, const Tensor& w, const Tensor& mean, const Tensor& rstd,
                           bool rms) {
  const auto acc = acc_type(x.scalar_type());
  const int64_t H = x.size(-1);
  const Tensor xf = x.to(acc), gf = g.to(acc), wf = w.to(acc);
  auto [mu, rs] = stats_through(xf, mean, rstd, rms);
  const Tensor xhat = (xf - mu) * rs, dxhat = gf * wf;
  const Tensor proj = xhat * (dxhat * xhat).mean(-1, true);
  const Tensor dx = rs * (rms ? dxhat - proj : dxhat - dxhat.mean(-1, true) - proj);
  const Tensor dw = (gf * xhat).reshape({-1, H}).sum(0);
  const Tensor db = rms ? Tensor() : gf.reshape({-1, H}).sum(0).to(w.scalar_type());
  return {dx.to(x.scalar_type()), dw.to(w.scalar_type()), db};
}

Tensor3 layer_norm_backward_autograd(const Tensor& g, const Tensor& x, const Tensor& w, const Tensor& mean,
                                     const Tensor& rstd) {
  static const auto op = typed_op<Tensor3(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&)>(
      "gpu_puzzles::layer_norm_backward");
  if (differentiated(g, x, w)) return norm_backward_math(g, x, w, mean, rstd, false);
  return below_autograd([&] { return op.call(g, x, w, mean, rstd); });
}

Tensor2 rms_norm_backward_autograd(const Tensor& g, const Tensor& x, const Tensor& w, const Tensor& rstd) {
  static const auto op =
      typed_op<Tensor2(const Tensor&, const Tensor&, const Tensor&, const Tensor&)>("gpu_puzzles::rms_norm_backward");
  if (differentiated(g, x, w)) {
    auto [dx, dw, unused] = norm_backward_math(g, x, w, Tensor(), rstd, true);
    return {dx, dw};
  }
  return below_autograd([&] { return op.call(g, x, w, rstd); });
}

// The fused ops' backwards have no derivative here: differentiated again they raise, naming
// the op. fused_layernorm_linear_naive (the curriculum's kernel) is forward only.
Tensor5 fused_backward_autograd(const Tensor& g, const Tensor& x, const Tensor& lw, const Tensor& lb, const Tensor& W,
                                const Tensor& mean, const Tensor& rstd) {
  static const auto op =
      typed_op<Tensor5(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                       const Tensor&)>("gpu_puzzles::fused_layernorm_linear_backward");
  return no_double_backward("fused_layernorm_linear_backward",
                            below_autograd([&] { return op.call(g, x, lw, lb, W, mean, rstd); }), g, x, lw, lb, W);
}

Tensor4 fused_rms_backward_autograd(const Tensor& g, const Tensor& x, const Tensor& nw, const Tensor& W,
                                    const Tensor& rstd, bool has_bias) {
  static const auto op =
      typed_op<Tensor4(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool)>(
          "gpu_puzzles::fused_rmsnorm_linear_backward");
  return no_double_backward("fused_rmsnorm_linear_backward",
                            below_autograd([&] { return op.call(g, x, nw, W, rstd, has_bias); }), g, x, nw, W);
}

Tensor naive_autograd(const Tensor& x, const Tensor& lw, const Tensor& lb, const Tensor& W,
                      const c10::optional<Tensor>& b, double eps) {
  static const auto op =
      typed_op<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const c10::optional<Tensor>&,
                      double)>("gpu_puzzles::fused_layernorm_linear_naive");
  const Tensor y = below_autograd([&] { return op.call(x, lw, lb, W, b, eps); });
  if (differentiated(x, lw, lb, W, b))
    error_on_backward(
        "gpu_puzzles::fused_layernorm_linear_naive: the curriculum's kernel is forward only; use "
        "fused_layernorm_linear for gradients",
        torch::autograd::collect_next_edges(x, lw, lb, W, b), {y});
  return y;
}

Tensor2 rms_norm_autograd(const Tensor& x, const Tensor& weight, double eps) {
  using F = RmsNormFunction;
  if (!needs_autograd(x, weight)) return below_autograd([&] { return F::forward_op().call(x, weight, eps); });
  auto r = F::apply(x, weight, eps);
  return {r[0], r[1]};
}

Tensor2 fused_rms_autograd(const Tensor& x, const Tensor& norm_weight, const Tensor& linear_weight,
                           const c10::optional<Tensor>& linear_bias, double eps) {
  using F = FusedRmsFunction;
  if (!needs_autograd(x, norm_weight, linear_weight, linear_bias))
    return below_autograd([&] { return F::forward_op().call(x, norm_weight, linear_weight, linear_bias, eps); });
  auto r = F::apply(x, norm_weight, linear_weight, linear_bias, eps);
  return {r[0], r[1]};
}

Tensor3 layer_norm_autograd(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  using F = LayerNormFunction;
  if (!needs_autograd(x, weight, bias))
    return below_autograd([&] { return F::forward_op().call(x, weight, bias, eps); });
  auto r = F::apply(x, weight, bias, eps);
  return {r[0], r[1], r[2]};
}

Tensor3 fused_autograd(const Tensor& x, const Tensor& ln_weight, const Tensor& ln_bias, const Tensor& linear_weight,
                       const c10::optional<Tensor>& linear_bias, double eps) {
  using F = FusedFunction;
  if (!needs_autograd(x, ln_weight, ln_bias, linear_weight, linear_bias))
    return below_autograd([&] { return F::forward_op().call(x, ln_weight, ln_bias, linear_weight, linear_bias, eps); });
  auto r = F::apply(x, ln_weight, ln_bias, linear_weight, linear_bias, eps);
  return {r[0], r[1], r[2]};
}

}  // namespace

TORCH_LIBRARY_IMPL(gpu_puzzles, Autograd, m) {
  m.impl("layer_norm", &layer_norm_autograd);
  m.impl("fused_layernorm_linear", &fused_autograd);
  m.impl("rms_norm", &rms_norm_autograd);
  m.impl("fused_rmsnorm_linear", &fused_rms_autograd);
  m.impl("layer_norm_backward", &layer_norm_backward_autograd);
  m.impl("rms_norm_backward", &rms_norm_backward_autograd);
  m.impl("fused_layernorm_linear_backward", &fused_backward_autograd);
  m.impl("fused_rmsnorm_linear_backward", &fused_rms_backward_autograd);
  m.impl("fused_layernorm_linear_naive", &naive_autograd);
}

}  // namespace gpu_puzzles
