// Autograd for embedding and embedding_2d (why in C++: common/autograd.h).
#include <string>

#include "common/autograd.h"

namespace gpu_puzzles {
namespace {

using ForwardSig = at::Tensor(const at::Tensor&, const at::Tensor&, c10::optional<int64_t>);
using BackwardSig = at::Tensor(const at::Tensor&, const at::Tensor&, c10::SymInt, c10::optional<int64_t>, bool);

template <bool TwoD>
struct EmbeddingFunction : public torch::autograd::Function<EmbeddingFunction<TwoD>> {
  static constexpr const char* kName = TwoD ? "gpu_puzzles::embedding_2d" : "gpu_puzzles::embedding";

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& indices, const at::Tensor& weight,
                            c10::optional<int64_t> padding_idx) {
    static const auto op = typed_op<ForwardSig>(kName);
    ctx->save_for_backward({indices});
    ctx->saved_data["num_weights"] = weight.sym_size(0);
    ctx->saved_data["padding_idx"] = padding_idx;
    at::AutoDispatchBelowADInplaceOrView guard;
    return op.call(indices, weight, padding_idx);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op = typed_op<BackwardSig>((std::string(kName) + "_backward").c_str());
    if (!ctx->needs_input_grad(1)) return {at::Tensor(), at::Tensor(), at::Tensor()};
    const at::Tensor indices = ctx->get_saved_variables()[0];
    const c10::SymInt V = ctx->saved_data["num_weights"].toSymInt();
    const c10::optional<int64_t> pad = ctx->saved_data["padding_idx"].toOptional<int64_t>();
    const at::Tensor gw = op.call(grads[0], indices, V, pad, at::globalContext().deterministicAlgorithms());
    return {at::Tensor(), gw, at::Tensor()};
  }
};

at::Tensor embedding_autograd(const at::Tensor& indices, const at::Tensor& weight,
                              c10::optional<int64_t> padding_idx) {
  return EmbeddingFunction<false>::apply(indices, weight, padding_idx);
}
at::Tensor embedding_2d_autograd(const at::Tensor& indices, const at::Tensor& weight,
                                 c10::optional<int64_t> padding_idx) {
  return EmbeddingFunction<true>::apply(indices, weight, padding_idx);
}

}  // namespace

TORCH_LIBRARY_IMPL(gpu_puzzles, Autograd, m) {
  m.impl("embedding", &embedding_autograd);
  m.impl("embedding_2d", &embedding_2d_autograd);
}

}  // namespace gpu_puzzles
