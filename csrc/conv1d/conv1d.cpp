// conv1d host side: argument checks, the CPU kernels and the CPU/CUDA
// registrations. Shapes are canonicalised to (B, C, L) rows with (C, K) taps:
// x (L,) w (K,) | x (C, L) w (C, K) | x (B, C, L) w (C, K).
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <string>
#include <tuple>

#include "common/checks.h"
#include "common/register.h"
#include "common/cuda_launch.h"
#include "conv1d/conv1d.h"

namespace gpu_puzzles {
namespace {

struct Shape {
  int64_t B, C, L, K;
};

Conv1dAlgo parse_algorithm(const std::string& algorithm, int64_t K, bool on_cuda) {
  if (algorithm == "auto") {
    if (!on_cuda || K <= kConv1dFastMaxK) return Conv1dAlgo::Fast;
    return K <= kConv1dTiledMaxK ? Conv1dAlgo::Tiled : Conv1dAlgo::Naive;
  }
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
    TORCH_CHECK(weight.size(0) == C, "conv1d: weight has ", weight.size(0), " channels but x has ", C,
                " (x shape ", x.sizes(), ", weight shape ", weight.sizes(), ")");
    s = {x.dim() == 3 ? x.size(0) : 1, C, x.size(-1), weight.size(1)};
  }
  TORCH_CHECK(s.K >= 1, "conv1d: weight must have at least one tap (K >= 1), got shape ", weight.sizes());
  if (bias.has_value()) {
    const at::Tensor& b = *bias;
    check_same_dtype(b, x, "conv1d: bias", "x");
    check_same_device(b, x, "conv1d: bias", "x");
    TORCH_CHECK(b.dim() <= 1 && b.numel() == s.C && (b.dim() == 1 || x.dim() == 1),
                "conv1d: bias must have shape (", s.C, ",), got ", b.sizes());
  }
  return s;
}

// ---- CPU kernels -------------------------------------------------------------

// out[r, i] = bias[c] + sum_j x[r, i - shift + j] * w[c, j], r = b*C + c.
template <typename T>
void conv_rows_cpu(const T* x, const T* w, const T* bias, T* out, const Shape& s, int64_t shift) {
  using A = at::opmath_type<T>;
  const int64_t rows = s.B * s.C;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, s.L * s.K));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t c = r % s.C;
      const T* xr = x + r * s.L;
      const T* wc = w + c * s.K;
      for (int64_t i = 0; i < s.L; ++i) {
        A acc = bias ? static_cast<A>(bias[c]) : A(0);
        const int64_t jlo = std::max<int64_t>(0, shift - i);
        const int64_t jhi = std::min<int64_t>(s.K, s.L - i + shift);
        for (int64_t j = jlo; j < jhi; ++j) acc += static_cast<A>(xr[i - shift + j]) * static_cast<A>(wc[j]);
        out[r * s.L + i] = static_cast<T>(acc);
      }
    }
  });
}

// dw[c, j] = sum_{b,i} dy[b,c,i] x[b,c,i-shift+j]; dbias[c] = sum dy[b,c,:].
template <typename T>
void weight_grad_cpu(const T* dy, const T* x, T* dw, T* dbias, const Shape& s, int64_t shift) {
  using A = at::opmath_type<T>;
  at::parallel_for(0, s.C, 1, [&](int64_t begin, int64_t end) {
    std::vector<A> acc(s.K + 1);
    for (int64_t c = begin; c < end; ++c) {
      std::fill(acc.begin(), acc.end(), A(0));
      for (int64_t b = 0; b < s.B; ++b) {
        const T* g = dy + (b * s.C + c) * s.L;
        const T* xr = x + (b * s.C + c) * s.L;
        for (int64_t i = 0; i < s.L; ++i) {
          const A gi = static_cast<A>(g[i]);
          acc[s.K] += gi;
          const int64_t jlo = std::max<int64_t>(0, shift - i);
          const int64_t jhi = std::min<int64_t>(s.K, s.L - i + shift);
          for (int64_t j = jlo; j < jhi; ++j) acc[j] += gi * static_cast<A>(xr[i - shift + j]);
        }
      }
      for (int64_t j = 0; j < s.K; ++j) dw[c * s.K + j] = static_cast<T>(acc[j]);
      dbias[c] = static_cast<T>(acc[s.K]);
    }
  });
}

