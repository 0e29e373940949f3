// attention and the chain's matmul under torch.autocast: in the autocast dtype on both
// devices, as F.scaled_dot_product_attention and torch.matmul (common/autocast.h). So q and
// k left in float32 by a rotary embedding meet a bf16 v in bf16, as they do in SDPA.
#include "common/autocast.h"
#include "common/autograd.h"

namespace gpu_puzzles {
namespace {

using Tensor = at::Tensor;
using Tensor2 = std::tuple<Tensor, Tensor>;

template <c10::DeviceType D>
Tensor2 attention_autocast(const Tensor& q, const Tensor& k, const Tensor& v, c10::optional<double> scale, bool causal,
                           bool enable_gqa) {
  static const auto op =
      typed_op<Tensor2(const Tensor&, const Tensor&, const Tensor&, c10::optional<double>, bool, bool)>(
          "gpu_puzzles::attention");
  const auto to = autocast::lower<D>();
  autocast::Below<D> below;
  return op.call(autocast::cast<D>(to, q), autocast::cast<D>(to, k), autocast::cast<D>(to, v), scale, causal,
                 enable_gqa);
}

template <c10::DeviceType D>
Tensor matmul_autocast(const Tensor& a, const Tensor& b, double alpha, bool causal_mask) {
  static const auto op = typed_op<Tensor(const Tensor&, const Tensor&, double, bool)>("gpu_puzzles::matmul");
  const auto to = autocast::lower<D>();
  autocast::Below<D> below;
  return op.call(autocast::cast<D>(to, a), autocast::cast<D>(to, b), alpha, causal_mask);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gpu_puzzles, m) {
  GP_AUTOCAST(m, "attention", attention_autocast);
  GP_AUTOCAST(m, "matmul", matmul_autocast);
}

}  // namespace gpu_puzzles
