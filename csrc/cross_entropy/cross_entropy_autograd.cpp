// Autograd for cross_entropy and fused_linear_cross_entropy (why in C++: common/autograd.h).
// cross_entropy keeps the logits, target and per-row lse; its backward is one pass over
// the logits. fused_linear_cross_entropy computes its gradients in the forward (the
// logits exist only chunk by chunk there), for a loss of 1; the backward scales them.
#include <algorithm>
#include <array>
#include <string>

#include <ATen/core/grad_mode.h>

#include "common/autograd.h"
#include "common/checks.h"

namespace gpu_puzzles {
namespace {

using Tensor = at::Tensor;
using Tensor2 = std::tuple<Tensor, Tensor>;
using Tensor4 = std::tuple<Tensor, Tensor, Tensor, Tensor>;

using OptCap = c10::optional<double>;
using BackwardSig = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t, c10::string_view,
                           OptCap);

using ForwardSig = Tensor2(const Tensor&, const Tensor&, int64_t, c10::string_view, c10::optional<at::ScalarType>,
                           OptCap);
const c10::TypedOperatorHandle<ForwardSig>& forward_op() {
  static const auto op = typed_op<ForwardSig>("gpu_puzzles::cross_entropy");
  return op;
}

struct CrossEntropyFunction : public torch::autograd::Function<CrossEntropyFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& logits, const Tensor& target, int64_t ignore_index,
                               c10::string_view reduction, c10::optional<at::ScalarType> loss_dtype, OptCap softcap) {
    auto [loss, lse] =
        below_autograd([&] { return forward_op().call(logits, target, ignore_index, reduction, loss_dtype, softcap); });
    ctx->save_for_backward({logits, target, lse});
    non_differentiable(ctx, {lse});
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["reduction"] = std::string(reduction);
    ctx->saved_data["softcap"] = softcap.value_or(0.0);
    return {loss, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op = typed_op<BackwardSig>("gpu_puzzles::cross_entropy_backward");
    if (!grads[0].defined() || !ctx->needs_input_grad(0)) return variable_list(6);
    const auto s = ctx->get_saved_variables();
    const std::string reduction = ctx->saved_data["reduction"].toStringRef();
    const double cap = ctx->saved_data["softcap"].toDouble();
    const Tensor g = op.call(grads[0], s[0], s[1], s[2], ctx->saved_data["ignore_index"].toInt(), reduction,
                             cap > 0 ? OptCap(cap) : OptCap());
    return {g, Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

using FusedSig = Tensor4(const Tensor&, const Tensor&, const Tensor&, const c10::optional<Tensor>&, int64_t,
                         c10::string_view, std::array<bool, 3>, c10::optional<at::ScalarType>, OptCap);

const c10::TypedOperatorHandle<FusedSig>& fused_op() {
  static const auto op = typed_op<FusedSig>("gpu_puzzles::fused_linear_cross_entropy");
  return op;
}

struct FusedLinearCeFunction : public torch::autograd::Function<FusedLinearCeFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& hidden, const Tensor& weight, const Tensor& target,
                               const c10::optional<Tensor>& bias, int64_t ignore_index, c10::string_view reduction,
                               bool need_h, bool need_w, bool need_b, c10::optional<at::ScalarType> loss_dtype,
                               OptCap softcap) {
    auto [loss, gh, gw, gb] = below_autograd([&] {
      return fused_op().call(hidden, weight, target, bias, ignore_index, reduction,
                             std::array<bool, 3>{need_h, need_w, need_b}, loss_dtype, softcap);
    });
    ctx->save_for_backward({gh, gw, gb});
    non_differentiable(ctx, {gh, gw, gb});
    ctx->saved_data["need_h"] = need_h;
    ctx->saved_data["need_w"] = need_w;
    ctx->saved_data["need_b"] = need_b;
    return {loss, gh, gw, gb};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list out(11);
    if (!grads[0].defined()) return out;
    const auto s = ctx->get_saved_variables();
    // The saved gradients came from the forward, so differentiating these again would miss
    // their dependence on hidden and weight: under create_graph=True they are computed as
    // always and marked so that differentiating them raises, naming the op.
    const bool create_graph = at::GradMode::is_enabled();
    at::NoGradGuard no_grad;
    const bool mask[3] = {ctx->saved_data["need_h"].toBool(), ctx->saved_data["need_w"].toBool(),
                          ctx->saved_data["need_b"].toBool()};
    // The saved gradients are those of a loss of 1: scale by grad_loss (0-d).
    const int slot[3] = {0, 1, 3};
    for (int i = 0; i < 3; ++i)
      if (mask[i] && ctx->needs_input_grad(slot[i])) out[slot[i]] = scaled(s[i], grads[0]);
    if (create_graph)
      error_on_backward(
          "gpu_puzzles::fused_linear_cross_entropy: double backward (create_graph=True, then "
          "differentiating the gradients) is not supported: its gradients are computed in the "
          "forward; cross_entropy(F.linear(hidden, weight, bias), target) supports it",
          torch::autograd::collect_next_edges(grads[0]), {out[0], out[1], out[3]});
    return out;
  }

  // g * grad_loss in float, written in g's dtype. A float32 grad_loss (autocast's loss)
  // cast to g's half dtype first would be rounded (bf16) or overflow (fp16: GradScaler's
  // first scale, 65536, is inf there). Slices keep the float temporary small.
  static Tensor scaled(const Tensor& g, const Tensor& grad_loss) {
    const auto dt = g.scalar_type();
    if (dt != at::kHalf && dt != at::kBFloat16) return g.mul(grad_loss.to(dt));
    const Tensor scale = grad_loss.to(at::kFloat);
    Tensor out = at::empty(g.sizes(), g.options());
    const Tensor src = g.contiguous().view({-1}), dst = out.view({-1});
    const int64_t n = src.numel(), step = int64_t(1) << 24;
    for (int64_t i = 0; i < n; i += step) {
      const int64_t len = std::min(step, n - i);
      Tensor d = dst.narrow(0, i, len);
      at::mul_out(d, src.narrow(0, i, len).to(at::kFloat), scale);
    }
    return out;
  }
};

Tensor4 fused_autograd(const Tensor& hidden, const Tensor& weight, const Tensor& target,
                       const c10::optional<Tensor>& bias, int64_t ignore_index, c10::string_view reduction,
                       std::array<bool, 3> output_mask, c10::optional<at::ScalarType> loss_dtype, OptCap softcap) {
  // Nothing to differentiate: the gradients the caller asked for (output_mask) only.
  if (!needs_autograd(hidden, weight, bias))
    return below_autograd([&] {
      return fused_op().call(hidden, weight, target, bias, ignore_index, reduction, output_mask, loss_dtype, softcap);
    });
  // Gradients only where autograd will ask for them (or the caller did).
  const bool grad = at::GradMode::is_enabled();
  const bool has_bias = bias.has_value() && bias->defined();
  const bool need_h = output_mask[0] || (grad && hidden.requires_grad());
  const bool need_w = output_mask[1] || (grad && weight.requires_grad());
  const bool need_b = output_mask[2] || (grad && has_bias && bias->requires_grad());
  auto r = FusedLinearCeFunction::apply(hidden, weight, target, bias, ignore_index, reduction, need_h, need_w, need_b,
                                        loss_dtype, softcap);
  return {r[0], r[1], r[2], r[3]};
}

// The backward op. Differentiated again (create_graph=True) it runs as ATen math, which
// autograd differentiates: (softmax(z) - onehot(target)) * scale * dz/dx, z the (soft-capped)
// logits, the saved lse with its dependence on them put back (straight through); otherwise
// our kernel, below autograd.
Tensor cross_entropy_backward_autograd(const Tensor& grad_loss, const Tensor& logits, const Tensor& target,
                                       const Tensor& lse, int64_t ignore_index, c10::string_view reduction,
                                       OptCap softcap) {
  static const auto op = typed_op<BackwardSig>("gpu_puzzles::cross_entropy_backward");
  if (!differentiated(grad_loss, logits))
    return below_autograd([&] { return op.call(grad_loss, logits, target, lse, ignore_index, reduction, softcap); });
  const auto acc = acc_type(logits.scalar_type());
  const int64_t V = logits.size(-1);
  const bool capped = softcap.has_value();
  const Tensor th = capped ? logits.to(acc).div(*softcap).tanh() : Tensor();
  const Tensor lf = capped ? th.mul(*softcap) : logits.to(acc);
  const Tensor lse_c = lf.logsumexp(-1);
  const Tensor lse_d = lse.to(acc) + (lse_c - lse_c.detach());
  const Tensor valid = target.ne(ignore_index);
  // As the kernels: a target outside [0, V) has no one-hot term (the CPU forward refuses one).
  const Tensor hit = valid.logical_and(target.ge(0)).logical_and(target.lt(V));
  const Tensor onehot = at::one_hot(at::where(hit, target, 0).to(at::kLong), V).to(acc) * hit.unsqueeze(-1);
  Tensor scale = grad_loss.to(acc);
  if (reduction == c10::string_view("mean")) scale = scale / valid.sum().to(acc);
  scale = at::where(valid, scale, at::zeros({}, scale.options()));
  Tensor g = ((lf - lse_d.unsqueeze(-1)).exp() - onehot).mul(scale.unsqueeze(-1));
  if (capped) g = g.mul(1 - th.square());
  return g.to(logits.scalar_type());
}

Tensor2 cross_entropy_autograd(const Tensor& logits, const Tensor& target, int64_t ignore_index,
                               c10::string_view reduction, c10::optional<at::ScalarType> loss_dtype, OptCap softcap) {
  if (!needs_autograd(logits))
    return below_autograd(
        [&] { return forward_op().call(logits, target, ignore_index, reduction, loss_dtype, softcap); });
  auto r = CrossEntropyFunction::apply(logits, target, ignore_index, reduction, loss_dtype, softcap);
  return {r[0], r[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(gpu_puzzles, Autograd, m) {
  m.impl("cross_entropy", &cross_entropy_autograd);
  m.impl("fused_linear_cross_entropy", &fused_autograd);
  m.impl("cross_entropy_backward", &cross_entropy_backward_autograd);
}

}  // namespace gpu_puzzles
