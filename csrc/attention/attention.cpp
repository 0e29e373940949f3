// attention host side: argument checks, the CUDA wrappers and the registrations
// (the CPU kernels: attention_cpu.cpp), for the fused op (attention, attention_backward) and the
// curriculum's chain (transpose_last2, matmul; softmax is the softmax op's).
// Shapes: the seed's vector form q (D,) k (S, D) v (S, Dv) is B = H = 1, Sq = 1;
// q (..., Sq, D), k (..., Sk, D), v (..., Sk, Dv) have equal leading dims, the last of them
// the heads H and the ones before it the batch B; with enable_gqa (SDPA's), k and v may
// have Hkv heads, Hkv dividing H (grouped-query attention; attention.h), never repeated.
// The CUDA kernels read every operand where it lies, through its (batch, head, row)
// strides (attention.h); the CPU kernels take contiguous (BH, S, D) copies. Outputs follow
// their input's memory order on both (empty_in_order_of; the fake kernels in
// gpu_puzzles/ops/attention.py do the same).
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <tuple>
#include <vector>

#include "attention/attention.h"
#include "attention/attention_unfused.h"
#include "common/checks.h"
#include "common/register.h"
#include "common/cuda_launch.h"

namespace gpu_puzzles {
namespace {

struct AttnShape {
  int64_t B, H, Hkv, BH, BHkv, Sq, Sk, D, Dv;  // BH = B * H, BHkv = B * Hkv
  std::vector<int64_t> out_shape;              // q.shape[:-1] + (Dv,)
  std::vector<int64_t> lse_shape;              // q.shape[:-1]
};

AttnShape check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool enable_gqa, const char* op) {
  const std::string p(op);
  check_float(q, (p + ": q").c_str());
  check_same_dtype(k, q, (p + ": k").c_str(), "q");
  check_same_dtype(v, q, (p + ": v").c_str(), "q");
  check_same_device(k, q, (p + ": k").c_str(), "q");
  check_same_device(v, q, (p + ": v").c_str(), "q");
  AttnShape s{};
  if (q.dim() == 1) {  // the seed's vector form
    TORCH_CHECK(k.dim() == 2 && v.dim() == 2, op, ": for a 1-D q (D,), k and v must be 2-D (S, D), got k shape ",
                k.sizes(), " and v shape ", v.sizes());
    s.Sq = 1;
  } else {
    TORCH_CHECK(q.dim() >= 2, op, ": q must be (D,) or (..., Sq, D), got a 0-d tensor");
    TORCH_CHECK(k.dim() == q.dim(), op, ": k must have as many dims as q (", q.dim(), "), got shape ", k.sizes(),
                " (q shape ", q.sizes(), ")");
    TORCH_CHECK(v.dim() == q.dim(), op, ": v must have as many dims as q (", q.dim(), "), got shape ", v.sizes(),
                " (q shape ", q.sizes(), ")");
    // The batch dims (all but the heads, dim -3) equal; the heads checked below.
    const int64_t nb = std::max<int64_t>(q.dim() - 3, 0);
    const auto batch = q.sizes().slice(0, nb);
    TORCH_CHECK(k.sizes().slice(0, nb) == batch, op, ": k has leading dims ", k.sizes().slice(0, k.dim() - 2),
                " but q has ", q.sizes().slice(0, q.dim() - 2), "; they must be equal");
    TORCH_CHECK(v.sizes().slice(0, nb) == batch, op, ": v has leading dims ", v.sizes().slice(0, v.dim() - 2),
                " but q has ", q.sizes().slice(0, q.dim() - 2), "; they must be equal");
    s.Sq = q.size(-2);
  }
  s.H = q.dim() >= 3 ? q.size(-3) : 1;
  s.Hkv = q.dim() >= 3 ? k.size(-3) : 1;
  s.B = q.dim() >= 3 ? c10::multiply_integers(q.sizes().slice(0, q.dim() - 3)) : 1;
  if (q.dim() >= 3) {
    TORCH_CHECK(v.size(-3) == s.Hkv, op, ": v has ", v.size(-3), " heads (dim -3) but k has ", s.Hkv,
                "; they must be equal (k shape ", k.sizes(), ", v shape ", v.sizes(), ")");
    if (enable_gqa) {
      TORCH_CHECK(s.Hkv == s.H || (s.Hkv >= 1 && s.H % s.Hkv == 0), op, ": with enable_gqa, q's heads (", s.H,
                  ") must be a multiple of k's and v's heads (", s.Hkv, ", dim -3; q shape ", q.sizes(), ", k shape ",
                  k.sizes(), ")");
    } else {
      TORCH_CHECK(s.Hkv == s.H, op, ": k has ", s.Hkv, " heads (dim -3) but q has ", s.H,
                  "; they must be equal, or pass enable_gqa=True for grouped k/v heads (q shape ", q.sizes(),
                  ", k shape ", k.sizes(), ")");
    }
  }
  s.BH = s.B * s.H;
  s.BHkv = s.B * s.Hkv;
  s.D = q.size(-1);
  s.Sk = k.size(-2);
  s.Dv = v.size(-1);
  TORCH_CHECK(s.D >= 1, op, ": q must have a head dim >= 1, got shape ", q.sizes());
  TORCH_CHECK(k.size(-1) == s.D, op, ": k has head dim ", k.size(-1), " but q has head dim ", s.D, " (q shape ",
              q.sizes(), ", k shape ", k.sizes(), ")");
  TORCH_CHECK(v.size(-2) == s.Sk, op, ": v has sequence length ", v.size(-2), " but k has ", s.Sk, " (k shape ",
              k.sizes(), ", v shape ", v.sizes(), ")");
  if (q.is_cuda()) {
    TORCH_CHECK(s.D <= kAttentionMaxHeadDim, op, ": q head dim ", s.D, " exceeds ", kAttentionMaxHeadDim,
                ", the largest the CUDA kernels take");
    TORCH_CHECK(s.Dv <= kAttentionMaxHeadDim, op, ": v head dim ", s.Dv, " exceeds ", kAttentionMaxHeadDim,
                ", the largest the CUDA kernels take");
  }
  s.lse_shape = q.sizes().slice(0, q.dim() - 1).vec();
  s.out_shape = s.lse_shape;
  s.out_shape.push_back(s.Dv);
  return s;
}

double resolve_scale(c10::optional<double> scale, int64_t D) {
  return scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(D));
}

