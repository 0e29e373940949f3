// attention host side: argument checks, the CUDA wrappers and the registrations
// (the CPU kernels: attention_cpu.cpp), for the fused op (attention, attention_backward) and the
// curriculum's chain (transpose_last2, matmul; softmax is the softmax op's).
// Shapes are canonicalised to contiguous (BH, S, D): the seed's vector form
// q (D,) k (S, D) v (S, Dv) is BH = 1, Sq = 1; q (..., Sq, D), k (..., Sk, D),
// v (..., Sk, Dv) flatten the (equal) leading dims into BH.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
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
  int64_t BH, Sq, Sk, D, Dv;
  std::vector<int64_t> out_shape;  // q.shape[:-1] + (Dv,)
  std::vector<int64_t> lse_shape;  // q.shape[:-1]
};

AttnShape check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const char* op) {
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
    s.BH = 1;
    s.Sq = 1;
  } else {
    TORCH_CHECK(q.dim() >= 2, op, ": q must be (D,) or (..., Sq, D), got a 0-d tensor");
    TORCH_CHECK(k.dim() == q.dim(), op, ": k must have as many dims as q (", q.dim(), "), got shape ", k.sizes(),
                " (q shape ", q.sizes(), ")");
    TORCH_CHECK(v.dim() == q.dim(), op, ": v must have as many dims as q (", q.dim(), "), got shape ", v.sizes(),
                " (q shape ", q.sizes(), ")");
    const auto lead = q.sizes().slice(0, q.dim() - 2);
    TORCH_CHECK(k.sizes().slice(0, k.dim() - 2) == lead, op, ": k has leading dims ",
                k.sizes().slice(0, k.dim() - 2), " but q has ", lead, "; they must be equal");
    TORCH_CHECK(v.sizes().slice(0, v.dim() - 2) == lead, op, ": v has leading dims ",
                v.sizes().slice(0, v.dim() - 2), " but q has ", lead, "; they must be equal");
    s.BH = c10::multiply_integers(lead);
    s.Sq = q.size(-2);
  }
  s.D = q.size(-1);
  s.Sk = k.size(-2);
  s.Dv = v.size(-1);
  TORCH_CHECK(s.D >= 1, op, ": q must have a head dim >= 1, got shape ", q.sizes());
  TORCH_CHECK(k.size(-1) == s.D, op, ": k has head dim ", k.size(-1), " but q has head dim ", s.D,
              " (q shape ", q.sizes(), ", k shape ", k.sizes(), ")");
  TORCH_CHECK(v.size(-2) == s.Sk, op, ": v has sequence length ", v.size(-2), " but k has ", s.Sk, " (k shape ",
              k.sizes(), ", v shape ", v.sizes(), ")");
  if (q.is_cuda()) {
    TORCH_CHECK(s.D <= kAttentionMaxHeadDim, op, ": q head dim ", s.D, " exceeds ", kAttentionMaxHeadDim,
                ", the largest the CUDA kernels take");
    TORCH_CHECK(s.Dv <= kAttentionMaxHeadDim, op, ": v head dim ", s.Dv, " exceeds ", kAttentionMaxHeadDim,
                ", the largest the CUDA kernels take");
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble, op,
                ": q must be float32 or float64 on the CPU, got ", q.scalar_type());
  }
  s.lse_shape = q.sizes().slice(0, q.dim() - 1).vec();
  s.out_shape = s.lse_shape;
  s.out_shape.push_back(s.Dv);
  return s;
}

double resolve_scale(c10::optional<double> scale, int64_t D) {
  return scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(D));
}

