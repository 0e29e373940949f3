// conv1d under torch.autocast: in the autocast dtype on both devices, as F.conv1d
// (common/autocast.h).
#include "common/autocast.h"
#include "common/autograd.h"

namespace gpu_puzzles {
namespace {

using Tensor = at::Tensor;

template <c10::DeviceType D>
Tensor conv1d_autocast(const Tensor& x, const Tensor& weight, const c10::optional<Tensor>& bias, bool causal,
                       c10::string_view algorithm) {
  static const auto op =
      typed_op<Tensor(const Tensor&, const Tensor&, const c10::optional<Tensor>&, bool, c10::string_view)>(
          "gpu_puzzles::conv1d");
  const auto to = autocast::lower<D>();
  autocast::Below<D> below;
  return op.call(autocast::cast<D>(to, x), autocast::cast<D>(to, weight), autocast::cast<D>(to, bias), causal,
                 algorithm);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gpu_puzzles, m) { GP_AUTOCAST(m, "conv1d", conv1d_autocast); }

}  // namespace gpu_puzzles
