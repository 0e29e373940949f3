// softmax and log_softmax under torch.autocast, as torch.softmax's: on CUDA a half input
// gives a float32 output (PyTorch's float32 list); on the CPU, where PyTorch has no rule
// for them, the op runs in the dtype it is given (common/autocast.h).
// The input is cast to float32 first, as ATen does for bf16; reading it in its own dtype
// and writing float32 would save that pass (not done).
#include "common/autocast.h"
#include "common/autograd.h"

namespace gpu_puzzles {
namespace {

using Tensor = at::Tensor;
using Sig = Tensor(const Tensor&, int64_t, c10::string_view);

template <bool Log>
Tensor softmax_autocast(const Tensor& x, int64_t dim, c10::string_view algorithm) {
  static const auto op = typed_op<Sig>(Log ? "gpu_puzzles::log_softmax" : "gpu_puzzles::softmax");
  autocast::Below<c10::DeviceType::CUDA> below;
  return op.call(autocast::cast<c10::DeviceType::CUDA>(at::kFloat, x), dim, algorithm);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gpu_puzzles, m) {
  m.impl("softmax", torch::dispatch(c10::DispatchKey::AutocastCUDA, &softmax_autocast<false>));
  m.impl("log_softmax", torch::dispatch(c10::DispatchKey::AutocastCUDA, &softmax_autocast<true>));
}

}  // namespace gpu_puzzles
