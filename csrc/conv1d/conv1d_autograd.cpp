// Autograd for conv1d (why in C++: common/autograd.h).
#include <string>

#include "common/autograd.h"

namespace gpu_puzzles {
namespace {

using Tensor = at::Tensor;
using ForwardSig = Tensor(const Tensor&, const Tensor&, const c10::optional<Tensor>&, bool, c10::string_view);
using BackwardSig = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, bool,
                                                       c10::string_view);

const c10::TypedOperatorHandle<ForwardSig>& forward_op() {
  static const auto op = typed_op<ForwardSig>("gpu_puzzles::conv1d");
  return op;
}

struct Conv1dFunction : public torch::autograd::Function<Conv1dFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, const c10::optional<Tensor>& bias,
                        bool causal, c10::string_view algorithm) {
    ctx->save_for_backward({x, weight});
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["algorithm"] = std::string(algorithm);
    // The bias gradient comes back as (C,); a 0-d bias (1-D x) wants it 0-d.
    ctx->saved_data["bias_dim"] = bias.has_value() ? bias->dim() : int64_t(-1);
    at::AutoDispatchBelowADInplaceOrView guard;
    return forward_op().call(x, weight, bias, causal, algorithm);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op = typed_op<BackwardSig>("gpu_puzzles::conv1d_backward");
    const auto saved = ctx->get_saved_variables();
    const std::string algorithm = ctx->saved_data["algorithm"].toStringRef();
    auto [dx, dw, db] = op.call(grads[0], saved[0], saved[1], ctx->saved_data["causal"].toBool(), algorithm);
    const int64_t bias_dim = ctx->saved_data["bias_dim"].toInt();
    if (bias_dim == 0) db = db.reshape({});
    return {if_needed(ctx, 0, dx), if_needed(ctx, 1, dw), bias_dim >= 0 ? if_needed(ctx, 2, db) : Tensor(), Tensor(),
            Tensor()};
  }
};

Tensor conv1d_autograd(const Tensor& x, const Tensor& weight, const c10::optional<Tensor>& bias, bool causal,
                       c10::string_view algorithm) {
  if (!needs_autograd(x, weight, bias))
    return below_autograd([&] { return forward_op().call(x, weight, bias, causal, algorithm); });
  return Conv1dFunction::apply(x, weight, bias, causal, algorithm);
}

// The backward op: no derivative of its own (differentiated again, it raises naming the op).
std::tuple<Tensor, Tensor, Tensor> conv1d_backward_autograd(const Tensor& g, const Tensor& x, const Tensor& w,
                                                            bool causal, c10::string_view algorithm) {
  static const auto op = typed_op<BackwardSig>("gpu_puzzles::conv1d_backward");
  return no_double_backward("conv1d_backward", below_autograd([&] { return op.call(g, x, w, causal, algorithm); }), g,
                            x, w);
}

}  // namespace

TORCH_LIBRARY_IMPL(gpu_puzzles, Autograd, m) {
  m.impl("conv1d", &conv1d_autograd);
  m.impl("conv1d_backward", &conv1d_backward_autograd);
}

}  // namespace gpu_puzzles
