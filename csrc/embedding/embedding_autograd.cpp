// Autograd for embedding (why in C++: common/autograd.h).
#include <string>

#include "common/autograd.h"

namespace gpu_puzzles {
namespace {

using ForwardSig = at::Tensor(const at::Tensor&, const at::Tensor&, c10::optional<int64_t>, c10::string_view);
using BackwardSig = at::Tensor(const at::Tensor&, const at::Tensor&, c10::SymInt, c10::optional<int64_t>, bool,
                               c10::string_view);

const c10::TypedOperatorHandle<ForwardSig>& forward_op() {
  static const auto op = typed_op<ForwardSig>("gpu_puzzles::embedding");
  return op;
}

struct EmbeddingFunction : public torch::autograd::Function<EmbeddingFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& indices, const at::Tensor& weight,
                            c10::optional<int64_t> padding_idx, c10::string_view algorithm) {
    ctx->save_for_backward({indices});
    ctx->saved_data["num_weights"] = weight.sym_size(0);
    ctx->saved_data["padding_idx"] = padding_idx;
    ctx->saved_data["algorithm"] = std::string(algorithm);
    at::AutoDispatchBelowADInplaceOrView guard;
    return forward_op().call(indices, weight, padding_idx, algorithm);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op = typed_op<BackwardSig>("gpu_puzzles::embedding_backward");
    if (!ctx->needs_input_grad(1)) return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    const at::Tensor indices = ctx->get_saved_variables()[0];
    const c10::SymInt V = ctx->saved_data["num_weights"].toSymInt();
    const c10::optional<int64_t> pad = ctx->saved_data["padding_idx"].toOptional<int64_t>();
    const std::string algorithm = ctx->saved_data["algorithm"].toStringRef();
    const at::Tensor gw = op.call(grads[0], indices, V, pad, at::globalContext().deterministicAlgorithms(), algorithm);
    return {at::Tensor(), gw, at::Tensor(), at::Tensor()};
  }
};

at::Tensor embedding_autograd(const at::Tensor& indices, const at::Tensor& weight, c10::optional<int64_t> padding_idx,
                              c10::string_view algorithm) {
  if (!needs_autograd(weight))
    return below_autograd([&] { return forward_op().call(indices, weight, padding_idx, algorithm); });
  return EmbeddingFunction::apply(indices, weight, padding_idx, algorithm);
}

// The backward op: no derivative of its own (differentiated again, it raises naming the op).
at::Tensor embedding_backward_autograd(const at::Tensor& g, const at::Tensor& indices, c10::SymInt num_weights,
                                       c10::optional<int64_t> padding_idx, bool deterministic,
                                       c10::string_view algorithm) {
  static const auto op = typed_op<BackwardSig>("gpu_puzzles::embedding_backward");
  return no_double_backward(
      "embedding_backward",
      below_autograd([&] { return op.call(g, indices, num_weights, padding_idx, deterministic, algorithm); }), g);
}

}  // namespace

TORCH_LIBRARY_IMPL(gpu_puzzles, Autograd, m) {
  m.impl("embedding", &embedding_autograd);
  m.impl("embedding_backward", &embedding_backward_autograd);
}

}  // namespace gpu_puzzles
