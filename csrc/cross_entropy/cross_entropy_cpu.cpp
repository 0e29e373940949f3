// Cross-entropy CPU kernels, compiled once per SIMD level (common/cpu_isa.h); float and
// double logits (the host converts half types). Rows in parallel; each row is read
// twice (max, then the exp sum) while it sits in cache, rather than once with the
// running-max rescales the GPU kernel uses. kCap: the logits soft-capped as they are
// read (z = c * tanh(x / c); CeFwdArgs).
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <type_traits>

#include "common/cpu_vec.h"
#include "cross_entropy/cross_entropy.h"

namespace gpu_puzzles {
namespace GP_CPU_NS {
namespace {

using namespace vec_loops;

inline int64_t target_of(const void* t, bool t64, const RowStrides& ts, int64_t r) {
  const int64_t off = row_offset(ts, r);
  return t64 ? static_cast<const int64_t*>(t)[off] : static_cast<int64_t>(static_cast<const int32_t*>(t)[off]);
}

// z = c * tanh(x / c), vector and scalar; the identity without a cap.
template <typename S, bool kCap>
struct Cap {
  using Vv = Vectorized<S>;
  S c, inv;
  Vv vc, vinv;
  explicit Cap(double softcap)
      : c(S(softcap)), inv(kCap ? S(1.0 / softcap) : S(0)), vc(S(softcap)), vinv(kCap ? S(1.0 / softcap) : S(0)) {}
  S operator()(S x) const { return kCap ? c * std::tanh(x * inv) : x; }
  Vv operator()(const Vv& x) const { return kCap ? (x * vinv).tanh() * vc : x; }
};

// f(r, t, x): each row r with its target t and its logits x, rows split over the threads.
template <typename S, typename Args, typename F>
void each_row(const Args& a, F&& f) {
  at::parallel_for(0, a.rows, grain_rows(a.V), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      f(r, target_of(a.target, a.target64, a.ts, r), static_cast<const S*>(a.logits) + row_offset(a.ls, r));
  });
}

template <typename S, bool kCap>
void forward_rows(const CeFwdArgs& a) {
  using Vv = Vectorized<S>;
  const Cap<S, kCap> cap(a.softcap);
  S* loss = static_cast<S*>(a.loss);
  S* lse_out = static_cast<S*>(a.lse);
  const int64_t V = a.V;
  each_row<S>(a, [&](int64_t r, int64_t t, const S* x) {
    if (t == a.ignore_index) {
      loss[r] = S(0);
      lse_out[r] = S(0);
      return;
    }
    // The cap is monotonic: the capped max is the max's cap.
    const S m = cap(row_max(x, V));
    // m = +-inf or NaN: x - m is NaN somewhere (or everywhere), so lse is NaN, as in PyTorch.
    const Vv vm(m);
    const double s = vsum<S>(
        V, [&](int64_t i) { return (cap(Vv::loadu(x + i)) - vm).exp(); },
        [&](int64_t i) { return std::exp(cap(x[i]) - m); });
    const S l = m + static_cast<S>(std::log(s));
    lse_out[r] = l;
    loss[r] = (t >= 0 && t < V) ? l - cap(x[t]) : std::numeric_limits<S>::quiet_NaN();
  });
}

template <typename S, bool kCap>
void backward_rows(const CeBwdArgs& a) {
  using Vv = Vectorized<S>;
  const Cap<S, kCap> cap(a.softcap);
  const S* lse = static_cast<const S*>(a.lse);
  const S* scale = static_cast<const S*>(a.scale);
  const int64_t V = a.V;
  each_row<S>(a, [&](int64_t r, int64_t t, const S* x) {
    S* y = static_cast<S*>(a.grad) + r * a.grad_stride;
    if (t == a.ignore_index) {
      std::fill(y, y + V, S(0));
      return;
    }
    const S l = lse[r], g = scale[a.scale_per_row ? r : 0];
    const S xt = (t >= 0 && t < V) ? x[t] : S(0);  // read before an in-place write
    const Vv vl(l), vg(g), one(S(1));
    if (kCap) {  // z = c * th, dz/dx = 1 - th^2
      vfor<S>(
          V,
          [&](int64_t i) {
            const Vv th = (Vv::loadu(x + i) * cap.vinv).tanh();
            ((th * cap.vc - vl).exp() * vg * (one - th * th)).store(y + i);
          },
          [&](int64_t i) {
            const S th = std::tanh(x[i] * cap.inv);
            y[i] = std::exp(cap.c * th - l) * g * (S(1) - th * th);
          });
      if (t >= 0 && t < V) {
        const S th = std::tanh(xt * cap.inv);
        y[t] = (std::exp(cap.c * th - l) - S(1)) * g * (S(1) - th * th);
      }
      return;
    }
    vfor<S>(
        V, [&](int64_t i) { ((Vv::loadu(x + i) - vl).exp() * vg).store(y + i); },
        [&](int64_t i) { y[i] = std::exp(x[i] - l) * g; });
    if (t >= 0 && t < V) y[t] = (std::exp(xt - l) - S(1)) * g;
  });
}

// f(s, cap): f for a's element type (s: a value of it, float or double) and softcap
// (cap: a std::bool_constant).
template <typename Args, typename F>
void dispatch_rows(const Args& a, F&& f) {
  const bool cap = a.softcap > 0;
  if (a.dtype == DType::Float64)
    cap ? f(double(), std::true_type{}) : f(double(), std::false_type{});
  else
    cap ? f(float(), std::true_type{}) : f(float(), std::false_type{});
}

}  // namespace

void cross_entropy_forward_cpu(const CeFwdArgs& a) {
  dispatch_rows(a, [&](auto s, auto cap) { forward_rows<decltype(s), decltype(cap)::value>(a); });
}

void cross_entropy_backward_cpu(const CeBwdArgs& a) {
  dispatch_rows(a, [&](auto s, auto cap) { backward_rows<decltype(s), decltype(cap)::value>(a); });
}

}  // namespace GP_CPU_NS
}  // namespace gpu_puzzles
