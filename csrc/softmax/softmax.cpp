// softmax / log_softmax host side: argument checks, the CPU and CUDA calls and
// their registrations (the CPU kernels are in softmax_cpu.cpp). A tensor is viewed
// as (outer, N, inner) with N the size of the reduced dim; a 0-d tensor is one row
// of one element. Outputs are fresh contiguous tensors. On CUDA (auto algorithm) an
// input reduced over a last dim of stride 1 is taken without a copy when its outer
// dims collapse to two row strides; everything else is made contiguous first.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
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

// ---- CPU (kernels in softmax_cpu.cpp) -------------------------------------------

template <bool Log>
at::Tensor run_cpu(const at::Tensor& a, const at::Tensor* b, const Dims& d, bool backward) {
  const at::Tensor ac = a.contiguous();
  const at::Tensor bc = b ? b->contiguous() : at::Tensor();
  at::Tensor out = at::empty(a.sizes(), a.options());
  if (a.numel() == 0) return out;
  const SoftmaxArgs args{ac.data_ptr(),
                         bc.defined() ? bc.data_ptr() : nullptr,
                         out.data_ptr(),
                         d.outer,
                         d.N,
                         d.inner,
                         Log,
                         to_dtype(a.scalar_type()),
                         SoftmaxTuning{},
                         RowStrides{1, d.N, 0},
                         RowStrides{1, d.N, 0}};
  if (backward)
    GP_CPU_CALL(softmax_backward_cpu)(args);
  else
    GP_CPU_CALL(softmax_forward_cpu)(args);
  return out;
}

template <bool Log>
at::Tensor forward_cpu(const at::Tensor& x, int64_t dim, c10::string_view algorithm) {
  const Dims d = check_forward(x, dim, algorithm, Log).d;  // the CPU has one kernel for every algorithm
  return run_cpu<Log>(x, nullptr, d, false);
}

template <bool Log>
at::Tensor backward_cpu(const at::Tensor& grad_out, const at::Tensor& out, int64_t dim, c10::string_view algorithm) {
  const Dims d = check_backward(grad_out, out, dim, algorithm, Log).d;
  return run_cpu<Log>(out, &grad_out, d, true);
}

#ifdef WITH_CUDA
// The teaching kernels only walk a contiguous last dim: move the reduced dim
// last through a copy (they are for the notebook, not for speed).
bool needs_move(const Dims& d, SoftmaxAlgo algo) { return algo != SoftmaxAlgo::Auto && d.inner != 1; }

// The row starts of `t` when the auto row kernels can take it as it is: the
// reduced dim is the last with stride 1 (or of size 1), and the dims before it
// collapse to at most two levels of row strides. False: it needs a copy.
bool row_layout(const at::Tensor& t, const Dims& d, RowStrides& L) {
  if (t.dim() == 0 || d.inner != 1 || d.dim != t.dim() - 1) return false;
  if (d.N > 1 && t.stride(d.dim) != 1) return false;
  const int levels = collapse_rows(t.sizes().data(), t.strides().data(), d.dim, L);
  if (levels == 0) L = RowStrides{1, d.N, 0};  // one row: the contiguous layout's stride
  return levels >= 0;
}

at::Tensor run_cuda(const at::Tensor& a, const at::Tensor* b, const Dims& d0, SoftmaxAlgo algo, bool log,
                    bool backward) {
  Dims d = d0;
  const bool move = needs_move(d, algo);
  // The auto rows take strided inputs as they come (RowStrides); the rest is
  // made contiguous (a no-op when it already is).
  RowStrides la{1, d.N, 0}, lb{1, d.N, 0};
  const bool strided_ok = algo == SoftmaxAlgo::Auto;
  const bool keep_a = strided_ok && row_layout(a, d, la);
  const bool keep_b = strided_ok && b && row_layout(*b, d, lb);
  at::Tensor ac = move ? a.movedim(d.dim, -1).contiguous() : (keep_a ? a : a.contiguous());
  at::Tensor bc;
  if (b) bc = move ? b->movedim(d.dim, -1).contiguous() : (keep_b ? *b : b->contiguous());
  if (!keep_a) la = RowStrides{1, d.N, 0};
  if (!keep_b) lb = RowStrides{1, d.N, 0};
  if (move) d = Dims{ac.dim() - 1, d.N > 0 ? ac.numel() / d.N : 0, d.N, 1};
  at::Tensor out = at::empty(ac.sizes(), ac.options());  // contiguous, whatever the layout of ac
  if (ac.numel() > 0) {
    SoftmaxArgs args{ac.data_ptr(),
                     bc.defined() ? bc.data_ptr() : nullptr,
                     out.data_ptr(),
                     d.outer,
                     d.N,
                     d.inner,
                     log,
                     to_dtype(a.scalar_type()),
                     softmax_tuning(),
                     la,
                     lb};
    const int64_t wsb = softmax_workspace_bytes(args, algo, backward);
    at::Tensor ws = wsb > 0 ? at::empty({wsb}, a.options().dtype(at::kByte)) : at::Tensor();
    void* wp = ws.defined() ? ws.data_ptr() : nullptr;
    const cudaStream_t st = current_stream();
    GP_CUDA_CHECK_STATUS(backward ? softmax_backward_cuda(args, algo, wp, st)
                                  : softmax_forward_cuda(args, algo, wp, st));
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
