// Autograd for softmax and log_softmax (why in C++: common/autograd.h).
#include <string>

#include "common/autograd.h"
#include "common/checks.h"

namespace gpu_puzzles {
namespace {

using Tensor = at::Tensor;
using ForwardSig = Tensor(const Tensor&, int64_t, c10::string_view);

template <bool Log>
struct SoftmaxFunction : public torch::autograd::Function<SoftmaxFunction<Log>> {
  static constexpr const char* kName = Log ? "gpu_puzzles::log_softmax" : "gpu_puzzles::softmax";

  static const c10::TypedOperatorHandle<ForwardSig>& forward_op() {
    static const auto handle = typed_op<ForwardSig>(kName);
    return handle;
  }

  static Tensor forward(AutogradContext* ctx, const Tensor& x, int64_t dim, c10::string_view algorithm) {
    const Tensor y = below_autograd([&] { return forward_op().call(x, dim, algorithm); });
    ctx->save_for_backward({y});  // the output, not the input: all the backward needs
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["algorithm"] = std::string(algorithm);
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // backward(grad_out, out, dim, algorithm) has the forward's signature plus grad_out.
    using BackwardSig = Tensor(const Tensor&, const Tensor&, int64_t, c10::string_view);
    static const auto op = typed_op<BackwardSig>((std::string(kName) + "_backward").c_str());
    const Tensor y = ctx->get_saved_variables()[0];
    const std::string algorithm = ctx->saved_data["algorithm"].toStringRef();
    return {op.call(grads[0], y, ctx->saved_data["dim"].toInt(), algorithm), Tensor(), Tensor()};
  }
};

// The backward ops. Differentiated again (create_graph=True), they run as ATen math, which
// autograd differentiates: softmax's y * (g - sum(g * y)), log_softmax's g - exp(y) * sum(g),
// in float32 for half inputs; otherwise our kernels, below autograd.
template <bool Log>
Tensor softmax_backward_autograd(const Tensor& g, const Tensor& y, int64_t dim, c10::string_view algorithm) {
  using BackwardSig = Tensor(const Tensor&, const Tensor&, int64_t, c10::string_view);
  static const auto op =
      typed_op<BackwardSig>(Log ? "gpu_puzzles::log_softmax_backward" : "gpu_puzzles::softmax_backward");
  if (differentiated(g, y)) {
    const auto acc = acc_type(y.scalar_type());
    const Tensor gf = g.to(acc), yf = y.to(acc);
    const Tensor dx = Log ? gf - yf.exp() * gf.sum(dim, true) : yf * (gf - (gf * yf).sum(dim, true));
    return dx.to(y.scalar_type());
  }
  return below_autograd([&] { return op.call(g, y, dim, algorithm); });
}

template <bool Log>
Tensor softmax_autograd(const Tensor& x, int64_t dim, c10::string_view algorithm) {
  using F = SoftmaxFunction<Log>;
  if (!needs_autograd(x)) return below_autograd([&] { return F::forward_op().call(x, dim, algorithm); });
  return F::apply(x, dim, algorithm);
}

}  // namespace

TORCH_LIBRARY_IMPL(gpu_puzzles, Autograd, m) {
  m.impl("softmax", &softmax_autograd<false>);
  m.impl("log_softmax", &softmax_autograd<true>);
  m.impl("softmax_backward", &softmax_backward_autograd<false>);
  m.impl("log_softmax_backward", &softmax_backward_autograd<true>);
}

}  // namespace gpu_puzzles
