// conv1d host side: argument checks and the CPU/CUDA registrations (the CPU
// kernels are in conv1d_cpu.cpp, the CUDA ones in conv1d_cuda.cu). Shapes are
// canonicalised to (B, C, L) rows with (C, K) taps:
// x (L,) w (K,) | x (C, L) w (C, K) | x (B, C, L) w (C, K).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>
#include <tuple>
#include <utility>

#include "common/checks.h"
#include "common/register.h"
#include "common/tensor_rows.h"
#include "common/cuda_launch.h"
#include "conv1d/conv1d.h"
#include "conv1d/conv1d_plan.h"

namespace gpu_puzzles {
namespace {

struct Shape {
  int64_t B, C, L, K;
};

Conv1dAlgo parse_algorithm(const std::string& algorithm, int64_t K, bool on_cuda) {
  if (algorithm == "auto") return conv1d_auto_algo(K, on_cuda);
  if (algorithm == "fast") {
    TORCH_CHECK(!on_cuda || K <= kConv1dFastMaxK, "conv1d: algorithm='fast' handles kernel sizes up to ",
                kConv1dFastMaxK, ", weight has ", K, " taps; use algorithm='auto'");
    return Conv1dAlgo::Fast;
  }
  if (algorithm == "tiled") {
    TORCH_CHECK(!on_cuda || K <= kConv1dTiledMaxK, "conv1d: algorithm='tiled' handles kernel sizes up to ",
                kConv1dTiledMaxK, ", weight has ", K, " taps; use algorithm='auto'");
    return Conv1dAlgo::Tiled;
  }
  if (algorithm == "naive") return Conv1dAlgo::Naive;
  TORCH_CHECK(false, "conv1d: algorithm must be one of 'auto', 'fast', 'tiled', 'naive', got '", algorithm, "'");
}

Shape check_inputs(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  check_dim_in(x, 1, 3, "conv1d: x");
  check_float(x, "conv1d: x");
  check_same_dtype(weight, x, "conv1d: weight", "x");
  check_same_device(weight, x, "conv1d: weight", "x");
  Shape s{};
  if (x.dim() == 1) {
    TORCH_CHECK(weight.dim() == 1, "conv1d: weight must be 1-D (K,) for a 1-D x, got shape ", weight.sizes());
    s = {1, 1, x.size(0), weight.size(0)};
  } else {
    TORCH_CHECK(weight.dim() == 2, "conv1d: weight must be 2-D (C, K) for a ", x.dim(), "-D x, got shape ",
                weight.sizes());
    const int64_t C = x.size(x.dim() - 2);
    TORCH_CHECK(weight.size(0) == C, "conv1d: weight has ", weight.size(0), " channels but x has ", C, " (x shape ",
                x.sizes(), ", weight shape ", weight.sizes(), ")");
    s = {x.dim() == 3 ? x.size(0) : 1, C, x.size(-1), weight.size(1)};
  }
  TORCH_CHECK(s.K >= 1, "conv1d: weight must have at least one tap (K >= 1), got shape ", weight.sizes());
  if (bias.has_value()) {
    const at::Tensor& b = *bias;
    check_same_dtype(b, x, "conv1d: bias", "x");
    check_same_device(b, x, "conv1d: bias", "x");
    TORCH_CHECK(b.dim() <= 1 && b.numel() == s.C && (b.dim() == 1 || x.dim() == 1), "conv1d: bias must have shape (",
                s.C, ",), got ", b.sizes());
  }
  return s;
}

#ifdef WITH_CUDA
// weight (C, K) or (K,) with contiguous rows, and its row stride.
std::pair<at::Tensor, int64_t> taps_of(const at::Tensor& w) {
  const at::Tensor t = w.size(-1) <= 1 || w.stride(-1) == 1 ? w : w.contiguous();
  return {t, t.dim() == 2 ? t.stride(0) : t.size(0)};
}
#endif

at::Tensor conv1d_cpu(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias, bool causal,
                      c10::string_view algorithm) {
  const Shape s = check_inputs(x, weight, bias);
  parse_algorithm(std::string(algorithm), s.K, /*on_cuda=*/false);
  TORCH_CHECK(x.device().is_cpu(), "conv1d: x must be a CPU tensor for the CPU kernel, got ", x.device());
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  const at::Tensor bc = bias.has_value() ? bias->contiguous() : at::Tensor();
  at::Tensor out = at::empty(x.sizes(), x.options());
  conv1d_forward_cpu_kernel(xc, wc, bc, out, causal);
  return out;
}

void check_grad_out(const at::Tensor& grad_out, const at::Tensor& x) {
  TORCH_CHECK(grad_out.sizes() == x.sizes(), "conv1d_backward: grad_out has shape ", grad_out.sizes(),
              " but x has shape ", x.sizes());
  check_same_dtype(grad_out, x, "conv1d_backward: grad_out", "x");
  check_same_device(grad_out, x, "conv1d_backward: grad_out", "x");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv1d_backward_cpu(const at::Tensor& grad_out, const at::Tensor& x,
                                                                   const at::Tensor& weight, bool causal,
                                                                   c10::string_view algorithm) {
  const Shape s = check_inputs(x, weight, c10::nullopt);
  check_grad_out(grad_out, x);
  parse_algorithm(std::string(algorithm), s.K, /*on_cuda=*/false);
  const at::Tensor g = grad_out.contiguous(), xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor dx = at::empty(x.sizes(), x.options());
  at::Tensor dw = at::empty(weight.sizes(), weight.options());
  at::Tensor db = at::empty({s.C}, weight.options());
  conv1d_backward_cpu_kernel(g, xc, wc, dx, dw, db, causal);
  return {dx, dw, db};
}

#ifdef WITH_CUDA
at::Tensor conv1d_cuda(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                       bool causal, c10::string_view algorithm) {
  const Shape s = check_inputs(x, weight, bias);
  const Conv1dAlgo algo = parse_algorithm(std::string(algorithm), s.K, /*on_cuda=*/true);
  TORCH_CHECK(x.is_cuda(), "conv1d: x must be a CUDA tensor for the CUDA kernel, got ", x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  const auto [xc, xs] = tensor_rows(x, true);
  const auto [wc, ws] = taps_of(weight);
  const at::Tensor bc = bias.has_value() ? bias->contiguous() : at::Tensor();
  at::Tensor out = at::empty(x.sizes(), x.options());
  Conv1dArgs a{xc.data_ptr(),
               wc.data_ptr(),
               bc.defined() ? bc.data_ptr() : nullptr,
               out.data_ptr(),
               s.B,
               s.C,
               s.L,
               static_cast<int>(s.K),
               causal,
               to_dtype(x.scalar_type()),
               xs,
               ws};
  GP_CUDA_CHECK_STATUS(conv1d_forward_cuda(a, algo, current_stream()));
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv1d_backward_cuda(const at::Tensor& grad_out, const at::Tensor& x,
                                                                    const at::Tensor& weight, bool causal,
                                                                    c10::string_view algorithm) {
  const Shape s = check_inputs(x, weight, c10::nullopt);
  check_grad_out(grad_out, x);
  const Conv1dAlgo algo = parse_algorithm(std::string(algorithm), s.K, /*on_cuda=*/true);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto [g, gs] = tensor_rows(grad_out, true);
  const auto [xc, xs] = tensor_rows(x, true);
  at::Tensor dx = at::empty(x.sizes(), x.options());
  at::Tensor dw = at::empty(weight.sizes(), weight.options());
  at::Tensor db = at::empty({s.C}, weight.options());
  const DType dt = to_dtype(x.scalar_type());
  const cudaStream_t stream = current_stream();
  if (algo == Conv1dAlgo::Fast) {
    const auto acc = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    at::Tensor ws =
        at::empty({conv1d_backward_fast_workspace(s.B, s.C, s.L, static_cast<int>(s.K))}, x.options().dtype(acc));
    const auto [wc, wstride] = taps_of(weight);
    GP_CUDA_CHECK_STATUS(conv1d_backward_fast_cuda(g.data_ptr(), gs, xc.data_ptr(), xs, wc.data_ptr(), wstride,
                                                   dx.data_ptr(), dw.data_ptr(), db.data_ptr(), ws.data_ptr(), s.B, s.C,
                                                   s.L, static_cast<int>(s.K), causal, dt, stream));
  } else {
    const at::Tensor wflip = weight.flip({-1}).contiguous();
    Conv1dArgs a{
        g.data_ptr(), wflip.data_ptr(), nullptr, dx.data_ptr(), s.B, s.C, s.L, static_cast<int>(s.K), !causal, dt, gs,
        s.K};
    GP_CUDA_CHECK_STATUS(conv1d_forward_cuda(a, algo, stream));
    GP_CUDA_CHECK_STATUS(conv1d_weight_grad_generic_cuda(g.data_ptr(), gs, xc.data_ptr(), xs, dw.data_ptr(),
                                                         db.data_ptr(), s.B, s.C, s.L, static_cast<int>(s.K), causal,
                                                         dt, stream));
  }
  return {dx, dw, db};
}
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(gpu_puzzles, m) {
  GP_IMPL(m, "conv1d", conv1d_cpu, conv1d_cuda);
  GP_IMPL(m, "conv1d_backward", conv1d_backward_cpu, conv1d_backward_cuda);
}

}  // namespace gpu_puzzles
