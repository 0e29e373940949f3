// softmax / log_softmax host side: argument checks, the CPU kernels and the
// CPU/CUDA registrations. A tensor is viewed contiguous as (outer, N, inner)
// with N the size of the reduced dim; a 0-d tensor is one row of one element.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "common/checks.h"
#include "common/register.h"
#include "common/cuda_launch.h"
#include "softmax/softmax.h"

namespace gpu_puzzles {
namespace {

struct Dims {
  int64_t dim, outer, N, inner;
};

Dims canon(const at::Tensor& x, int64_t dim, const char* op, const char* name) {
  const int64_t nd = std::max<int64_t>(1, x.dim());
  TORCH_CHECK(dim >= -nd && dim < nd, op, ": dim ", dim, " is out of range for ", name, " with ", x.dim(),
              " dimensions (expected in [", -nd, ", ", nd - 1, "])");
  const int64_t d = dim < 0 ? dim + nd : dim;
  Dims r{d, 1, 1, 1};
  if (x.dim() == 0) return r;
  for (int64_t i = 0; i < d; ++i) r.outer *= x.size(i);
  r.N = x.size(d);
  for (int64_t i = d + 1; i < x.dim(); ++i) r.inner *= x.size(i);
  return r;
}

// The curriculum's variants; the Auto kernels' tuning comes from the knobs
// (softmax_tuning()), never from this string.
SoftmaxAlgo parse_algorithm(const std::string& algorithm, const char* op) {
  if (algorithm == "auto") return SoftmaxAlgo::Auto;
  if (algorithm == "tree") return SoftmaxAlgo::Tree;
  if (algorithm == "shuffle") return SoftmaxAlgo::Shuffle;
  if (algorithm == "online") return SoftmaxAlgo::Online;
  TORCH_CHECK(false, op, ": algorithm must be one of 'auto', 'tree', 'shuffle', 'online', got '", algorithm, "'");
}

// The checked arguments of one call: the op's name for messages, the (outer,
// N, inner) view and the algorithm.
struct Call {
  const char* op;
  Dims d;
  SoftmaxAlgo algo;
};

Call check_forward(const at::Tensor& x, int64_t dim, c10::string_view algorithm, bool log) {
  const char* op = log ? "log_softmax" : "softmax";
  check_float(x, log ? "log_softmax: x" : "softmax: x");
  const Dims d = canon(x, dim, op, "x");
  return Call{op, d, parse_algorithm(std::string(algorithm), op)};
}

Call check_backward(const at::Tensor& grad_out, const at::Tensor& out, int64_t dim, c10::string_view algorithm,
                    bool log) {
  const char* op = log ? "log_softmax_backward" : "softmax_backward";
  const std::string g = std::string(op) + ": grad_out";
  const std::string o = std::string(op) + ": out";
  check_float(out, o.c_str());
  check_same_dtype(grad_out, out, g.c_str(), "out");
  check_same_device(grad_out, out, g.c_str(), "out");
  TORCH_CHECK(grad_out.sizes() == out.sizes(), op, ": grad_out has shape ", grad_out.sizes(), " but out has shape ",
              out.sizes());
  const Dims d = canon(out, dim, op, "out");
  return Call{op, d, parse_algorithm(std::string(algorithm), op)};
}

// ---- CPU kernels ---------------------------------------------------------------
// One "line" per (outer, inner) pair, elements `inner` apart. Plain passes with
// double statistics (a float running sum of a million terms drifts by ~1e-4):
// this is the correctness oracle, not a speed target.

// Calls f(base) for every line, in parallel; the line's elements are base + n * inner.
template <typename F>
void for_each_line(const Dims& d, F&& f) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, d.N));
  at::parallel_for(0, d.outer * d.inner, grain, [&](int64_t begin, int64_t end) {
    for (int64_t l = begin; l < end; ++l) f((l / d.inner) * d.N * d.inner + l % d.inner);
  });
}

template <typename T>
void forward_cpu_kernel(const T* x, T* y, const Dims& d, bool log) {
  using A = double;
  for_each_line(d, [&](int64_t base) {
    const T* p = x + base;
    T* q = y + base;
    A m = -std::numeric_limits<A>::infinity();
    for (int64_t n = 0; n < d.N; ++n) m = std::max(m, static_cast<A>(p[n * d.inner]));  // NaN ignored here,
    A s = 0;                                                                          // but poisons s below
    for (int64_t n = 0; n < d.N; ++n) s += std::exp(static_cast<A>(p[n * d.inner]) - m);
    const A ls = std::log(s);
    for (int64_t n = 0; n < d.N; ++n) {
      const A v = static_cast<A>(p[n * d.inner]) - m;
      q[n * d.inner] = static_cast<T>(log ? v - ls : std::exp(v) / s);
    }
  });
}

