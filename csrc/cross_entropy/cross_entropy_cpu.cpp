// Cross-entropy CPU kernels, compiled once per SIMD level (common/cpu_isa.h); float and
// double logits (the host converts half types). Rows in parallel; each row is read
// twice (max, then the exp sum) while it sits in cache, rather than once with the
// running-max rescales the GPU kernel uses.
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>

#include "common/cpu_vec.h"
#include "cross_entropy/cross_entropy.h"

namespace gpu_puzzles {
namespace GP_CPU_NS {
namespace {

using namespace vec_loops;

inline int64_t offset_of(const RowStrides& L, int64_t r) {
  return L.n1 == 1 ? r * L.s0 : (r / L.n1) * L.s0 + (r % L.n1) * L.s1;
}

inline int64_t target_of(const void* t, bool t64, const RowStrides& ts, int64_t r) {
  const int64_t off = offset_of(ts, r);
  return t64 ? static_cast<const int64_t*>(t)[off] : static_cast<int64_t>(static_cast<const int32_t*>(t)[off]);
}

template <typename S>
void forward_rows(const CeFwdArgs& a) {
  using Vv = Vectorized<S>;
  const S* logits = static_cast<const S*>(a.logits);
  S* loss = static_cast<S*>(a.loss);
  S* lse_out = static_cast<S*>(a.lse);
  const int64_t V = a.V;
  at::parallel_for(0, a.rows, grain_rows(V), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t t = target_of(a.target, a.target64, a.ts, r);
      if (t == a.ignore_index) {
        loss[r] = S(0);
        lse_out[r] = S(0);
        continue;
      }
      const S* x = logits + offset_of(a.ls, r);
      const S m = row_max(x, V);
      // m = +-inf or NaN: x - m is NaN somewhere (or everywhere), so lse is NaN, as in PyTorch.
      const Vv vm(m);
      const double s = vsum<S>(
          V, [&](int64_t i) { return (Vv::loadu(x + i) - vm).exp(); }, [&](int64_t i) { return std::exp(x[i] - m); });
      const S l = m + static_cast<S>(std::log(s));
      lse_out[r] = l;
      loss[r] = (t >= 0 && t < V) ? l - x[t] : std::numeric_limits<S>::quiet_NaN();
    }
  });
}

template <typename S>
void backward_rows(const CeBwdArgs& a) {
  using Vv = Vectorized<S>;
  const S* logits = static_cast<const S*>(a.logits);
  S* grad = static_cast<S*>(a.grad);
  const S* lse = static_cast<const S*>(a.lse);
  const S* scale = static_cast<const S*>(a.scale);
  const int64_t V = a.V;
  at::parallel_for(0, a.rows, grain_rows(V), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t t = target_of(a.target, a.target64, a.ts, r);
      S* y = grad + r * a.grad_stride;
      if (t == a.ignore_index) {
        std::fill(y, y + V, S(0));
        continue;
      }
      const S* x = logits + offset_of(a.ls, r);
      const S l = lse[r], g = scale[a.scale_per_row ? r : 0];
      const S xt = (t >= 0 && t < V) ? x[t] : S(0);  // read before an in-place write
      const Vv vl(l), vg(g);
      vfor<S>(
          V, [&](int64_t i) { ((Vv::loadu(x + i) - vl).exp() * vg).store(y + i); },
          [&](int64_t i) { y[i] = std::exp(x[i] - l) * g; });
      if (t >= 0 && t < V) y[t] = (std::exp(xt - l) - S(1)) * g;
    }
  });
}

}  // namespace

void cross_entropy_forward_cpu(const CeFwdArgs& a) {
  if (a.dtype == DType::Float64)
    forward_rows<double>(a);
  else
    forward_rows<float>(a);
}

void cross_entropy_backward_cpu(const CeBwdArgs& a) {
  if (a.dtype == DType::Float64)
    backward_rows<double>(a);
  else
    backward_rows<float>(a);
}

}  // namespace GP_CPU_NS
}  // namespace gpu_puzzles