at::ScalarType lse_dtype(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// Contiguous (rows, S, D) with a 16-byte aligned base (a contiguous view can
// start mid-allocation; the kernels may use vector loads).
at::Tensor as_3d(const at::Tensor& t, int64_t BH, int64_t S, int64_t D) {
  at::Tensor c = t.reshape({BH, S, D}).contiguous();
  if (!aligned16(c.data_ptr()) && c.numel() > 0) c = c.clone();
  return c;
}

// The backward's arguments: q, k, v as the forward's, then grad_out, out and lse.
AttnShape check_backward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& out, const at::Tensor& lse) {
  const char* op = "attention_backward";
  AttnShape s = check_qkv(q, k, v, op);
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

// dq, dk, dv as contiguous (BH, S, D) tensors.
std::tuple<at::Tensor, at::Tensor, at::Tensor> empty_grads(const at::Tensor& q, const AttnShape& s) {
  return {at::empty({s.BH, s.Sq, s.D}, q.options()), at::empty({s.BH, s.Sk, s.D}, q.options()),
          at::empty({s.BH, s.Sk, s.Dv}, q.options())};
}

std::tuple<at::Tensor, at::Tensor> attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 c10::optional<double> scale, bool causal) {
  const AttnShape s = check_qkv(q, k, v, "attention");
  const double sc = resolve_scale(scale, s.D);
  const at::Tensor qc = as_3d(q, s.BH, s.Sq, s.D), kc = as_3d(k, s.BH, s.Sk, s.D), vc = as_3d(v, s.BH, s.Sk, s.Dv);
  at::Tensor out = at::empty({s.BH, s.Sq, s.Dv}, q.options());
  at::Tensor lse = at::empty({s.BH, s.Sq}, q.options().dtype(lse_dtype(q.scalar_type())));
  attention_fwd_cpu(qc, kc, vc, out, lse, sc, causal);
  return {out.view(s.out_shape), lse.view(s.lse_shape)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, c10::optional<double> scale, bool causal) {
  const AttnShape s = check_backward(grad_out, q, k, v, out, lse);
  const double sc = resolve_scale(scale, s.D);
  const at::Tensor qc = as_3d(q, s.BH, s.Sq, s.D), kc = as_3d(k, s.BH, s.Sk, s.D), vc = as_3d(v, s.BH, s.Sk, s.Dv);
  const at::Tensor gc = as_3d(grad_out, s.BH, s.Sq, s.Dv), oc = as_3d(out, s.BH, s.Sq, s.Dv);
  const at::Tensor lc = lse.reshape({s.BH, s.Sq}).contiguous();
  at::Tensor dq, dk, dv;
  std::tie(dq, dk, dv) = empty_grads(q, s);
  attention_bwd_cpu(gc, qc, kc, vc, oc, lc, dq, dk, dv, sc, causal);
  return {dq.view(q.sizes()), dk.view(k.sizes()), dv.view(v.sizes())};
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
  TORCH_CHECK(b.sizes().slice(0, b.dim() - 2) == lead, "matmul: b has leading dims ",
              b.sizes().slice(0, b.dim() - 2), " but a has ", lead, "; they must be equal");
  TORCH_CHECK(b.size(-2) == a.size(-1), "matmul: b has ", b.size(-2), " rows but a has ", a.size(-1),
              " columns (a shape ", a.sizes(), ", b shape ", b.sizes(), ")");
  MatmulShape s{c10::multiply_integers(lead), a.size(-2), b.size(-1), a.size(-1), lead.vec()};
  s.out_shape.push_back(s.M);
  s.out_shape.push_back(s.N);
  return s;
}

at::Tensor transpose_last2_cpu(const at::Tensor& x) {
  check_transpose(x);
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty(transposed_shape(x), x.options());
  if (out.numel() > 0) transpose_last2_cpu_kernel(xc, out);
  return out;
}

at::Tensor matmul_cpu(const at::Tensor& a, const at::Tensor& b, double alpha, bool causal_mask) {
  const MatmulShape s = check_matmul(a, b);
  const at::Tensor ac = a.contiguous(), bc = b.contiguous();
  at::Tensor c = at::empty(s.out_shape, a.options());
  if (c.numel() > 0) matmul_cpu_kernel(ac, bc, c, alpha, causal_mask);
  return c;
}

#ifdef WITH_CUDA
// ---- CUDA wrappers ------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> attention_cuda_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  c10::optional<double> scale, bool causal) {
  const AttnShape s = check_qkv(q, k, v, "attention");
  const c10::cuda::CUDAGuard guard(q.device());
  const double sc = resolve_scale(scale, s.D);
  at::Tensor qc = as_3d(q, s.BH, s.Sq, s.D);
  const at::Tensor kc = as_3d(k, s.BH, s.Sk, s.D), vc = as_3d(v, s.BH, s.Sk, s.Dv);
  at::Tensor out = at::empty({s.BH, s.Sq, s.Dv}, q.options());
  at::Tensor lse = at::empty({s.BH, s.Sq}, q.options().dtype(lse_dtype(q.scalar_type())));
  if (s.BH * s.Sq == 0) return {out.view(s.out_shape), lse.view(s.lse_shape)};
  if (s.Sk == 0 || s.Dv == 0) {  // nothing to attend to, or nothing to write: no kernel
    out.zero_();
    if (s.Sk == 0) {
      lse.fill_(-std::numeric_limits<double>::infinity());
    } else {  // Dv == 0 still has a log-sum-exp; ATen computes it (a degenerate case)
      at::Tensor scores = at::matmul(qc.to(lse.scalar_type()), kc.to(lse.scalar_type()).transpose(1, 2)) * sc;
      if (causal) scores.masked_fill_(at::ones({s.Sq, s.Sk}, q.options().dtype(at::kBool)).triu(1),
                                      -std::numeric_limits<double>::infinity());
      lse.copy_(at::logsumexp(scores, {-1}));
    }
  } else {
    // The kernels take a float scale; float64 would lose ~1e-8 to it, so fold a
    // scale that float cannot hold exactly into q and pass 1.
    float kscale = static_cast<float>(sc);
    if (q.scalar_type() == at::kDouble && static_cast<double>(kscale) != sc) {
      qc = qc * sc;
      kscale = 1.0f;
    }
    AttentionFwdArgs a{qc.data_ptr(), kc.data_ptr(), vc.data_ptr(), out.data_ptr(), lse.data_ptr(),
                       s.BH, s.Sq, s.Sk, s.D, s.Dv, kscale, causal, to_dtype(q.scalar_type())};
    GP_CUDA_CHECK_STATUS(attention_forward_cuda(a, current_stream()));
  }
  return {out.view(s.out_shape), lse.view(s.lse_shape)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_cuda_op(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, c10::optional<double> scale, bool causal) {
  const AttnShape s = check_backward(grad_out, q, k, v, out, lse);
  const c10::cuda::CUDAGuard guard(q.device());
  const double sc = resolve_scale(scale, s.D);
  at::Tensor dq, dk, dv;
  std::tie(dq, dk, dv) = empty_grads(q, s);
  if (s.BH * s.Sq == 0 || s.Sk == 0 || s.Dv == 0) {  // every gradient is zero (dP = 0 when Dv = 0)
    dq.zero_();
    dk.zero_();
    dv.zero_();
  } else {
    at::Tensor qc = as_3d(q, s.BH, s.Sq, s.D);
    const at::Tensor kc = as_3d(k, s.BH, s.Sk, s.D), vc = as_3d(v, s.BH, s.Sk, s.Dv);
    const at::Tensor gc = as_3d(grad_out, s.BH, s.Sq, s.Dv), oc = as_3d(out, s.BH, s.Sq, s.Dv);
    at::Tensor lc = lse.reshape({s.BH, s.Sq}).contiguous();
    if (!aligned16(lc.data_ptr())) lc = lc.clone();
    // Same folding as the forward: with q' = q * scale and scale 1, dq = scale * dq'.
    float kscale = static_cast<float>(sc);
    const bool folded = q.scalar_type() == at::kDouble && static_cast<double>(kscale) != sc;
    if (folded) {
      qc = qc * sc;
      kscale = 1.0f;
    }
    AttentionBwdArgs a{qc.data_ptr(), kc.data_ptr(), vc.data_ptr(), oc.data_ptr(), gc.data_ptr(), lc.data_ptr(),
                       dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), s.BH, s.Sq, s.Sk, s.D, s.Dv, kscale, causal,
                       to_dtype(q.scalar_type())};
    const int64_t ws_bytes = attention_backward_workspace_bytes(a);
    at::Tensor ws = at::empty({std::max<int64_t>(ws_bytes, 1)}, q.options().dtype(at::kByte));
    GP_CUDA_CHECK_STATUS(attention_backward_cuda(a, ws.data_ptr(), current_stream()));
    if (folded) dq.mul_(sc);
  }
  return {dq.view(q.sizes()), dk.view(k.sizes()), dv.view(v.sizes())};
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