at::ScalarType lse_dtype(at::ScalarType t) { return acc_type(t); }

// Contiguous (rows, S, D) with a 16-byte aligned base (a contiguous view can
// start mid-allocation; the CPU kernels may use vector loads): the CPU kernels' layout.
at::Tensor as_3d(const at::Tensor& t, int64_t BH, int64_t S, int64_t D) {
  at::Tensor c = t.reshape({BH, S, D}).contiguous();
  if (!aligned16(c.data_ptr()) && c.numel() > 0) c = c.clone();
  return c;
}

// An empty tensor of `sizes` laid out densely in x's memory order: x's leading dims
// ordered by decreasing stride (ties keep their order), its last dim innermost. So out,
// dq, dk and dv of views transposed out of a (B, S, H, D) projection are (B, S, H, D) in
// memory too, and the model's transpose back is a view, as SDPA's outputs are.
at::Tensor empty_in_order_of(const at::Tensor& x, at::IntArrayRef sizes, const at::TensorOptions& opts) {
  const int64_t n = x.dim();
  std::vector<int64_t> perm(n), strides(n);
  std::iota(perm.begin(), perm.end(), 0);
  if (n > 1)
    std::stable_sort(perm.begin(), perm.end() - 1, [&](int64_t a, int64_t b) { return x.stride(a) > x.stride(b); });
  int64_t run = 1;
  for (int64_t i = n - 1; i >= 0; --i) {
    strides[perm[i]] = run;
    run *= std::max<int64_t>(sizes[perm[i]], 1);
  }
  return at::empty_strided(sizes, strides, opts);
}

