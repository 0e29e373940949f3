// gated_act CPU kernels, one copy per SIMD level (common/cpu_isa.h): rows spread over the
// threads, each row in at::vec vectors of the compute type (float for the half types) whose
// exp, tanh and erf are ATen's vectorised ones. The row's tail is a partial vector, so every
// element takes the same path. gate, up and grad_out rows are read where they lie.
#include <ATen/Parallel.h>

#include <algorithm>

#include "common/cpu_vec.h"
#include "gated_act/gated_act.h"

namespace gpu_puzzles {
namespace GP_CPU_NS {
namespace {

using vec_loops::compute_t;
using vec_loops::RowIn;
using vec_loops::RowOut;
using vec_loops::Vectorized;

// act(g) on a vector.
template <GatedAct ACT, typename V>
V act_fwd(const V& g) {
  if constexpr (ACT == GatedAct::Silu) {
    return g / (V(1) + g.neg().exp());
  } else if constexpr (ACT == GatedAct::GeluTanh) {
    const V k(0.7978845608028654), c(0.044715);
    return V(0.5) * g * (V(1) + (k * (g + c * g * g * g)).tanh());
  } else {
    return V(0.5) * g * (V(1) + (g * V(0.7071067811865476)).erf());
  }
}

// act'(g), with act(g) written to a.
template <GatedAct ACT, typename V>
V act_bwd(const V& g, V& a) {
  if constexpr (ACT == GatedAct::Silu) {
    const V s = V(1) / (V(1) + g.neg().exp());
    a = g * s;
    return s * (V(1) + g * (V(1) - s));
  } else if constexpr (ACT == GatedAct::GeluTanh) {
    const V k(0.7978845608028654), c(0.044715);
    const V t = (k * (g + c * g * g * g)).tanh();
    a = V(0.5) * g * (V(1) + t);
    return V(0.5) * (V(1) + t) + V(0.5) * g * (V(1) - t * t) * k * (V(1) + V(3) * c * g * g);
  } else {
    const V cdf = V(0.5) * (V(1) + (g * V(0.7071067811865476)).erf());
    a = g * cdf;
    return cdf + g * (V(-0.5) * g * g).exp() * V(0.3989422804014327);
  }
}

// The forward (out = act(g) * u) or the backward (dgate into out, dup) over the rows.
template <GatedAct ACT, typename T, bool BWD>
void rows(const GatedActArgs& a) {
  using S = compute_t<T>;
  using V = Vectorized<S>;
  constexpr int64_t W = V::size();
  at::parallel_for(0, a.rows, grain_rows(a.I), [&](int64_t r0, int64_t r1) {
    RowIn<T, S> gin(a.I), uin(a.I), din(BWD ? a.I : 0);
    RowOut<T, S> yout(a.I), duout(BWD ? a.I : 0);
    for (int64_t r = r0; r < r1; ++r) {
      const S* g = gin.get(static_cast<const T*>(a.gate) + row_offset(a.gs, r));
      const S* u = uin.get(static_cast<const T*>(a.up) + row_offset(a.us, r));
      S* y = yout.get(static_cast<T*>(a.out) + r * a.I);
      const S* d = nullptr;
      S* du = nullptr;
      if constexpr (BWD) {
        d = din.get(static_cast<const T*>(a.grad_out) + row_offset(a.ds, r));
        du = duout.get(static_cast<T*>(a.dup) + r * a.I);
      }
      for (int64_t i = 0; i < a.I; i += W) {
        const int n = static_cast<int>(std::min(W, a.I - i));
        const V gv = V::loadu(g + i, n), uv = V::loadu(u + i, n);
        if constexpr (BWD) {
          V act;
          const V grad = act_bwd<ACT>(gv, act);
          const V dy = V::loadu(d + i, n);
          (dy * uv * grad).store(y + i, n);
          (dy * act).store(du + i, n);
        } else {
          (act_fwd<ACT>(gv) * uv).store(y + i, n);
        }
      }
      yout.put();
      if constexpr (BWD) duout.put();
    }
  });
}

// rows<ACT, T, BWD> for the args' activation and dtype.
template <bool BWD>
void dispatch(const GatedActArgs& a) {
  vec_loops::dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    switch (a.act) {
      case GatedAct::Silu:
        return rows<GatedAct::Silu, T, BWD>(a);
      case GatedAct::GeluTanh:
        return rows<GatedAct::GeluTanh, T, BWD>(a);
      case GatedAct::Gelu:
        return rows<GatedAct::Gelu, T, BWD>(a);
    }
  });
}

}  // namespace

void gated_act_forward_cpu(const GatedActArgs& a) { dispatch<false>(a); }
void gated_act_backward_cpu(const GatedActArgs& a) { dispatch<true>(a); }

}  // namespace GP_CPU_NS
}  // namespace gpu_puzzles
