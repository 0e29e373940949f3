// Shared pieces of the C++ autograd kernels (csrc/<op>/<op>_autograd.cpp).
//
// Why C++: torch.library.register_autograd installs a Python autograd kernel that
// runs on every call, 10-20 us of host time; for a memory-bound op on an H100 that
// is longer than the kernel itself at moderate sizes. A C++ Autograd kernel keeps the
// call in the dispatcher. Each backward calls the op's own registered backward op
// (looked up once), so torch.compile traces the same graph as before.
#pragma once
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/library.h>

#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace gpu_puzzles {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The dispatcher handle of gpu_puzzles::<name>, typed by its C++ signature.
template <typename Sig>
c10::TypedOperatorHandle<Sig> typed_op(const char* qualified_name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(qualified_name, "").template typed<Sig>();
}

// typed_op<Sig>(Name), looked up on its first call (after the library's registration has run)
// and kept. Name: a constexpr char array of the calling file, e.g.
//   constexpr char kForward[] = "gpu_puzzles::rotary";  ...  op_handle<ForwardSig, kForward>().call(...)
template <typename Sig, const char* Name>
const c10::TypedOperatorHandle<Sig>& op_handle() {
  static const auto handle = typed_op<Sig>(Name);
  return handle;
}

// Marks outputs that carry no gradient (statistics, lse, precomputed gradients). It also
// turns off autograd's zero-filling of the undefined gradients those outputs get: every
// backward here reads grads[0] only (and checks it is defined), and the zeros cost a fill
// launch per output per call (for fused_linear_cross_entropy, a vocabulary x hidden one).
inline void non_differentiable(AutogradContext* ctx, const variable_list& outputs) {
  ctx->mark_non_differentiable(outputs);
  ctx->set_materialize_grads(false);
}

// Double backward. Every backward op has an Autograd kernel of its own, so that a backward
// differentiated again (create_graph=True: Hessian-vector products, gradient penalties) is
// either right or an error naming the op, never the silent wrong numbers (and the warning) of
// autograd's fallback for ops without one. Grad mode is on inside a backward only under
// create_graph=True; torch.compile traces its backward with it off, so the fast path below is
// what it sees.

// Some input requires grad while grad mode is on: the call is being differentiated.
template <typename... Args>
bool differentiated(Args&&... inputs) {
  return torch::autograd::compute_requires_grad(std::forward<Args>(inputs)...);
}

namespace detail {
inline bool has_tangent(const at::Tensor& t) { return t.defined() && t._fw_grad(/*level=*/0).defined(); }
inline bool has_tangent(const c10::optional<at::Tensor>& t) { return t.has_value() && has_tangent(*t); }
}  // namespace detail

// The call needs an autograd node: some input is being differentiated, or carries a
// forward-mode tangent (which Function::apply refuses, naming jvp, where the kernel alone
// would drop it). Otherwise (inference, eval, no_grad, frozen inputs) the op's kernel is
// called below autograd directly: Function::apply would still build a node, its saved
// data and the outputs' wrapping for nothing, ~2 us a call. Pass the tensor arguments.
template <typename... Args>
bool needs_autograd(const Args&... inputs) {
  return differentiated(inputs...) || (detail::has_tangent(inputs) || ...);
}

// Outputs computed below autograd that have no derivative here: they take a node whose
// backward raises `msg`, as ATen's not-implemented derivatives do. `inputs`: the edges to the
// arguments (torch::autograd::collect_next_edges).
inline void error_on_backward(std::string msg, torch::autograd::edge_list&& inputs,
                              const std::vector<at::Tensor>& outputs) {
  auto node = std::make_shared<torch::autograd::Error>(std::move(msg), std::move(inputs));
  for (const auto& t : outputs)
    if (t.defined()) torch::autograd::set_history(t, node);
}

// f(), the op's kernel, called below autograd.
template <typename F>
auto below_autograd(F&& f) {
  at::AutoDispatchBelowADInplaceOrView guard;
  return f();
}

// A backward op without a derivative of its own: `out` (a tensor or a tuple of them, from
// below_autograd) returned as it is, or, where `inputs` are being differentiated, marked so
// that differentiating it again raises, naming the op.
template <typename Out, typename... Inputs>
Out no_double_backward(const char* op, Out out, const Inputs&... inputs) {
  if (!differentiated(inputs...)) return out;
  std::vector<at::Tensor> outs;
  if constexpr (std::is_same_v<Out, at::Tensor>) {
    outs.push_back(out);
  } else {
    std::apply([&](const auto&... t) { (outs.push_back(t), ...); }, out);
  }
  error_on_backward(std::string("gpu_puzzles::") + op +
                        ": double backward (create_graph=True, then differentiating the gradients) is not "
                        "supported by this op",
                    torch::autograd::collect_next_edges(inputs...), outs);
  return out;
}

// The gradient if the input needs one, else an undefined tensor.
inline at::Tensor if_needed(AutogradContext* ctx, size_t i, const at::Tensor& g) {
  return ctx->needs_input_grad(i) ? g : at::Tensor();
}

}  // namespace gpu_puzzles