// softmax: dx = y (dy - sum(dy y));  log_softmax: dx = dy - exp(y) sum(dy).
template <typename T>
void backward_cpu_kernel(const T* dy, const T* y, T* dx, const Dims& d, bool log) {
  using A = double;
  for_each_line(d, [&](int64_t base) {
    A s = 0;
    for (int64_t n = 0; n < d.N; ++n) {
      const int64_t i = base + n * d.inner;
      s += log ? static_cast<A>(dy[i]) : static_cast<A>(dy[i]) * static_cast<A>(y[i]);
    }
    for (int64_t n = 0; n < d.N; ++n) {
      const int64_t i = base + n * d.inner;
      const A g = static_cast<A>(dy[i]), v = static_cast<A>(y[i]);
      dx[i] = static_cast<T>(log ? g - std::exp(v) * s : v * (g - s));
    }
  });
}

template <bool Log>
at::Tensor forward_cpu(const at::Tensor& x, int64_t dim, c10::string_view algorithm) {
  const Dims d = check_forward(x, dim, algorithm, Log).d;  // the CPU has one kernel for every algorithm
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options());
  if (x.numel() == 0) return y;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "softmax_cpu", [&] {
    forward_cpu_kernel<scalar_t>(xc.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), d, Log);
  });
  return y;
}

template <bool Log>
at::Tensor backward_cpu(const at::Tensor& grad_out, const at::Tensor& out, int64_t dim, c10::string_view algorithm) {
  const Dims d = check_backward(grad_out, out, dim, algorithm, Log).d;
  const at::Tensor g = grad_out.contiguous(), yc = out.contiguous();
  at::Tensor dx = at::empty(out.sizes(), out.options());
  if (out.numel() == 0) return dx;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "softmax_backward_cpu", [&] {
    backward_cpu_kernel<scalar_t>(g.data_ptr<scalar_t>(), yc.data_ptr<scalar_t>(), dx.data_ptr<scalar_t>(), d, Log);
  });
  return dx;
}

#ifdef WITH_CUDA
// The teaching kernels only walk a contiguous last dim: move the reduced dim
// last through a copy (they are for the notebook, not for speed).
bool needs_move(const Dims& d, SoftmaxAlgo algo) { return algo != SoftmaxAlgo::Auto && d.inner != 1; }

at::Tensor run_cuda(const at::Tensor& a, const at::Tensor* b, const Dims& d0, SoftmaxAlgo algo, bool log,
                    bool backward) {
  Dims d = d0;
  const bool move = needs_move(d, algo);
  at::Tensor ac = move ? a.movedim(d.dim, -1).contiguous() : a.contiguous();
  at::Tensor bc;
  if (b) bc = move ? b->movedim(d.dim, -1).contiguous() : b->contiguous();
  if (move) d = Dims{ac.dim() - 1, d.N > 0 ? ac.numel() / d.N : 0, d.N, 1};
  at::Tensor out = at::empty(ac.sizes(), ac.options());
  if (ac.numel() > 0) {
    SoftmaxArgs args{ac.data_ptr(), bc.defined() ? bc.data_ptr() : nullptr, out.data_ptr(), d.outer, d.N, d.inner,
                     log, to_dtype(a.scalar_type()), softmax_tuning()};
    const int64_t wsb = softmax_workspace_bytes(args, algo, backward);
    at::Tensor ws = wsb > 0 ? at::empty({wsb}, a.options().dtype(at::kByte)) : at::Tensor();
    void* wp = ws.defined() ? ws.data_ptr() : nullptr;
    const cudaStream_t st = current_stream();
    GP_CUDA_CHECK_STATUS(backward ? softmax_backward_cuda(args, algo, wp, st) : softmax_forward_cuda(args, algo, wp, st));
  }
  return move ? out.movedim(-1, d0.dim).contiguous() : out;
}

template <bool Log>
at::Tensor forward_cuda(const at::Tensor& x, int64_t dim, c10::string_view algorithm) {
  const Call c = check_forward(x, dim, algorithm, Log);
  TORCH_CHECK(x.is_cuda(), c.op, ": x must be a CUDA tensor for the CUDA kernel, got ", x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  return run_cuda(x, nullptr, c.d, c.algo, Log, false);
}

template <bool Log>
at::Tensor backward_cuda(const at::Tensor& grad_out, const at::Tensor& out, int64_t dim, c10::string_view algorithm) {
  const Call c = check_backward(grad_out, out, dim, algorithm, Log);
  const c10::cuda::CUDAGuard guard(out.device());
  return run_cuda(out, &grad_out, c.d, c.algo, Log, true);
}
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(gpu_puzzles, m) {
  GP_IMPL(m, "softmax", forward_cpu<false>, forward_cuda<false>);
  GP_IMPL(m, "log_softmax", forward_cpu<true>, forward_cuda<true>);
  GP_IMPL(m, "softmax_backward", backward_cpu<false>, backward_cuda<false>);
  GP_IMPL(m, "log_softmax_backward", backward_cpu<true>, backward_cuda<true>);
}

}  // namespace gpu_puzzles