at::Tensor conv1d_cpu(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                      bool causal, c10::string_view algorithm) {
  const Shape s = check_inputs(x, weight, bias);
  parse_algorithm(std::string(algorithm), s.K, /*on_cuda=*/false);
  TORCH_CHECK(x.device().is_cpu(), "conv1d: x must be a CPU tensor for the CPU kernel, got ", x.device());
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  const at::Tensor bc = bias.has_value() ? bias->contiguous() : at::Tensor();
  at::Tensor out = at::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "conv1d_cpu", [&] {
    conv_rows_cpu<scalar_t>(xc.data_ptr<scalar_t>(), wc.data_ptr<scalar_t>(),
                            bc.defined() ? bc.data_ptr<scalar_t>() : nullptr, out.data_ptr<scalar_t>(), s,
                            causal ? s.K - 1 : 0);
  });
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
  const at::Tensor g = grad_out.contiguous(), xc = x.contiguous();
  // dx is the forward with the taps reversed and the opposite alignment.
  const at::Tensor wflip = weight.flip({-1}).contiguous();
  at::Tensor dx = at::empty(x.sizes(), x.options());
  at::Tensor dw = at::empty(weight.sizes(), weight.options());
  at::Tensor db = at::empty({s.C}, weight.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "conv1d_backward_cpu", [&] {
    conv_rows_cpu<scalar_t>(g.data_ptr<scalar_t>(), wflip.data_ptr<scalar_t>(), nullptr, dx.data_ptr<scalar_t>(), s,
                            causal ? 0 : s.K - 1);
    weight_grad_cpu<scalar_t>(g.data_ptr<scalar_t>(), xc.data_ptr<scalar_t>(), dw.data_ptr<scalar_t>(),
                              db.data_ptr<scalar_t>(), s, causal ? s.K - 1 : 0);
  });
  return {dx, dw, db};
}

#ifdef WITH_CUDA
at::Tensor conv1d_cuda(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                       bool causal, c10::string_view algorithm) {
  const Shape s = check_inputs(x, weight, bias);
  const Conv1dAlgo algo = parse_algorithm(std::string(algorithm), s.K, /*on_cuda=*/true);
  TORCH_CHECK(x.is_cuda(), "conv1d: x must be a CUDA tensor for the CUDA kernel, got ", x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  const at::Tensor bc = bias.has_value() ? bias->contiguous() : at::Tensor();
  at::Tensor out = at::empty(x.sizes(), x.options());
  Conv1dArgs a{xc.data_ptr(), wc.data_ptr(), bc.defined() ? bc.data_ptr() : nullptr, out.data_ptr(),
               s.B, s.C, s.L, static_cast<int>(s.K), causal, to_dtype(x.scalar_type())};
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
  const at::Tensor g = grad_out.contiguous(), xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor dx = at::empty(x.sizes(), x.options());
  at::Tensor dw = at::empty(weight.sizes(), weight.options());
  at::Tensor db = at::empty({s.C}, weight.options());
  const DType dt = to_dtype(x.scalar_type());
  const cudaStream_t stream = current_stream();
  if (algo == Conv1dAlgo::Fast) {
    const auto acc = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    at::Tensor ws = at::empty({conv1d_backward_fast_workspace(s.B, s.C, s.L, static_cast<int>(s.K))},
                              x.options().dtype(acc));
    GP_CUDA_CHECK_STATUS(conv1d_backward_fast_cuda(g.data_ptr(), xc.data_ptr(), wc.data_ptr(), dx.data_ptr(),
                                                   dw.data_ptr(), db.data_ptr(), ws.data_ptr(), s.B, s.C, s.L,
                                                   static_cast<int>(s.K), causal, dt, stream));
  } else {
    const at::Tensor wflip = weight.flip({-1}).contiguous();
    Conv1dArgs a{g.data_ptr(), wflip.data_ptr(), nullptr, dx.data_ptr(), s.B, s.C, s.L, static_cast<int>(s.K),
                 !causal, dt};
    GP_CUDA_CHECK_STATUS(conv1d_forward_cuda(a, algo, stream));
    GP_CUDA_CHECK_STATUS(conv1d_weight_grad_generic_cuda(g.data_ptr(), xc.data_ptr(), dw.data_ptr(), db.data_ptr(),
                                                         s.B, s.C, s.L, static_cast<int>(s.K), causal, dt, stream));
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
