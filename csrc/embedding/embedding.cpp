// embedding host side: argument checks and the CPU/CUDA registrations (the
// CPU kernels are in embedding_cpu.cpp, the CUDA ones in embedding_cuda.cu).
// Indices of any shape are flattened to T tokens; weight is (V, E).
// Out-of-range indices (negative too) give zero rows and no gradient;
// padding_idx rows are returned but get no gradient (as F.embedding).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>
#include <utility>
#include <vector>

#include "common/checks.h"
#include "common/register.h"
#include "common/tensor_rows.h"
#include "common/cuda_launch.h"
#include "embedding/embedding.h"

namespace gpu_puzzles {
namespace {

struct Sizes {
  int64_t T, V, E;
};

void check_indices(const at::Tensor& indices, const char* op) {
  TORCH_CHECK(indices.scalar_type() == at::kInt || indices.scalar_type() == at::kLong, op,
              ": indices must be an int32 or int64 tensor, got ", indices.scalar_type());
}

// padding_idx in [0, V), or -1 for none; F.embedding's range rule.
int64_t normalise_padding(c10::optional<int64_t> padding_idx, int64_t V, const char* op) {
  if (!padding_idx.has_value()) return -1;
  const int64_t p = *padding_idx;
  TORCH_CHECK(p >= -V && p < V, op, ": padding_idx must be within [-num_embeddings, num_embeddings) = [", -V, ", ", V,
              "), got ", p);
  return p < 0 ? p + V : p;
}

Sizes check_forward(const at::Tensor& indices, const at::Tensor& weight, c10::optional<int64_t> padding_idx,
                    const char* op) {
  const std::string w_name = std::string(op) + ": weight";
  const std::string i_name = std::string(op) + ": indices";
  check_indices(indices, op);
  check_float(weight, w_name.c_str());
  TORCH_CHECK(weight.dim() == 2, op, ": weight must be 2-D (num_embeddings, embedding_dim), got shape ",
              weight.sizes());
  check_same_device(indices, weight, i_name.c_str(), "weight");
  normalise_padding(padding_idx, weight.size(0), op);
  return {indices.numel(), weight.size(0), weight.size(1)};
}

Sizes check_backward(const at::Tensor& grad_out, const at::Tensor& indices, int64_t V, const char* op) {
  const std::string g_name = std::string(op) + ": grad_out";
  const std::string i_name = std::string(op) + ": indices";
  check_indices(indices, op);
  check_float(grad_out, g_name.c_str());
  check_same_device(indices, grad_out, i_name.c_str(), "grad_out");
  TORCH_CHECK(V >= 0, op, ": num_weights must be >= 0, got ", V);
  bool ok = grad_out.dim() == indices.dim() + 1;
  for (int64_t d = 0; ok && d < indices.dim(); ++d) ok = grad_out.size(d) == indices.size(d);
  TORCH_CHECK(ok, op, ": grad_out must have shape indices.shape + (embedding_dim,), got grad_out ", grad_out.sizes(),
              " and indices ", indices.sizes());
  return {indices.numel(), V, grad_out.size(-1)};
}

// algorithm: "auto" / "coalesced" (the 1D grid, 16-byte vectors) or "2d" (the
// curriculum's 16x16 grid, kept as the coalescing counter-example). True for "2d".
bool two_d_grid(c10::string_view algorithm, const char* op) {
  TORCH_CHECK(algorithm == "auto" || algorithm == "coalesced" || algorithm == "2d", op,
              ": algorithm must be one of 'auto', 'coalesced', '2d', got '", std::string(algorithm), "'");
  return algorithm == "2d";
}

std::vector<int64_t> out_shape(const at::Tensor& indices, int64_t E) {
  std::vector<int64_t> s(indices.sizes().begin(), indices.sizes().end());
  s.push_back(E);
  return s;
}

at::Tensor forward_cpu_op(const at::Tensor& indices, const at::Tensor& weight, c10::optional<int64_t> padding_idx,
                          const char* op) {
  const Sizes s = check_forward(indices, weight, padding_idx, op);
  TORCH_CHECK(weight.device().is_cpu(), op, ": weight must be a CPU tensor for the CPU kernel, got ", weight.device());
  const at::Tensor ic = indices.contiguous(), wc = weight.contiguous();
  at::Tensor out = at::empty(out_shape(indices, s.E), weight.options());
  embedding_forward_cpu_kernel(ic, wc, out);
  return out;
}

at::Tensor backward_cpu_op(const at::Tensor& grad_out, const at::Tensor& indices, int64_t V,
                           c10::optional<int64_t> padding_idx, const char* op) {
  const Sizes s = check_backward(grad_out, indices, V, op);
  const int64_t pad = normalise_padding(padding_idx, V, op);
  const at::Tensor gc = grad_out.contiguous(), ic = indices.contiguous();
  at::Tensor gw = at::empty({V, s.E}, grad_out.options());
  embedding_backward_cpu_kernel(gc, ic, gw, pad);
  return gw;
}

// The CPU has one kernel for every algorithm (the 2D grid is a GPU notion).
at::Tensor embedding_cpu(const at::Tensor& indices, const at::Tensor& weight, c10::optional<int64_t> padding_idx,
                         c10::string_view algorithm) {
  two_d_grid(algorithm, "embedding");
  return forward_cpu_op(indices, weight, padding_idx, "embedding");
}
at::Tensor embedding_backward_cpu(const at::Tensor& grad_out, const at::Tensor& indices, c10::SymInt num_weights,
                                  c10::optional<int64_t> padding_idx, bool /*deterministic: always*/,
                                  c10::string_view algorithm) {
  two_d_grid(algorithm, "embedding_backward");
  return backward_cpu_op(grad_out, indices, num_weights.expect_int(), padding_idx, "embedding_backward");
}

#ifdef WITH_CUDA
at::Tensor forward_cuda_op(const at::Tensor& indices, const at::Tensor& weight, c10::optional<int64_t> padding_idx,
                           bool two_d, const char* op) {
  const Sizes s = check_forward(indices, weight, padding_idx, op);
  TORCH_CHECK(weight.is_cuda(), op, ": weight must be a CUDA tensor for the CUDA kernel, got ", weight.device());
  const c10::cuda::CUDAGuard guard(weight.device());
  const auto [ic, is] = tensor_rows(indices, false);
  const at::Tensor wc = s.E <= 1 || weight.stride(1) == 1 ? weight : weight.contiguous();
  at::Tensor out = at::empty(out_shape(indices, s.E), weight.options());
  EmbeddingFwdArgs a{ic.data_ptr(),
                     ic.scalar_type() == at::kLong,
                     wc.data_ptr(),
                     out.data_ptr(),
                     s.T,
                     s.V,
                     s.E,
                     to_dtype(weight.scalar_type()),
                     is,
                     s.E <= 1 ? s.E : wc.stride(0)};
  GP_CUDA_CHECK_STATUS(two_d ? embedding_forward_2d_cuda(a, current_stream())
                             : embedding_forward_cuda(a, current_stream()));
  return out;
}

at::Tensor backward_sorted_cuda(const at::Tensor& grad_out, const at::Tensor& ic, const Sizes& s, int64_t pad) {
  const auto [gc, gs] = tensor_rows(grad_out, true);
  // The sort needs one flat int64 key array: strided or int32 indices are gathered into it.
  const at::Tensor keys = ic.reshape({-1}).to(at::kLong);
  // Stable: equal keys keep token order, which fixes the summation order.
  auto sorted = at::sort(keys, /*stable=*/true, /*dim=*/0, /*descending=*/false);
  const at::Tensor skey = std::get<0>(sorted).contiguous(), spos = std::get<1>(sorted).contiguous();
  at::Tensor seg = at::zeros({s.V, 2}, ic.options().dtype(at::kLong));
  const auto acc = gc.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor partial = at::empty({embedding_backward_partial_elems(s.T, s.E)}, gc.options().dtype(acc));
  at::Tensor gw = at::empty({s.V, s.E}, gc.options());
  EmbeddingBwdArgs a{gc.data_ptr(),
                     skey.data_ptr<int64_t>(),
                     spos.data_ptr<int64_t>(),
                     seg.data_ptr<int64_t>(),
                     partial.data_ptr(),
                     gw.data_ptr(),
                     s.T,
                     s.V,
                     s.E,
                     pad,
                     to_dtype(gc.scalar_type()),
                     gs};
  GP_CUDA_CHECK_STATUS(embedding_backward_sorted_cuda(a, current_stream()));
  return gw;
}

at::Tensor backward_cuda_op(const at::Tensor& grad_out, const at::Tensor& indices, int64_t V,
                            c10::optional<int64_t> padding_idx, bool deterministic, bool two_d, const char* op) {
  const Sizes s = check_backward(grad_out, indices, V, op);
  const int64_t pad = normalise_padding(padding_idx, V, op);
  TORCH_CHECK(grad_out.is_cuda(), op, ": grad_out must be a CUDA tensor for the CUDA kernel, got ", grad_out.device());
  const c10::cuda::CUDAGuard guard(grad_out.device());
  // The sorted path is deterministic and also the fastest one we have for the
  // coalesced kernel; the 2D grid keeps the seed-style atomics unless asked for
  // determinism.
  if (!two_d || deterministic) return backward_sorted_cuda(grad_out, indices, s, pad);
  const at::Tensor gc = grad_out.contiguous(), ic = indices.contiguous();
  at::Tensor gw = at::empty({V, s.E}, gc.options());
  const bool half = gc.scalar_type() == at::kHalf || gc.scalar_type() == at::kBFloat16;
  at::Tensor acc = half ? at::empty({V, s.E}, gc.options().dtype(at::kFloat)) : gw;
  GP_CUDA_CHECK_STATUS(embedding_backward_2d_atomic_cuda(gc.data_ptr(), ic.data_ptr(), ic.scalar_type() == at::kLong,
                                                         acc.data_ptr(), gw.data_ptr(), s.T, V, s.E, pad,
                                                         to_dtype(gc.scalar_type()), current_stream()));
  return gw;
}

at::Tensor embedding_cuda(const at::Tensor& indices, const at::Tensor& weight, c10::optional<int64_t> padding_idx,
                          c10::string_view algorithm) {
  return forward_cuda_op(indices, weight, padding_idx, two_d_grid(algorithm, "embedding"), "embedding");
}
at::Tensor embedding_backward_cuda(const at::Tensor& grad_out, const at::Tensor& indices, c10::SymInt num_weights,
                                   c10::optional<int64_t> padding_idx, bool deterministic, c10::string_view algorithm) {
  return backward_cuda_op(grad_out, indices, num_weights.expect_int(), padding_idx, deterministic,
                          two_d_grid(algorithm, "embedding_backward"), "embedding_backward");
}
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(gpu_puzzles, m) {
  GP_IMPL(m, "embedding", embedding_cpu, embedding_cuda);
  GP_IMPL(m, "embedding_backward", embedding_backward_cpu, embedding_backward_cuda);
}

}  // namespace gpu_puzzles
