// Autograd for attention and the chain's transpose_last2 / matmul (why in C++:
// common/autograd.h).
#include "common/autograd.h"

namespace gpu_puzzles {
namespace {

using Tensor = at::Tensor;
using Tensor2 = std::tuple<Tensor, Tensor>;
using Tensor3 = std::tuple<Tensor, Tensor, Tensor>;

using ForwardSig = Tensor2(const Tensor&, const Tensor&, const Tensor&, c10::optional<double>, bool, bool);
const c10::TypedOperatorHandle<ForwardSig>& forward_op() {
  static const auto op = typed_op<ForwardSig>("gpu_puzzles::attention");
  return op;
}

struct AttentionFunction : public torch::autograd::Function<AttentionFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                               c10::optional<double> scale, bool causal, bool enable_gqa) {
    auto [out, lse] = below_autograd([&] { return forward_op().call(q, k, v, scale, causal, enable_gqa); });
    // The backward recomputes the probabilities from lse: nothing S x S is kept.
    ctx->save_for_backward({q, k, v, out, lse});
    non_differentiable(ctx, {lse});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["enable_gqa"] = enable_gqa;
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op =
        typed_op<Tensor3(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                         c10::optional<double>, bool, bool)>("gpu_puzzles::attention_backward");
    if (!grads[0].defined()) return variable_list(6);
    const auto s = ctx->get_saved_variables();
    auto [dq, dk, dv] = op.call(grads[0], s[0], s[1], s[2], s[3], s[4], ctx->saved_data["scale"].toOptional<double>(),
                                ctx->saved_data["causal"].toBool(), ctx->saved_data["enable_gqa"].toBool());
    return {if_needed(ctx, 0, dq), if_needed(ctx, 1, dk), if_needed(ctx, 2, dv), Tensor(), Tensor(), Tensor()};
  }
};

const c10::TypedOperatorHandle<Tensor(const Tensor&)>& transpose_op() {
  static const auto op = typed_op<Tensor(const Tensor&)>("gpu_puzzles::transpose_last2");
  return op;
}
const c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, double, bool)>& matmul_op() {
  static const auto op = typed_op<Tensor(const Tensor&, const Tensor&, double, bool)>("gpu_puzzles::matmul");
  return op;
}

struct TransposeFunction : public torch::autograd::Function<TransposeFunction> {
  static Tensor forward(AutogradContext*, const Tensor& x) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return transpose_op().call(x);
  }
  static variable_list backward(AutogradContext*, variable_list grads) {
    return {transpose_op().call(grads[0])};  // through the dispatcher: differentiable again
  }
};

struct MatmulFunction : public torch::autograd::Function<MatmulFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& a, const Tensor& b, double alpha, bool causal_mask) {
    ctx->save_for_backward({a, b});
    ctx->saved_data["alpha"] = alpha;
    ctx->saved_data["causal_mask"] = causal_mask;
    at::AutoDispatchBelowADInplaceOrView guard;
    return matmul_op().call(a, b, alpha, causal_mask);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const double alpha = ctx->saved_data["alpha"].toDouble();
    Tensor g = grads[0];
    if (ctx->saved_data["causal_mask"].toBool()) {
      // The masked entries are constants (-inf): no gradient flows through them.
      const Tensor mask = at::ones_symint({g.sym_size(-2), g.sym_size(-1)}, g.options().dtype(at::kBool)).triu(1);
      g = g.masked_fill(mask, 0);
    }
    Tensor da, db;
    if (ctx->needs_input_grad(0)) da = matmul_op().call(g, transpose_op().call(s[1]), alpha, false);
    if (ctx->needs_input_grad(1)) db = matmul_op().call(transpose_op().call(s[0]), g, alpha, false);
    return {da, db, Tensor(), Tensor()};
  }
};

Tensor2 attention_autograd(const Tensor& q, const Tensor& k, const Tensor& v, c10::optional<double> scale, bool causal,
                           bool enable_gqa) {
  if (!needs_autograd(q, k, v))
    return below_autograd([&] { return forward_op().call(q, k, v, scale, causal, enable_gqa); });
  auto r = AttentionFunction::apply(q, k, v, scale, causal, enable_gqa);
  return {r[0], r[1]};
}
// The backward op: no derivative of its own (differentiated again, it raises naming the op).
Tensor3 attention_backward_autograd(const Tensor& g, const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Tensor& out, const Tensor& lse, c10::optional<double> scale, bool causal,
                                    bool enable_gqa) {
  static const auto op =
      typed_op<Tensor3(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                       c10::optional<double>, bool, bool)>("gpu_puzzles::attention_backward");
  return no_double_backward("attention_backward",
                            below_autograd([&] { return op.call(g, q, k, v, out, lse, scale, causal, enable_gqa); }), g,
                            q, k, v, out);
}
Tensor transpose_autograd(const Tensor& x) { return TransposeFunction::apply(x); }
Tensor matmul_autograd(const Tensor& a, const Tensor& b, double alpha, bool causal_mask) {
  return MatmulFunction::apply(a, b, alpha, causal_mask);
}

}  // namespace

TORCH_LIBRARY_IMPL(gpu_puzzles, Autograd, m) {
  m.impl("attention", &attention_autograd);
  m.impl("attention_backward", &attention_backward_autograd);
  m.impl("transpose_last2", &transpose_autograd);
  m.impl("matmul", &matmul_autograd);
}

}  // namespace gpu_puzzles
