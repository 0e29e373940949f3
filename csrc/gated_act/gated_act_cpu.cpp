// gated_act CPU kernels: rows spread over threads, each row one loop in the accumulate
// type (at::opmath_type: float for the half types), which the compiler vectorises.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <cmath>

#include "common/cpu_grain.h"
#include "gated_act/gated_act.h"

namespace gpu_puzzles {
namespace {

template <typename A>
A act_only(A g, GatedAct act) {
  if (act == GatedAct::Silu) return g / (A(1) + std::exp(-g));
  if (act == GatedAct::GeluTanh) {
    const A k = A(0.7978845608028654), c = A(0.044715);
    return A(0.5) * g * (A(1) + std::tanh(k * (g + c * g * g * g)));
  }
  return A(0.5) * g * (A(1) + std::erf(g * A(0.7071067811865476)));
}

// act'(g), with act(g) written to *a.
template <typename A>
A act_grad(A g, GatedAct act, A* a) {
  if (act == GatedAct::Silu) {
    const A s = A(1) / (A(1) + std::exp(-g));
    *a = g * s;
    return s * (A(1) + g * (A(1) - s));
  }
  if (act == GatedAct::GeluTanh) {
    const A k = A(0.7978845608028654), c = A(0.044715);
    const A t = std::tanh(k * (g + c * g * g * g));
    *a = A(0.5) * g * (A(1) + t);
    return A(0.5) * (A(1) + t) + A(0.5) * g * (A(1) - t * t) * k * (A(1) + A(3) * c * g * g);
  }
  const A cdf = A(0.5) * (A(1) + std::erf(g * A(0.7071067811865476)));
  *a = g * cdf;
  return cdf + g * std::exp(A(-0.5) * g * g) * A(0.3989422804014327);
}

}  // namespace

void gated_act_forward_cpu_kernel(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& out, GatedAct act) {
  const int64_t I = gate.size(-1), rows = I == 0 ? 0 : gate.numel() / I;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, gate.scalar_type(), "gated_act", [&] {
    using A = at::opmath_type<scalar_t>;
    const scalar_t* g = gate.const_data_ptr<scalar_t>();
    const scalar_t* u = up.const_data_ptr<scalar_t>();
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_rows(I), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        for (int64_t i = r * I; i < (r + 1) * I; ++i)
          o[i] = static_cast<scalar_t>(act_only(static_cast<A>(g[i]), act) * static_cast<A>(u[i]));
    });
  });
}

void gated_act_backward_cpu_kernel(const at::Tensor& grad_out, const at::Tensor& gate, const at::Tensor& up,
                                   const at::Tensor& dgate, const at::Tensor& dup, GatedAct act) {
  const int64_t I = gate.size(-1), rows = I == 0 ? 0 : gate.numel() / I;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, gate.scalar_type(), "gated_act_backward", [&] {
    using A = at::opmath_type<scalar_t>;
    const scalar_t* d = grad_out.const_data_ptr<scalar_t>();
    const scalar_t* g = gate.const_data_ptr<scalar_t>();
    const scalar_t* u = up.const_data_ptr<scalar_t>();
    scalar_t* dg = dgate.mutable_data_ptr<scalar_t>();
    scalar_t* du = dup.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_rows(I), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        for (int64_t i = r * I; i < (r + 1) * I; ++i) {
          A a;
          const A grad = act_grad(static_cast<A>(g[i]), act, &a);
          const A dy = static_cast<A>(d[i]);
          dg[i] = static_cast<scalar_t>(dy * static_cast<A>(u[i]) * grad);
          du[i] = static_cast<scalar_t>(dy * a);
        }
    });
  });
}

}  // namespace gpu_puzzles
