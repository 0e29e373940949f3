// rotary host side: argument checks and the CPU/CUDA registrations (the CPU kernel is in
// rotary_cpu.cpp, the CUDA one in rotary_cuda.cu). q and k are read in place through up to
// three row strides (the (B, H, S, D) views of a projection's output); cos and sin through
// the strides of their broadcast over q's and k's rows, so (B, 1, S, R) is never expanded.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>
#include <tuple>

#include "common/checks.h"
#include "common/cuda_launch.h"
#include "common/register.h"
#include "rotary/rotary.h"

namespace gpu_puzzles {
namespace {

constexpr int64_t kMaxDims = 4;

// The last dim unit-stride (a copy where it is not).
at::Tensor unit_inner(const at::Tensor& t) { return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous(); }

// x's rows, x given with 1 to 4 dims: leading dims of size 1 prepended.
RotaryRows rows_of(const at::Tensor& x) {
  int64_t n[3] = {1, 1, 1}, s[3] = {0, 0, 0};
  for (int64_t d = 0; d < x.dim() - 1; ++d) {
    const int64_t k = 3 - (x.dim() - 1) + d;
    n[k] = x.size(d);
    s[k] = x.stride(d);
  }
  RotaryRows r;
  r.n1 = n[1];
  r.n2 = n[2];
  r.s0 = s[0];
  r.s1 = s[1];
  r.s2 = s[2];
  return r;
}

// cos's (or sin's) strides over x's rows: 0 along the dims it broadcasts over; an error
// naming it where its shape does not broadcast to x's.
RotaryRows broadcast_rows(const at::Tensor& c, const char* cname, const at::Tensor& x, const char* xname,
                          const char* op) {
  TORCH_CHECK(c.dim() <= x.dim(), op, ": ", cname, " has shape ", c.sizes(), ", which does not broadcast over ", xname,
              "'s shape ", x.sizes(), " (more dims)");
  RotaryRows r = rows_of(x);
  int64_t s[3] = {0, 0, 0};
  const int64_t lead = x.dim() - 1, clead = c.dim() - 1;
  for (int64_t d = 0; d < clead; ++d) {
    const int64_t xd = lead - clead + d;  // the dim of x this dim of c lines up with
    TORCH_CHECK(c.size(d) == 1 || c.size(d) == x.size(xd), op, ": ", cname, " has shape ", c.sizes(),
                ", which does not broadcast over ", xname, "'s shape ", x.sizes(), " (dim ", d, ")");
    if (c.size(d) != 1) s[3 - lead + xd] = c.stride(d);
  }
  r.s0 = s[0];
  r.s1 = s[1];
  r.s2 = s[2];
  return r;
}

// The dtype of the output (forward) or of the gradient coming in (backward): PyTorch's
// promotion of x's with cos's.
at::ScalarType promoted(at::ScalarType x, const at::Tensor& cos) { return cos.scalar_type() == x ? x : at::kFloat; }

struct Checked {
  at::Tensor x[2], cos, sin;
  at::ScalarType in, out;
};

// x: q and k (forward) or their outputs' gradients (backward); dtype: q's and k's dtype.
Checked check(const at::Tensor& x0, const at::Tensor& x1, const at::Tensor& cos, const at::Tensor& sin,
              at::ScalarType dtype, bool backward) {
  const char* op = backward ? "rotary_backward" : "rotary";
  const std::string o(op);
  const char* n0 = backward ? "grad_q" : "q";
  const char* n1 = backward ? "grad_k" : "k";
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{x0, n0}, {x1, n1}}) {
    check_float(t, (o + ": " + name).c_str());
    TORCH_CHECK(t.dim() >= 1 && t.dim() <= kMaxDims, op, ": ", name, " must have 1 to 4 dimensions (..., D), got ",
                t.dim(), " (shape ", t.sizes(), ")");
  }
  check_same_dtype(x1, x0, (o + ": " + n1).c_str(), n0);
  check_same_device(x1, x0, (o + ": " + n1).c_str(), n0);
  TORCH_CHECK(x1.size(-1) == x0.size(-1), op, ": ", n1, " has ", x1.size(-1), " elements in its last dim but ", n0,
              " has ", x0.size(-1), "; they must match");
  check_float(cos, (o + ": cos").c_str());
  check_same_dtype(sin, cos, (o + ": sin").c_str(), "cos");
  check_same_device(cos, x0, (o + ": cos").c_str(), n0);
  check_same_device(sin, x0, (o + ": sin").c_str(), n0);
  TORCH_CHECK(sin.sizes() == cos.sizes(), op, ": sin has shape ", sin.sizes(), " but cos has shape ", cos.sizes(),
              "; they must match");
  TORCH_CHECK(cos.dim() >= 1, op, ": cos must have at least one dimension (..., R), got a 0-d tensor");
  const int64_t R = cos.size(-1), D = x0.size(-1);
  TORCH_CHECK(R >= 2 && R % 2 == 0 && R <= D, op, ": cos's last dim (the rotated width) must be even, at least 2 and ",
              "at most ", n0, "'s last dim ", D, ", got ", R);
  TORCH_CHECK(cos.scalar_type() == dtype || (is_half(dtype) && cos.scalar_type() == at::kFloat), op,
              ": cos must have q's dtype ", dtype, " (or float32 where q is float16 or bfloat16), got ",
              cos.scalar_type());
  Checked c{{unit_inner(x0), unit_inner(x1)}, unit_inner(cos), unit_inner(sin), x0.scalar_type(), dtype};
  if (backward) {
    TORCH_CHECK(x0.scalar_type() == promoted(dtype, cos), op, ": grad_q must have the forward output's dtype ",
                promoted(dtype, cos), ", got ", x0.scalar_type());
  } else {
    c.out = promoted(dtype, cos);
  }
  return c;
}