// The CPU kernels write contiguous (BH, S, Dl): into t itself where it is contiguous,
// else into a scratch that cpu_finish copies into t.
at::Tensor cpu_out_3d(const at::Tensor& t, int64_t BH, int64_t S, int64_t Dl) {
  return t.is_contiguous() ? t.view({BH, S, Dl}) : at::empty({BH, S, Dl}, t.options());
}
void cpu_finish(at::Tensor& t, const at::Tensor& buf) {
  if (!t.is_contiguous()) t.copy_(buf.view(t.sizes()));
}

// The backward's arguments: q, k, v as the forward's, then grad_out, out and lse.
AttnShape check_backward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& out, const at::Tensor& lse, bool enable_gqa) {
  const char* op = "attention_backward";
  AttnShape s = check_qkv(q, k, v, enable_gqa, op);
  TORCH_CHECK(grad_out.sizes() == at::IntArrayRef(s.out_shape), op, ": grad_out has shape ", grad_out.sizes(),
              " but the output has shape ", at::IntArrayRef(s.out_shape));
  TORCH_CHECK(out.sizes() == at::IntArrayRef(s.out_shape), op, ": out has shape ", out.sizes(),
              " but the output has shape ", at::IntArrayRef(s.out_shape));
  TORCH_CHECK(lse.sizes() == at::IntArrayRef(s.lse_shape), op, ": lse has shape ", lse.sizes(), " but expected ",
              at::IntArrayRef(s.lse_shape));
  check_same_dtype(grad_out, q, "attention_backward: grad_out", "q");
  check_same_dtype(out, q, "attention_backward: out", "q");
  TORCH_CHECK(lse.scalar_type() == lse_dtype(q.scalar_type()), op, ": lse must be ", lse_dtype(q.scalar_type()),
              " for a ", q.scalar_type(), " q, got ", lse.scalar_type());
  check_same_device(grad_out, q, "attention_backward: grad_out", "q");
  check_same_device(out, q, "attention_backward: out", "q");
  check_same_device(lse, q, "attention_backward: lse", "q");
  return s;
}

// dq, dk, dv in the memory order of q, k, v.
std::tuple<at::Tensor, at::Tensor, at::Tensor> empty_grads(const at::Tensor& q, const at::Tensor& k,
                                                           const at::Tensor& v) {
  return {empty_in_order_of(q, q.sizes(), q.options()), empty_in_order_of(k, k.sizes(), q.options()),
          empty_in_order_of(v, v.sizes(), q.options())};
}

at::Tensor to_float(const at::Tensor& t) { return t.to(at::kFloat); }

