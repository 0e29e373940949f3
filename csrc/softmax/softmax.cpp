// softmax / log_softmax host side: argument checks, the CPU kernels and the
// CPU/CUDA registrations. A tensor is viewed contiguous as (outer, N, inner)
// with N the size of the reduced dim; a 0-d tensor is one row of one element.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <string>

#include "common/checks.h"
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

// "auto:key=value,...": the auto kernels with a variant for tuning sweeps and
// tests (keys rows=old|new|smem|bulk, cluster=4|8|16, stages=1|2|3, cols=old|new,
// col_rows_fwd=4|8|16, col_rows_bwd=4|8|16, grid=1|4; see SoftmaxTuning). Not a public
// choice: the Python checks accept only the plain names.
SoftmaxTuning parse_tuning(const std::string& algorithm, const char* op) {
  SoftmaxTuning t;
  if (algorithm.rfind("auto:", 0) != 0) return t;
  std::string rest = algorithm.substr(5);
  size_t pos = 0;
  while (pos <= rest.size()) {
    const size_t end = std::min(rest.find(',', pos), rest.size());
    const std::string item = rest.substr(pos, end - pos);
    const size_t eq = item.find('=');
    TORCH_CHECK(eq != std::string::npos, op, ": algorithm variant item '", item, "' is not key=value");
    const std::string k = item.substr(0, eq), v = item.substr(eq + 1);
    auto old_new = [&]() {
      TORCH_CHECK(v == "old" || v == "new", op, ": algorithm variant ", k, " must be old or new, got '", v, "'");
      return v == "old" ? 1 : 2;
    };
    auto one_of = [&](std::initializer_list<int> allowed) {
      for (int x : allowed)
        if (v == std::to_string(x)) return x;
      TORCH_CHECK(false, op, ": algorithm variant ", k, " has an unsupported value '", v, "'");
      return 0;
    };
    if (k == "rows") {
      TORCH_CHECK(v == "old" || v == "new" || v == "smem" || v == "bulk", op,
                  ": algorithm variant rows must be old, new, smem or bulk, got '", v, "'");
      t.rows = v == "old" ? 1 : v == "new" ? 2 : v == "smem" ? 3 : 4;
    }
    else if (k == "cols") t.cols = old_new();
    else if (k == "cluster") t.cluster = one_of({4, 8, 16});
    else if (k == "stages") t.stages = one_of({1, 2, 3});
    else if (k == "col_rows_fwd") t.col_rows_fwd = one_of({4, 8, 16});
    else if (k == "col_rows_bwd") t.col_rows_bwd = one_of({4, 8, 16});
    else if (k == "grid") t.grid = one_of({1, 4});
    else TORCH_CHECK(false, op, ": unknown algorithm variant key '", k, "'");
    pos = end + 1;
  }
  return t;
}

SoftmaxAlgo parse_algorithm(const std::string& algorithm, const char* op) {
  if (algorithm == "auto") return SoftmaxAlgo::Auto;
  if (algorithm.rfind("auto:", 0) == 0) {
    parse_tuning(algorithm, op);
    return SoftmaxAlgo::Auto;
  }
  if (algorithm == "tree") return SoftmaxAlgo::Tree;
  if (algorithm == "shuffle") return SoftmaxAlgo::Shuffle;
  if (algorithm == "online") return SoftmaxAlgo::Online;
  TORCH_CHECK(false, op, ": algorithm must be one of 'auto', 'tree', 'shuffle', 'online', got '", algorithm, "'");
}

void check_backward(const at::Tensor& grad_out, const at::Tensor& out, const char* op) {
  const std::string g = std::string(op) + ": grad_out";
  const std::string o = std::string(op) + ": out";
  check_float(out, o.c_str());
  check_same_dtype(grad_out, out, g.c_str(), "out");
  check_same_device(grad_out, out, g.c_str(), "out");
  TORCH_CHECK(grad_out.sizes() == out.sizes(), op, ": grad_out has shape ", grad_out.sizes(), " but out has shape ",
              out.sizes());
}