std::tuple<at::Tensor, at::Tensor> run(const Checked& c, bool backward) {
  const char* names[2] = {backward ? "grad_q" : "q", backward ? "grad_k" : "k"};
  RotaryArgs a{};
  at::Tensor out[2];
  for (int i = 0; i < 2; ++i) {
    const at::Tensor& x = c.x[i];
    out[i] = at::empty(x.sizes(), x.options().dtype(c.out));
    RotaryOperand& o = a.op[i];
    o.x = x.data_ptr();
    o.out = out[i].data_ptr();
    o.xr = rows_of(x);
    const char* op = backward ? "rotary_backward" : "rotary";
    o.cr = broadcast_rows(c.cos, "cos", x, names[i], op);
    o.sr = broadcast_rows(c.sin, "sin", x, names[i], op);
    o.rows = x.numel() / x.size(-1);
  }
  a.cos = c.cos.data_ptr();
  a.sin = c.sin.data_ptr();
  a.D = c.x[0].size(-1);
  a.R = c.cos.size(-1);
  a.backward = backward;
  a.in = to_dtype(c.in);
  a.cs = to_dtype(c.cos.scalar_type());
  a.out = to_dtype(c.out);
  if (c.x[0].is_cuda()) {
#ifdef WITH_CUDA
    const c10::cuda::CUDAGuard guard(c.x[0].device());
    GP_CUDA_CHECK_STATUS(rotary_cuda(a, c.x[0].get_device(), current_stream()));
#endif
  } else {
    rotary_cpu_kernel(a);
  }
  return {out[0], out[1]};
}

std::tuple<at::Tensor, at::Tensor> rotary_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                               const at::Tensor& sin) {
  return run(check(q, k, cos, sin, q.scalar_type(), false), false);
}

std::tuple<at::Tensor, at::Tensor> rotary_backward_impl(const at::Tensor& grad_q, const at::Tensor& grad_k,
                                                        const at::Tensor& cos, const at::Tensor& sin,
                                                        at::ScalarType dtype) {
  TORCH_CHECK(is_supported_float(dtype), "rotary_backward: dtype must be float32, float64, float16 or bfloat16, got ",
              dtype);
  return run(check(grad_q, grad_k, cos, sin, dtype, true), true);
}

}  // namespace

// One host function for both devices: the kernel call is the only difference.
TORCH_LIBRARY_FRAGMENT(gpu_puzzles, m) {
  GP_IMPL(m, "rotary", rotary_impl, rotary_impl);
  GP_IMPL(m, "rotary_backward", rotary_backward_impl, rotary_backward_impl);
}

}  // namespace gpu_puzzles