// The CPU kernels compute in float32 or float64; half inputs (as torch.autocast hands them
// over on the CPU) are computed in float32 and the results rounded to their dtype.
std::tuple<at::Tensor, at::Tensor> attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 c10::optional<double> scale, bool causal, bool enable_gqa) {
  const AttnShape s = check_qkv(q, k, v, enable_gqa, "attention");
  if (is_half(q.scalar_type())) {
    auto [o, l] = attention_cpu(to_float(q), to_float(k), to_float(v), scale, causal, enable_gqa);
    return {o.to(q.scalar_type()), l};
  }
  const double sc = resolve_scale(scale, s.D);
  const at::Tensor qc = as_3d(q, s.BH, s.Sq, s.D), kc = as_3d(k, s.BHkv, s.Sk, s.D), vc = as_3d(v, s.BHkv, s.Sk, s.Dv);
  at::Tensor out = empty_in_order_of(q, s.out_shape, q.options());
  at::Tensor o3 = cpu_out_3d(out, s.BH, s.Sq, s.Dv);
  at::Tensor lse = at::empty({s.BH, s.Sq}, q.options().dtype(lse_dtype(q.scalar_type())));
  attention_fwd_cpu(qc, kc, vc, o3, lse, sc, causal);
  cpu_finish(out, o3);
  return {out, lse.view(s.lse_shape)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_cpu(const at::Tensor& grad_out, const at::Tensor& q,
                                                                      const at::Tensor& k, const at::Tensor& v,
                                                                      const at::Tensor& out, const at::Tensor& lse,
                                                                      c10::optional<double> scale, bool causal,
                                                                      bool enable_gqa) {
  const AttnShape s = check_backward(grad_out, q, k, v, out, lse, enable_gqa);
  if (is_half(q.scalar_type())) {
    auto [dq, dk, dv] = attention_backward_cpu(to_float(grad_out), to_float(q), to_float(k), to_float(v), to_float(out),
                                               lse, scale, causal, enable_gqa);
    const auto t = q.scalar_type();
    return {dq.to(t), dk.to(t), dv.to(t)};
  }
  const double sc = resolve_scale(scale, s.D);
  const at::Tensor qc = as_3d(q, s.BH, s.Sq, s.D), kc = as_3d(k, s.BHkv, s.Sk, s.D), vc = as_3d(v, s.BHkv, s.Sk, s.Dv);
  const at::Tensor gc = as_3d(grad_out, s.BH, s.Sq, s.Dv), oc = as_3d(out, s.BH, s.Sq, s.Dv);
  const at::Tensor lc = lse.reshape({s.BH, s.Sq}).contiguous();
  at::Tensor dq, dk, dv;
  std::tie(dq, dk, dv) = empty_grads(q, k, v);
  at::Tensor dq3 = cpu_out_3d(dq, s.BH, s.Sq, s.D), dk3 = cpu_out_3d(dk, s.BHkv, s.Sk, s.D),
             dv3 = cpu_out_3d(dv, s.BHkv, s.Sk, s.Dv);
  attention_bwd_cpu(gc, qc, kc, vc, oc, lc, dq3, dk3, dv3, sc, causal);
  cpu_finish(dq, dq3);
  cpu_finish(dk, dk3);
  cpu_finish(dv, dv3);
  return {dq, dk, dv};
}

// ---- the chain: transpose_last2 and matmul --------------------------------------

struct MatmulShape {
  int64_t B, M, N, K;
  std::vector<int64_t> out_shape;
};

int64_t check_transpose(const at::Tensor& x) {
  check_float(x, "transpose_last2: x");
  TORCH_CHECK(x.dim() >= 2, "transpose_last2: x must have at least 2 dims, got shape ", x.sizes());
  return c10::multiply_integers(x.sizes().slice(0, x.dim() - 2));
}

std::vector<int64_t> transposed_shape(const at::Tensor& x) {
  std::vector<int64_t> s = x.sizes().vec();
  std::swap(s[s.size() - 1], s[s.size() - 2]);
  return s;
}

MatmulShape check_matmul(const at::Tensor& a, const at::Tensor& b) {
  check_float(a, "matmul: a");
  check_same_dtype(b, a, "matmul: b", "a");
  check_same_device(b, a, "matmul: b", "a");
  TORCH_CHECK(a.dim() >= 2, "matmul: a must be (..., M, K), got shape ", a.sizes());
  TORCH_CHECK(b.dim() == a.dim(), "matmul: b must have as many dims as a (", a.dim(), "), got shape ", b.sizes());
  const auto lead = a.sizes().slice(0, a.dim() - 2);
  TORCH_CHECK(b.sizes().slice(0, b.dim() - 2) == lead, "matmul: b has leading dims ", b.sizes().slice(0, b.dim() - 2),
              " but a has ", lead, "; they must be equal");
  TORCH_CHECK(b.size(-2) == a.size(-1), "matmul: b has ", b.size(-2), " rows but a has ", a.size(-1),
              " columns (a shape ", a.sizes(), ", b shape ", b.sizes(), ")");
  MatmulShape s{c10::multiply_integers(lead), a.size(-2), b.size(-1), a.size(-1), lead.vec()};
  s.out_shape.push_back(s.M);
  s.out_shape.push_back(s.N);
  return s;
}

at::Tensor transpose_last2_cpu(const at::Tensor& x) {
  check_transpose(x);
  if (is_half(x.scalar_type())) return transpose_last2_cpu(to_float(x)).to(x.scalar_type());
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty(transposed_shape(x), x.options());
  if (out.numel() > 0) transpose_last2_cpu_kernel(xc, out);
  return out;
}

at::Tensor matmul_cpu(const at::Tensor& a, const at::Tensor& b, double alpha, bool causal_mask) {
  const MatmulShape s = check_matmul(a, b);
  if (is_half(a.scalar_type())) return matmul_cpu(to_float(a), to_float(b), alpha, causal_mask).to(a.scalar_type());
  const at::Tensor ac = a.contiguous(), bc = b.contiguous();
  at::Tensor c = at::empty(s.out_shape, a.options());
  if (c.numel() > 0) matmul_cpu_kernel(ac, bc, c, alpha, causal_mask);
  return c;
}

#ifdef WITH_CUDA
// ---- CUDA wrappers ------------------------------------------------------------

// t's element strides as the kernels' (B, H, S, Dlast) view (attention.h), its leading dims
// split as q's: the last one the head, the ones before it the batch. False where Dlast is
// not contiguous or the batch dims do not collapse into one stride.
bool kernel_strides(const at::Tensor& t, AttnStrides& st) {
  const int64_t n = t.dim();
  st = AttnStrides{0, 0, 0};
  if (t.size(n - 1) > 1 && t.stride(n - 1) != 1) return false;
  if (n >= 2 && t.size(n - 2) > 1) st.s = t.stride(n - 2);
  if (n >= 3 && t.size(n - 3) > 1) st.h = t.stride(n - 3);
  int64_t expect = -1;  // the stride the next outer batch dim needs to collapse; -1: none yet
  for (int64_t i = n - 4; i >= 0; --i) {
    if (t.size(i) == 1) continue;
    if (expect < 0) {
      st.b = t.stride(i);
    } else if (t.stride(i) != expect) {
      return false;
    }
    expect = t.stride(i) * t.size(i);
  }
  return true;
}

struct KernelInput {
  at::Tensor t;  // t itself, or its copy
  AttnStrides st;
};

// An input as the kernels read it: where it lies when its strides fit and its rows start
// 16-byte aligned (the tensor-core kernels' vector loads), or when a copy could not align
// them either (rows of a byte size not a multiple of 16: only the SIMT kernels, which
// need no alignment, take those); else a contiguous copy with an aligned base.
KernelInput kernel_input(const at::Tensor& t, const AttnShape& s, int64_t heads, int64_t S, int64_t Dl) {
  AttnStrides st;
  const int64_t es = t.element_size();
  if (kernel_strides(t, st) && (attn_rows_aligned16(t.data_ptr(), st, es) || (Dl * es) % 16 != 0)) return {t, st};
  at::Tensor c = t.reshape({s.B, heads, S, Dl}).contiguous();
  if (!aligned16(c.data_ptr())) c = c.clone();
  kernel_strides(c, st);
  return {c, st};
}

// An output as the kernels write it: in place (every order of rank <= 4 fits), or into a
// contiguous scratch that finish() copies into it (rank > 4 orders whose batch dims do
// not collapse).
struct KernelOutput {
  at::Tensor dst, buf;
  AttnStrides st;
  KernelOutput(const at::Tensor& d, const AttnShape& s, int64_t heads, int64_t S, int64_t Dl) : dst(d) {
    if (kernel_strides(dst, st)) {
      buf = dst;
    } else {
      buf = at::empty({s.B, heads, S, Dl}, dst.options());
      kernel_strides(buf, st);
    }
  }
  void finish() {
    if (!buf.is_same(dst)) dst.copy_(buf.view(dst.sizes()));
  }
};

// What the forward's and the backward's kernel args share: the sizes, the (float) scale,
// the mask and the dtype.
template <class Args>
void set_problem(Args& a, const AttnShape& s, float kscale, bool causal, const at::Tensor& q) {
  a.B = s.B;
  a.H = s.H;
  a.Hkv = s.Hkv;
  a.Sq = s.Sq;
  a.Sk = s.Sk;
  a.D = s.D;
  a.Dv = s.Dv;
  a.scale = kscale;
  a.causal = causal;
  a.dtype = to_dtype(q.scalar_type());
}

std::tuple<at::Tensor, at::Tensor> attention_cuda_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     c10::optional<double> scale, bool causal, bool enable_gqa) {
  const AttnShape s = check_qkv(q, k, v, enable_gqa, "attention");
  const c10::cuda::CUDAGuard guard(q.device());
  const double sc = resolve_scale(scale, s.D);
  at::Tensor out = empty_in_order_of(q, s.out_shape, q.options());
  at::Tensor lse = at::empty(s.lse_shape, q.options().dtype(lse_dtype(q.scalar_type())));
  if (s.BH * s.Sq == 0) return {out, lse};
  if (s.Sk == 0 || s.Dv == 0) {  // nothing to attend to, or nothing to write: no kernel
    out.zero_();
    if (s.Sk == 0) {
      lse.fill_(-std::numeric_limits<double>::infinity());
    } else {  // Dv == 0 still has a log-sum-exp; ATen computes it (a degenerate case)
      const at::Tensor q3 = q.reshape({s.BH, s.Sq, s.D}).to(lse.scalar_type());
      const at::Tensor k3 = k.reshape({s.BHkv, s.Sk, s.D}).repeat_interleave(s.H / s.Hkv, 0).to(lse.scalar_type());
      at::Tensor scores = at::matmul(q3, k3.transpose(1, 2)) * sc;
      if (causal)
        scores.masked_fill_(at::ones({s.Sq, s.Sk}, q.options().dtype(at::kBool)).triu(1),
                            -std::numeric_limits<double>::infinity());
      lse.view({s.BH, s.Sq}).copy_(at::logsumexp(scores, {-1}));
    }
    return {out, lse};
  }
  // The kernels take a float scale; float64 would lose ~1e-8 to it, so fold a
  // scale that float cannot hold exactly into q and pass 1.
  float kscale = static_cast<float>(sc);
  at::Tensor qs = q;
  if (q.scalar_type() == at::kDouble && static_cast<double>(kscale) != sc) {
    qs = q * sc;
    kscale = 1.0f;
  }
  const KernelInput Q = kernel_input(qs, s, s.H, s.Sq, s.D), K = kernel_input(k, s, s.Hkv, s.Sk, s.D),
                    V = kernel_input(v, s, s.Hkv, s.Sk, s.Dv);
  KernelOutput O(out, s, s.H, s.Sq, s.Dv);
  AttentionFwdArgs a{
      Q.t.data_ptr(), K.t.data_ptr(), V.t.data_ptr(), O.buf.data_ptr(), lse.data_ptr(), Q.st, K.st, V.st, O.st};
  set_problem(a, s, kscale, causal, q);
  GP_CUDA_CHECK_STATUS(attention_forward_cuda(a, current_stream()));
  O.finish();
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_cuda_op(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, c10::optional<double> scale, bool causal, bool enable_gqa) {
  const AttnShape s = check_backward(grad_out, q, k, v, out, lse, enable_gqa);
  const c10::cuda::CUDAGuard guard(q.device());
  const double sc = resolve_scale(scale, s.D);
  at::Tensor dq, dk, dv;
  std::tie(dq, dk, dv) = empty_grads(q, k, v);
  if (s.BH * s.Sq == 0 || s.Sk == 0 || s.Dv == 0) {  // every gradient is zero (dP = 0 when Dv = 0)
    dq.zero_();
    dk.zero_();
    dv.zero_();
    return {dq, dk, dv};
  }
  // Same folding as the forward: with q' = q * scale and scale 1, dq = scale * dq'.
  float kscale = static_cast<float>(sc);
  const bool folded = q.scalar_type() == at::kDouble && static_cast<double>(kscale) != sc;
  const at::Tensor qs = folded ? q * sc : q;
  if (folded) kscale = 1.0f;
  const KernelInput Q = kernel_input(qs, s, s.H, s.Sq, s.D), K = kernel_input(k, s, s.Hkv, s.Sk, s.D),
                    V = kernel_input(v, s, s.Hkv, s.Sk, s.Dv), O = kernel_input(out, s, s.H, s.Sq, s.Dv),
                    G = kernel_input(grad_out, s, s.H, s.Sq, s.Dv);
  at::Tensor lc = lse.reshape({s.BH, s.Sq}).contiguous();
  if (!aligned16(lc.data_ptr())) lc = lc.clone();
  KernelOutput DQ(dq, s, s.H, s.Sq, s.D), DK(dk, s, s.Hkv, s.Sk, s.D), DV(dv, s, s.Hkv, s.Sk, s.Dv);
  AttentionBwdArgs a{Q.t.data_ptr(),
                     K.t.data_ptr(),
                     V.t.data_ptr(),
                     O.t.data_ptr(),
                     G.t.data_ptr(),
                     lc.data_ptr(),
                     DQ.buf.data_ptr(),
                     DK.buf.data_ptr(),
                     DV.buf.data_ptr(),
                     Q.st,
                     K.st,
                     V.st,
                     O.st,
                     G.st,
                     DQ.st,
                     DK.st,
                     DV.st};
  set_problem(a, s, kscale, causal, q);
  a.deterministic = at::globalContext().deterministicAlgorithms();
  const int64_t ws_bytes = attention_backward_workspace_bytes(a);
  at::Tensor ws = at::empty({std::max<int64_t>(ws_bytes, 1)}, q.options().dtype(at::kByte));
  GP_CUDA_CHECK_STATUS(attention_backward_cuda(a, ws.data_ptr(), current_stream()));
  DQ.finish();
  DK.finish();
  DV.finish();
  if (folded) dq.mul_(sc);
  return {dq, dk, dv};
}

at::Tensor transpose_last2_cuda_op(const at::Tensor& x) {
  const int64_t B = check_transpose(x);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty(transposed_shape(x), x.options());
  GP_CUDA_CHECK_STATUS(transpose_last2_cuda(xc.data_ptr(), out.data_ptr(), B, x.size(-2), x.size(-1),
                                            to_dtype(x.scalar_type()), current_stream()));
  return out;
}

at::Tensor matmul_cuda_op(const at::Tensor& a, const at::Tensor& b, double alpha, bool causal_mask) {
  const MatmulShape s = check_matmul(a, b);
  const c10::cuda::CUDAGuard guard(a.device());
  const at::Tensor ac = a.contiguous(), bc = b.contiguous();
  at::Tensor c = at::empty(s.out_shape, a.options());
  GP_CUDA_CHECK_STATUS(matmul_cuda(ac.data_ptr(), bc.data_ptr(), c.data_ptr(), s.B, s.M, s.N, s.K, alpha, causal_mask,
                                   to_dtype(a.scalar_type()), current_stream()));
  return c;
}
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(gpu_puzzles, m) {
  GP_IMPL(m, "attention", attention_cpu, attention_cuda_op);
  GP_IMPL(m, "attention_backward", attention_backward_cpu, attention_backward_cuda_op);
  GP_IMPL(m, "transpose_last2", transpose_last2_cpu, transpose_last2_cuda_op);
  GP_IMPL(m, "matmul", matmul_cpu, matmul_cuda_op);
}

}  // namespace gpu_puzzles
