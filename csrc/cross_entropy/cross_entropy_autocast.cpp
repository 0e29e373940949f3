// cross_entropy and fused_linear_cross_entropy under torch.autocast (common/autocast.h).
// The loss is float32, as F.cross_entropy's under autocast (log_softmax and nll_loss are on
// PyTorch's float32 list), but the logits are read in their own dtype, never copied to
// float32 (the kernels' math is float32 anyway). The fused op's GEMMs run in the autocast
// dtype, as F.linear's would.
#include "common/autocast.h"
#include "common/autograd.h"

namespace gpu_puzzles {
namespace {

using Tensor = at::Tensor;
using Tensor2 = std::tuple<Tensor, Tensor>;
using Tensor4 = std::tuple<Tensor, Tensor, Tensor, Tensor>;
using OptType = c10::optional<at::ScalarType>;
using OptCap = c10::optional<double>;

template <c10::DeviceType D>
Tensor2 cross_entropy_autocast(const Tensor& logits, const Tensor& target, int64_t ignore_index,
                               c10::string_view reduction, OptType loss_dtype, OptCap softcap) {
  static const auto op = typed_op<Tensor2(const Tensor&, const Tensor&, int64_t, c10::string_view, OptType, OptCap)>(
      "gpu_puzzles::cross_entropy");
  const OptType out = loss_dtype.has_value() || !autocast::eligible<D>(logits) ? loss_dtype : OptType(at::kFloat);
  autocast::Below<D> below;
  return op.call(logits, target, ignore_index, reduction, out, softcap);
}

template <c10::DeviceType D>
Tensor4 fused_linear_cross_entropy_autocast(const Tensor& hidden, const Tensor& weight, const Tensor& target,
                                            const c10::optional<Tensor>& bias, int64_t ignore_index,
                                            c10::string_view reduction, std::array<bool, 3> output_mask,
                                            OptType loss_dtype, OptCap softcap) {
  static const auto op = typed_op<Tensor4(const Tensor&, const Tensor&, const Tensor&, const c10::optional<Tensor>&,
                                          int64_t, c10::string_view, std::array<bool, 3>, OptType, OptCap)>(
      "gpu_puzzles::fused_linear_cross_entropy");
  const OptType out = loss_dtype.has_value() || !autocast::eligible<D>(hidden) ? loss_dtype : OptType(at::kFloat);
  const auto to = autocast::lower<D>();
  autocast::Below<D> below;
  return op.call(autocast::cast<D>(to, hidden), autocast::cast<D>(to, weight), target, autocast::cast<D>(to, bias),
                 ignore_index, reduction, output_mask, out, softcap);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gpu_puzzles, m) {
  GP_AUTOCAST(m, "cross_entropy", cross_entropy_autocast);
  GP_AUTOCAST(m, "fused_linear_cross_entropy", fused_linear_cross_entropy_autocast);
}

}  // namespace gpu_puzzles