// ---- CPU kernels ---------------------------------------------------------------
// One "line" per (outer, inner) pair, elements `inner` apart. Plain passes with
// double statistics (a float running sum of a million terms drifts by ~1e-4):
// this is the correctness oracle, not a speed target.

template <typename T>
void forward_cpu_kernel(const T* x, T* y, const Dims& d, bool log) {
  using A = double;
  const int64_t lines = d.outer * d.inner;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, d.N));
  at::parallel_for(0, lines, grain, [&](int64_t begin, int64_t end) {
    for (int64_t l = begin; l < end; ++l) {
      const int64_t base = (l / d.inner) * d.N * d.inner + l % d.inner;
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
    }
  });
}

// softmax: dx = y (dy - sum(dy y));  log_softmax: dx = dy - exp(y) sum(dy).
template <typename T>
void backward_cpu_kernel(const T* dy, const T* y, T* dx, const Dims& d, bool log) {
  using A = double;
  const int64_t lines = d.outer * d.inner;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, d.N));
  at::parallel_for(0, lines, grain, [&](int64_t begin, int64_t end) {
    for (int64_t l = begin; l < end; ++l) {
      const int64_t base = (l / d.inner) * d.N * d.inner + l % d.inner;
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
    }
  });
}

at::Tensor forward_cpu(const at::Tensor& x, int64_t dim, c10::string_view algorithm, bool log) {
  const char* op = log ? "log_softmax" : "softmax";
  check_float(x, log ? "log_softmax: x" : "softmax: x");
  const Dims d = canon(x, dim, op, "x");
  parse_algorithm(std::string(algorithm), op);
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options());
  if (x.numel() == 0) return y;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "softmax_cpu", [&] {
    forward_cpu_kernel<scalar_t>(xc.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), d, log);
  });
  return y;
}

at::Tensor backward_cpu(const at::Tensor& grad_out, const at::Tensor& out, int64_t dim, c10::string_view algorithm,
                        bool log) {
  const char* op = log ? "log_softmax_backward" : "softmax_backward";
  check_backward(grad_out, out, op);
  const Dims d = canon(out, dim, op, "out");
  parse_algorithm(std::string(algorithm), op);
  const at::Tensor g = grad_out.contiguous(), yc = out.contiguous();
  at::Tensor dx = at::empty(out.sizes(), out.options());
  if (out.numel() == 0) return dx;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "softmax_backward_cpu", [&] {
    backward_cpu_kernel<scalar_t>(g.data_ptr<scalar_t>(), yc.data_ptr<scalar_t>(), dx.data_ptr<scalar_t>(), d, log);
  });
  return dx;
}

at::Tensor softmax_cpu(const at::Tensor& x, int64_t dim, c10::string_view algorithm) {
  return forward_cpu(x, dim, algorithm, false);
}
at::Tensor log_softmax_cpu(const at::Tensor& x, int64_t dim, c10::string_view algorithm) {
  return forward_cpu(x, dim, algorithm, true);
}
at::Tensor softmax_backward_cpu(const at::Tensor& g, const at::Tensor& y, int64_t dim, c10::string_view algorithm) {
  return backward_cpu(g, y, dim, algorithm, false);
}
at::Tensor log_softmax_backward_cpu(const at::Tensor& g, const at::Tensor& y, int64_t dim,
                                    c10::string_view algorithm) {
  return backward_cpu(g, y, dim, algorithm, true);
}

#ifdef WITH_CUDA
// The teaching kernels only walk a contiguous last dim: move the reduced dim
// last through a copy (they are for the notebook, not for speed).
bool needs_move(const Dims& d, SoftmaxAlgo algo) { return algo != SoftmaxAlgo::Auto && d.inner != 1; }

