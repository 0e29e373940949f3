// Shared pieces of the C++ autograd kernels (csrc/<op>/<op>_autograd.cpp).
//
// Why C++: torch.library.register_autograd installs a Python autograd kernel that
// runs on every call, 10-20 us of host time; for a memory-bound op on an H100 that
// is longer than the kernel itself at moderate sizes. A C++ Autograd kernel keeps the
// call in the dispatcher. Each backward calls the op's own registered backward op
// (looked up once), so torch.compile traces the same graph as before.
#pragma once
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

namespace gpu_puzzles {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The dispatcher handle of gpu_puzzles::<name>, typed by its C++ signature.
template <typename Sig>
c10::TypedOperatorHandle<Sig> typed_op(const char* qualified_name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(qualified_name, "").template typed<Sig>();
}

// Marks outputs that carry no gradient (statistics, lse, precomputed gradients). It also
// turns off autograd's zero-filling of the undefined gradients those outputs get: every
// backward here reads grads[0] only (and checks it is defined), and the zeros cost a fill
// launch per output per call (for fused_linear_cross_entropy, a vocabulary x hidden one).
inline void non_differentiable(AutogradContext* ctx, const variable_list& outputs) {
  ctx->mark_non_differentiable(outputs);
  ctx->set_materialize_grads(false);
}

// The gradient if the input needs one, else an undefined tensor.
inline at::Tensor if_needed(AutogradContext* ctx, size_t i, const at::Tensor& g) {
  return ctx->needs_input_grad(i) ? g : at::Tensor();
}

}  // namespace gpu_puzzles
