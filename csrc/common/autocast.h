// Shared pieces of the autocast kernels (csrc/<op>/<op>_autocast.cpp): what an op does
// inside torch.autocast, on the AutocastCPU and AutocastCUDA keys, which run before
// autograd. Each op follows its PyTorch counterpart's autocast rule on each device
// (ATen's autocast_mode lists): matmul-class work (linear layers, attention, conv1d)
// runs in the autocast dtype; what PyTorch puts on its float32 list returns float32.
// Ops without an autocast kernel (embedding, rms_norm, the backward ops) run in the dtype
// they are given, through autocast's fallthrough.
//
// A kernel casts its arguments, then calls the op again with the device's autocast key
// excluded (ATen's wrappers do the same), so the casts are recorded by autograd and the
// gradients come back in each argument's own dtype.
#pragma once
#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

namespace gpu_puzzles {
namespace autocast {

// Held while the op is called again below autocast.
template <c10::DeviceType D>
struct Below {
  c10::impl::ExcludeDispatchKeyGuard guard{at::autocast::get_autocast_dispatch_key_from_device_type(D)};
};

// torch.autocast's dtype on D (bf16 or fp16).
template <c10::DeviceType D>
at::ScalarType lower() {
  return at::autocast::get_lower_precision_fp_from_device_type(D);
}

// What autocast casts: a floating tensor on D that is not float64.
template <c10::DeviceType D>
bool eligible(const at::Tensor& t) {
  return at::autocast::is_eligible(t, D);
}

// t in `to` when eligible, else t as it is. A leaf that requires grad (a Parameter) is
// cast once per autocast region (autocast's weight cache), as ATen's own casts are.
template <c10::DeviceType D>
at::Tensor cast(at::ScalarType to, const at::Tensor& t) {
  return at::autocast::cached_cast(to, t, D);
}
template <c10::DeviceType D>
c10::optional<at::Tensor> cast(at::ScalarType to, const c10::optional<at::Tensor>& t) {
  return t.has_value() ? c10::optional<at::Tensor>(cast<D>(to, *t)) : t;
}

}  // namespace autocast
}  // namespace gpu_puzzles

// Registers fn<CPU> for AutocastCPU and fn<CUDA> for AutocastCUDA, in a
// TORCH_LIBRARY_FRAGMENT(gpu_puzzles, m) block (the schemas stay in registration.cpp).
#define GP_AUTOCAST(m, name, fn)                                                                 \
  do {                                                                                           \
    (m).impl(name, torch::dispatch(c10::DispatchKey::AutocastCPU, &fn<c10::DeviceType::CPU>));   \
    (m).impl(name, torch::dispatch(c10::DispatchKey::AutocastCUDA, &fn<c10::DeviceType::CUDA>)); \
  } while (0)