at::Tensor run_cuda(const at::Tensor& a, const at::Tensor* b, const Dims& d0, SoftmaxAlgo algo, bool log,
                    bool backward, const SoftmaxTuning& tune) {
  Dims d = d0;
  const bool move = needs_move(d, algo);
  at::Tensor ac = move ? a.movedim(d.dim, -1).contiguous() : a.contiguous();
  at::Tensor bc;
  if (b) bc = move ? b->movedim(d.dim, -1).contiguous() : b->contiguous();
  if (move) d = Dims{ac.dim() - 1, d.N > 0 ? ac.numel() / d.N : 0, d.N, 1};
  at::Tensor out = at::empty(ac.sizes(), ac.options());
  if (ac.numel() > 0) {
    SoftmaxArgs args{ac.data_ptr(), bc.defined() ? bc.data_ptr() : nullptr, out.data_ptr(), d.outer, d.N, d.inner,
                     log, to_dtype(a.scalar_type()), tune};
    const int64_t wsb = softmax_workspace_bytes(args, algo, backward);
    at::Tensor ws = wsb > 0 ? at::empty({wsb}, a.options().dtype(at::kByte)) : at::Tensor();
    void* wp = ws.defined() ? ws.data_ptr() : nullptr;
    const cudaStream_t st = current_stream();
    GP_CUDA_CHECK_STATUS(backward ? softmax_backward_cuda(args, algo, wp, st) : softmax_forward_cuda(args, algo, wp, st));
  }
  return move ? out.movedim(-1, d0.dim).contiguous() : out;
}

at::Tensor forward_cuda(const at::Tensor& x, int64_t dim, c10::string_view algorithm, bool log) {
  const char* op = log ? "log_softmax" : "softmax";
  check_float(x, log ? "log_softmax: x" : "softmax: x");
  const Dims d = canon(x, dim, op, "x");
  const SoftmaxAlgo algo = parse_algorithm(std::string(algorithm), op);
  TORCH_CHECK(x.is_cuda(), op, ": x must be a CUDA tensor for the CUDA kernel, got ", x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  return run_cuda(x, nullptr, d, algo, log, false, parse_tuning(std::string(algorithm), op));
}

at::Tensor backward_cuda(const at::Tensor& grad_out, const at::Tensor& out, int64_t dim, c10::string_view algorithm,
                         bool log) {
  const char* op = log ? "log_softmax_backward" : "softmax_backward";
  check_backward(grad_out, out, op);
  const Dims d = canon(out, dim, op, "out");
  const SoftmaxAlgo algo = parse_algorithm(std::string(algorithm), op);
  const c10::cuda::CUDAGuard guard(out.device());
  return run_cuda(out, &grad_out, d, algo, log, true, parse_tuning(std::string(algorithm), op));
}

at::Tensor softmax_cuda(const at::Tensor& x, int64_t dim, c10::string_view algorithm) {
  return forward_cuda(x, dim, algorithm, false);
}
at::Tensor log_softmax_cuda(const at::Tensor& x, int64_t dim, c10::string_view algorithm) {
  return forward_cuda(x, dim, algorithm, true);
}
at::Tensor softmax_backward_cuda_op(const at::Tensor& g, const at::Tensor& y, int64_t dim, c10::string_view algorithm) {
  return backward_cuda(g, y, dim, algorithm, false);
}
at::Tensor log_softmax_backward_cuda_op(const at::Tensor& g, const at::Tensor& y, int64_t dim,
                                        c10::string_view algorithm) {
  return backward_cuda(g, y, dim, algorithm, true);
}
#endif

}  // namespace

TORCH_LIBRARY_IMPL(gpu_puzzles, CPU, m) {
  m.impl("softmax", &softmax_cpu);
  m.impl("log_softmax", &log_softmax_cpu);
  m.impl("softmax_backward", &softmax_backward_cpu);
  m.impl("log_softmax_backward", &log_softmax_backward_cpu);
}

#ifdef WITH_CUDA
TORCH_LIBRARY_IMPL(gpu_puzzles, CUDA, m) {
  m.impl("softmax", &softmax_cuda);
  m.impl("log_softmax", &log_softmax_cuda);
  m.impl("softmax_backward", &softmax_backward_cuda_op);
  m.impl("log_softmax_backward", &log_softmax_backward_cuda_op);
}
#endif

}  // namespace gpu_puzzles
