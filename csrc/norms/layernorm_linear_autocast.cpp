// The norms and the fused Norm+Linear ops under torch.autocast (common/autocast.h).
// - layer_norm: float32 on CUDA (PyTorch's float32 list); on the CPU, where PyTorch has no
//   rule for it, as given. rms_norm has no rule on either (as F.rms_norm): no kernel here.
// - fused_layernorm_linear / fused_rmsnorm_linear: the linear in the autocast dtype, as
//   F.linear; the norm in x's own dtype (float32 statistics either way), so a float32
//   residual stream is normalised in float32, as stock's norm under autocast, and only the
//   normalised activation meets the GEMM in the autocast dtype. The norm's weights follow
//   x's dtype. The op takes that mix itself (layernorm_linear.cpp).
// - fused_layernorm_linear_naive (the curriculum's kernel, one dtype): all in the autocast dtype.
#include "common/autocast.h"
#include "common/autograd.h"

namespace gpu_puzzles {
namespace {

using Tensor = at::Tensor;
using Tensor2 = std::tuple<Tensor, Tensor>;
using Tensor3 = std::tuple<Tensor, Tensor, Tensor>;
using OptTensor = c10::optional<Tensor>;

Tensor3 layer_norm_autocast(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  constexpr auto D = c10::DeviceType::CUDA;
  static const auto op =
      typed_op<Tensor3(const Tensor&, const Tensor&, const Tensor&, double)>("gpu_puzzles::layer_norm");
  autocast::Below<D> below;
  return op.call(autocast::cast<D>(at::kFloat, x), autocast::cast<D>(at::kFloat, weight),
                 autocast::cast<D>(at::kFloat, bias), eps);
}

// The dtype the norm runs in: x's, unless x is a half type other than the autocast dtype
// (fp16 activations under bf16 autocast), which is cast to the autocast dtype.
template <c10::DeviceType D>
at::ScalarType norm_type(const Tensor& x) {
  const auto t = x.scalar_type();
  return t == at::kFloat || t == autocast::lower<D>() ? t : autocast::lower<D>();
}

template <c10::DeviceType D>
Tensor3 fused_layernorm_linear_autocast(const Tensor& x, const Tensor& ln_weight, const Tensor& ln_bias,
                                        const Tensor& linear_weight, const OptTensor& linear_bias, double eps) {
  static const auto op =
      typed_op<Tensor3(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const OptTensor&, double)>(
          "gpu_puzzles::fused_layernorm_linear");
  autocast::Below<D> below;
  if (!autocast::eligible<D>(x)) return op.call(x, ln_weight, ln_bias, linear_weight, linear_bias, eps);
  const auto nt = norm_type<D>(x), to = autocast::lower<D>();
  return op.call(autocast::cast<D>(nt, x), autocast::cast<D>(nt, ln_weight), autocast::cast<D>(nt, ln_bias),
                 autocast::cast<D>(to, linear_weight), autocast::cast<D>(to, linear_bias), eps);
}

template <c10::DeviceType D>
Tensor2 fused_rmsnorm_linear_autocast(const Tensor& x, const Tensor& norm_weight, const Tensor& linear_weight,
                                      const OptTensor& linear_bias, double eps) {
  static const auto op = typed_op<Tensor2(const Tensor&, const Tensor&, const Tensor&, const OptTensor&, double)>(
      "gpu_puzzles::fused_rmsnorm_linear");
  autocast::Below<D> below;
  if (!autocast::eligible<D>(x)) return op.call(x, norm_weight, linear_weight, linear_bias, eps);
  const auto nt = norm_type<D>(x), to = autocast::lower<D>();
  return op.call(autocast::cast<D>(nt, x), autocast::cast<D>(nt, norm_weight), autocast::cast<D>(to, linear_weight),
                 autocast::cast<D>(to, linear_bias), eps);
}

template <c10::DeviceType D>
Tensor fused_layernorm_linear_naive_autocast(const Tensor& x, const Tensor& ln_weight, const Tensor& ln_bias,
                                             const Tensor& linear_weight, const OptTensor& linear_bias, double eps) {
  static const auto op =
      typed_op<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const OptTensor&, double)>(
          "gpu_puzzles::fused_layernorm_linear_naive");
  const auto to = autocast::lower<D>();
  autocast::Below<D> below;
  return op.call(autocast::cast<D>(to, x), autocast::cast<D>(to, ln_weight), autocast::cast<D>(to, ln_bias),
                 autocast::cast<D>(to, linear_weight), autocast::cast<D>(to, linear_bias), eps);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gpu_puzzles, m) {
  m.impl("layer_norm", torch::dispatch(c10::DispatchKey::AutocastCUDA, &layer_norm_autocast));
  GP_AUTOCAST(m, "fused_layernorm_linear", fused_layernorm_linear_autocast);
  GP_AUTOCAST(m, "fused_rmsnorm_linear", fused_rmsnorm_linear_autocast);
  GP_AUTOCAST(m, "fused_layernorm_linear_naive", fused_layernorm_linear_naive_autocast);
}

}  // namespace gpu_puzzles
