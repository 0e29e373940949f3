// LayerNorm / RMSNorm and the fused Norm+Linear host side: argument checks, the CPU and
// CUDA calls and their registrations (the CPU kernels are in layernorm_linear_cpu.cpp).
// x is viewed as (M, H) rows. RMSNorm is LayerNorm with the mean forced to zero and no
// beta: every body below takes beta as a pointer, null meaning RMSNorm (Norm::kRms), and
// then returns no mean (undefined) and no dbeta.
//
// RMSNorm+Linear fold: y = W (gamma * x * rstd) + b = rstd * (x @ (W*gamma)^T) + b: no
// centring and no large-mean rows, so the LayerNorm epilogues serve it with mean = r = 0
// and bp = b; the plan rule is the LayerNorm one.
//
// Fused forward: two plans, chosen by their measured cost (fused_forward_plan in
// layernorm_linear_plan.h; knob layernorm_linear_plan = fold | normalize). Both write
// the same statistics for the backward, on CPU and CUDA alike (the CPU is the oracle).
//
// normalize: our LayerNorm writes xn = gamma * (x - mu) * rstd + beta, then one GEMM
// with the bias in its epilogue (addmm, as F.linear) reads it and W through W's strides
// (any view with a unit stride: Conv1D's weight.t() is not copied). Costs 2*M*H for xn.
//
// fold (W row-major (N, H) only; a forced fold copies another layout):
//   y = W (gamma * (x - mu) * rstd + beta) + b
//     = rstd * (x @ Wc^T - mu * r) + bp,
//   Wc[n,:] = W[n,:]*gamma - mean_h(W[n,:]*gamma)   row-centred, stored in x's dtype
//   r[n]    = sum_h Wc[n,h] as stored                (~0: the rounding residual of the centring)
//   bp[n]   = W[n,:] @ beta + b[n]
// Centring Wc removes the mu * sum(W*gamma) term from the GEMM, so x's mean does
// not cancel catastrophically there; r corrects the rounding of the centring.
// What is left grows like |mu| * rstd * eps_acc * sqrt(H); rows with
// |mu| * rstd > kLayerNormLinearMaxMeanRatio are recomputed normalise-first in the
// epilogue (decided per row on the device: no host sync, graph-safe).
// The normalised x is never written; the fold costs 2*N*H (+ 2*M*N for a separate
// epilogue pass over z), so it pays off for tall x and narrow projections. On sm_90a
// (bf16/fp16, built with CUTLASS) the GEMM is a CUTLASS kernel whose epilogue applies the
// statistics (layernorm_linear_evt_sm90.cu); a fix-up pass then recomputes the large-mean
// rows only. Elsewhere: cuBLAS + the separate epilogue pass (knobs layernorm_linear_evt/_pdl).
// Before the GEMM, the statistics and the fold share one launch on CUDA where a row fits
// in registers (layernorm_linear_prep_cuda).
// Backward (either plan): xn = gamma*xhat + beta is materialised again for
// dW = dy^T xn (in W's layout: (xn^T dy)^T for a transposed W); d(xn) = dy W; our
// LayerNorm backward gives dx, dgamma, dbeta. On CUDA that LayerNorm backward also writes xn (it reads x anyway), and
// db (dy's column sums) is its own launch (layernorm_linear_bias_grad_cuda), after the dW GEMM.
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "common/checks.h"
#include "common/register.h"
#include "common/cuda_launch.h"
#include "norms/layernorm_linear.h"
#include "norms/layernorm_linear_plan.h"

namespace gpu_puzzles {
namespace {

using Tensor = at::Tensor;
using Tensor2 = std::tuple<Tensor, Tensor>;
using Tensor3 = std::tuple<Tensor, Tensor, Tensor>;
using layernorm_linear::layernorm_linear_plan;
using layernorm_linear::Plan;
using layernorm_linear::Stage;

at::ScalarType stat_type(const Tensor& x) { return acc_type(x.scalar_type()); }

// Stats shape: x's shape without the last dim.
std::vector<int64_t> lead_shape(const Tensor& x) {
  return std::vector<int64_t>(x.sizes().begin(), x.sizes().end() - 1);
}

Norm norm_of(const Tensor* bias) { return bias ? Norm::kLayer : Norm::kRms; }

// bias null: RMSNorm (weight only; the fused op calls it norm_weight).
int64_t check_ln(const Tensor& x, const Tensor& weight, const Tensor* bias, const char* op) {
  const std::string o(op);
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least one dimension, got a scalar");
  check_float(x, (o + ": x").c_str());
  const int64_t H = x.size(-1);
  TORCH_CHECK(H >= 1, op, ": x's last dimension (hidden size) must be >= 1, got shape ", x.sizes());
  const bool fused = o.find("linear") != std::string::npos;
  const char* prefix = !fused ? "" : bias ? "ln_" : "norm_";
  std::vector<std::pair<const Tensor*, const char*>> params{{&weight, "weight"}};
  if (bias) params.push_back({bias, "bias"});
  for (auto [tp, name] : params) {
    const Tensor& t = *tp;
    const std::string n = o + ": " + prefix + name;
    check_same_dtype(t, x, n.c_str(), "x");
    check_same_device(t, x, n.c_str(), "x");
    TORCH_CHECK(t.dim() == 1 && t.size(0) == H, n, " must have shape (", H, ",) to match x's last dimension, got ",
                t.sizes());
  }
  return H;
}

// mean null: RMSNorm (rstd only).
void check_stats(const Tensor* mean, const Tensor& rstd, const Tensor& x, const char* op) {
  const auto want = lead_shape(x);
  std::vector<std::pair<const Tensor*, const char*>> stats{{&rstd, "rstd"}};
  if (mean) stats.push_back({mean, "mean"});
  for (auto [tp, name] : stats) {
    const Tensor& t = *tp;
    TORCH_CHECK(t.scalar_type() == stat_type(x), op, ": ", name, " must be ", stat_type(x), ", got ", t.scalar_type());
    TORCH_CHECK(t.sizes() == at::IntArrayRef(want), op, ": ", name, " must have shape ", at::IntArrayRef(want),
                ", got ", t.sizes());
    check_same_device(t, x, (std::string(op) + ": " + name).c_str(), "x");
  }
}

// grad_out has the output's shape and dtype (ref: x for the norms, linear_weight for the fused ops).
void check_grad(const Tensor& g, at::IntArrayRef want, const Tensor& ref, const char* ref_name, const char* op) {
  TORCH_CHECK(g.sizes() == want, op, ": grad_out has shape ", g.sizes(), " but the output has shape ", want);
  check_same_dtype(g, ref, (std::string(op) + ": grad_out").c_str(), ref_name);
  check_same_device(g, ref, (std::string(op) + ": grad_out").c_str(), ref_name);
}

// The linear's dtype is x's, or a half type under a float32 x: the mix torch.autocast hands
// over (the norm then runs in float32, the linear and the output in linear_weight's dtype).
int64_t check_linear(const Tensor& x, const Tensor& W, const c10::optional<Tensor>& b, int64_t H, const char* op) {
  const std::string o(op);
  TORCH_CHECK(W.scalar_type() == x.scalar_type() || (x.scalar_type() == at::kFloat && is_half(W.scalar_type())), op,
              ": linear_weight has dtype ", W.scalar_type(), " but x has dtype ", x.scalar_type(),
              "; they must match, or x be float32 under a float16 or bfloat16 linear_weight (the norm then runs "
              "in float32 and the linear in linear_weight's dtype, as under torch.autocast)");
  check_same_device(W, x, (o + ": linear_weight").c_str(), "x");
  TORCH_CHECK(W.dim() == 2 && W.size(1) == H, op, ": linear_weight must have shape (N, ", H,
              ") to match x's last dimension, got ", W.sizes());
  const int64_t N = W.size(0);
  if (b.has_value()) {
    check_same_dtype(*b, W, (o + ": linear_bias").c_str(), "linear_weight");
    check_same_device(*b, x, (o + ": linear_bias").c_str(), "x");
    TORCH_CHECK(b->dim() == 1 && b->size(0) == N, op, ": linear_bias must have shape (", N,
                ",) to match linear_weight, got ", b->sizes());
  }
  return N;
}

std::vector<int64_t> out_shape(const Tensor& x, int64_t N) {
  auto s = lead_shape(x);
  s.push_back(N);
  return s;
}

const void* opt_ptr(const c10::optional<Tensor>& t) { return t.has_value() ? t->data_ptr() : nullptr; }

// ---- ops (one body per backend: `cuda` picks the launchers) ----------------------

// bias_ null: RMSNorm, the mean undefined. y null: statistics only (the fused fold plan).
// y_type: y's dtype, x's unless given (a half one beside a float32 x: the normalise plan
// under autocast, where the CUDA kernels write the GEMM's operand directly).
Tensor3 layer_norm_impl(const Tensor& x_, const Tensor& weight_, const Tensor* bias_, double eps, bool cuda,
                        bool want_y = true, c10::optional<at::ScalarType> y_type = c10::nullopt) {
  const char* op = bias_ ? "layer_norm" : "rms_norm";
  const int64_t H = check_ln(x_, weight_, bias_, op);
  TORCH_CHECK(eps >= 0, op, ": eps must be >= 0, got ", eps);
  const Tensor x = x_.contiguous(), g = weight_.contiguous(), b = bias_ ? bias_->contiguous() : Tensor();
  const int64_t M = x.numel() / H;
  const Norm norm = norm_of(bias_);
  const at::ScalarType yt = y_type.value_or(x.scalar_type());
  Tensor y = want_y ? at::empty(x.sizes(), x.options().dtype(cuda ? yt : x.scalar_type())) : Tensor();
  Tensor mean = bias_ ? at::empty(lead_shape(x), x.options().dtype(stat_type(x))) : Tensor();
  Tensor rstd = at::empty(lead_shape(x), x.options().dtype(stat_type(x)));
  auto ptr = [](const Tensor& t) -> void* { return t.defined() ? t.data_ptr() : nullptr; };
  if (cuda) {
#ifdef WITH_CUDA
    GP_CUDA_CHECK_STATUS(layer_norm_forward_cuda(x.data_ptr(), g.data_ptr(), ptr(b), ptr(y), ptr(mean), rstd.data_ptr(),
                                                 M, H, eps, to_dtype(x.scalar_type()), current_stream(), norm,
                                                 to_dtype(yt)));
#endif
  } else {
    GP_CPU_CALL(layer_norm_forward_cpu)
    (x.data_ptr(), g.data_ptr(), ptr(b), ptr(y), ptr(mean), rstd.data_ptr(), M, H, eps, to_dtype(x.scalar_type()),
     false, norm);
    if (want_y) y = y.to(yt);  // the CPU kernels write one dtype
  }
  return {y, mean, rstd};
}

// beta/xn (CUDA, fused backward only): also write the LayerNorm output into xn, and
// write dx over grad_ (the fused backward's own dxn buffer), so that xn costs no more
// peak memory than the separate pass it replaces.
// norm kRms: mean_ is not read (may be undefined), beta is not read, and dbeta is undefined.
Tensor3 layer_norm_backward_impl(const Tensor& grad_, const Tensor& x_, const Tensor& weight_, const Tensor& mean_,
                                 const Tensor& rstd_, bool cuda, const Tensor* beta = nullptr, Tensor* xn = nullptr,
                                 Norm norm = Norm::kLayer) {
  const bool rms = norm == Norm::kRms;
  const char* op = rms ? "rms_norm_backward" : "layer_norm_backward";
  const int64_t H = check_ln(x_, weight_, rms ? nullptr : &weight_, op);
  // The fused backward under autocast hands over a half dxn (its GEMM's output, read as it
  // is) for a float32 x, and wants xn in that half type.
  const bool mixed = xn != nullptr && grad_.scalar_type() != x_.scalar_type();
  if (mixed) {
    TORCH_CHECK(grad_.sizes() == x_.sizes() && xn->scalar_type() == grad_.scalar_type(), op, ": internal dtype mix");
  } else {
    check_grad(grad_, x_.sizes(), x_, "x", op);
  }
  check_stats(rms ? nullptr : &mean_, rstd_, x_, op);
  const Tensor x = x_.contiguous(), g = weight_.contiguous(), dy = grad_.contiguous();
  const Tensor mean = rms ? Tensor() : mean_.contiguous(), rstd = rstd_.contiguous();
  const int64_t M = x.numel() / H;
  const bool in_place = xn != nullptr && cuda && dy.is_same(grad_) && !mixed;
  Tensor dx = in_place ? dy.view(x.sizes()) : at::empty(x.sizes(), x.options());
  Tensor dg = at::empty({H}, x.options()), db = rms ? Tensor() : at::empty({H}, x.options());
  auto ptr = [](const Tensor& t) -> void* { return t.defined() ? t.data_ptr() : nullptr; };
  if (M == 0) {
    dg.zero_();
    if (!rms) db.zero_();
    return {dx, dg, db};
  }
  if (cuda) {
#ifdef WITH_CUDA
    const bool want_xn = xn != nullptr;
    int64_t G = 0;
    const DType gt = to_dtype(dy.scalar_type());
    GP_CUDA_CHECK_STATUS(layer_norm_backward_blocks(M, H, to_dtype(x.scalar_type()), gt, want_xn, G, norm));
    Tensor ws = at::empty({(rms ? 1 : 2) * G * H}, x.options().dtype(stat_type(x)));
    GP_CUDA_CHECK_STATUS(layer_norm_backward_cuda(
        dy.data_ptr(), x.data_ptr(), g.data_ptr(), ptr(mean), rstd.data_ptr(), dx.data_ptr(), dg.data_ptr(), ptr(db),
        ws.data_ptr(), M, H, to_dtype(x.scalar_type()), gt, current_stream(),
        want_xn && beta ? beta->data_ptr() : nullptr, want_xn ? xn->data_ptr() : nullptr, norm));
#endif
  } else {
    GP_CPU_CALL(layer_norm_backward_cpu)
    (dy.data_ptr(), x.data_ptr(), g.data_ptr(), ptr(mean), rstd.data_ptr(), dx.data_ptr(), dg.data_ptr(), ptr(db), M, H,
     to_dtype(x.scalar_type()), norm);
  }
  return {dx, dg, db};
}

// W's memory is (K, N) row-major: a transposed view such as GPT-2's Conv1D weight.t().
bool w_transposed(const Tensor& W) { return !W.is_contiguous() && W.t().is_contiguous(); }

// The normalise plan: our LayerNorm writes xn (and the statistics), then one cuBLAS GEMM
// with the bias in its epilogue (addmm, as F.linear), reading W through its strides.
// A half W under a float32 x: the norm in float32, xn written in W's dtype.
// Returns (y (M, N), mean, rstd).
Tensor3 normalize_forward(const Tensor& x, const Tensor& g, const Tensor* be, const Tensor& W,
                          const c10::optional<Tensor>& b, int64_t M, int64_t H, double eps, bool cuda) {
  auto [xn, mean, rstd] = layer_norm_impl(x, g, be, eps, cuda, true, W.scalar_type());
  const Tensor xn2 = xn.view({M, H});
  return {b ? at::addmm(*b, xn2, W.t()) : at::mm(xn2, W.t()), mean, rstd};
}

Tensor3 rms_fold_forward(const Tensor& x, const Tensor& g, const Tensor& W_, const c10::optional<Tensor>& b, int64_t M,
                         int64_t N, int64_t H, double eps, bool cuda, const Plan& fwd);

#ifdef WITH_CUDA
// The fold plans' sm_90a GEMM (plan.evt): z (M, N) = x wc^T, the statistics applied in its
// epilogue (layernorm_linear_evt_sm90.cu). Undefined where CUTLASS refused the problem
// (nothing was launched): the caller runs cuBLAS and the epilogue pass instead.
Tensor evt_gemm(const Tensor& x, const Tensor& wc, const Tensor& mean, const Tensor& rstd, const Tensor& r,
                const Tensor& bp, int64_t M, int64_t N, int64_t H, DType dt, cudaStream_t s, bool pdl) {
  Tensor z = at::empty({M, N}, x.options());
  const size_t ws_bytes = layernorm_linear_evt_workspace_bytes(M, N, H, dt);
  Tensor ws;
  if (ws_bytes > 0) ws = at::empty({static_cast<int64_t>(ws_bytes)}, x.options().dtype(at::kByte));
  const LaunchStatus st = layernorm_linear_evt_gemm_cuda(x.data_ptr(), wc.data_ptr(), mean.data_ptr(), rstd.data_ptr(),
                                                         r.data_ptr(), bp.data_ptr(), z.data_ptr(),
                                                         ws_bytes > 0 ? ws.data_ptr() : nullptr, M, N, H, dt, s, pdl);
  if (st == cudaErrorNotSupported) return Tensor();
  GP_CUDA_CHECK_STATUS(st);
  return z;
}
#endif

// lb_ null: RMSNorm+Linear (the mean undefined in the result).
Tensor3 fused_forward_impl(const Tensor& x_, const Tensor& lw_, const Tensor* lb_, const Tensor& W_,
                           const c10::optional<Tensor>& b_, double eps, bool cuda) {
  const char* op = lb_ ? "fused_layernorm_linear" : "fused_rmsnorm_linear";
  const int64_t H = check_ln(x_, lw_, lb_, op);
  const int64_t N = check_linear(x_, W_, b_, H, op);
  TORCH_CHECK(eps >= 0, op, ": eps must be >= 0, got ", eps);
  const Tensor x = x_.contiguous(), g = lw_.contiguous();
  const c10::optional<Tensor> b = b_.has_value() ? c10::optional<Tensor>(b_->contiguous()) : c10::nullopt;
  const int64_t M = x.numel() / H;
  bool evt_possible = false;
#ifdef WITH_CUDA
  // wc (below) is a fresh allocation, aligned as the CUTLASS GEMM needs: only x's alignment matters here.
  if (cuda)
    evt_possible = layernorm_linear_evt_possible(x.data_ptr(), x.data_ptr(), M, N, H, to_dtype(x.scalar_type()));
#endif
  const Plan fwd = layernorm_linear::fused_forward_plan(M, N, H, W_.is_contiguous(), evt_possible,
                                                        W_.scalar_type() == x.scalar_type());
  if (!fwd.fold) {
    auto [y, mean, rstd] = normalize_forward(x, g, lb_, W_, b, M, H, eps, cuda);
    return {y.view(out_shape(x, N)), mean, rstd};
  }
  if (!lb_) {
    auto [y, mean, rstd] = rms_fold_forward(x, g, W_, b, M, N, H, eps, cuda, fwd);
    return {y.view(out_shape(x, N)), mean, rstd};
  }
  const Tensor be = lb_->contiguous();
  const auto st = x.options().dtype(stat_type(x));
  Tensor mean = at::empty(lead_shape(x), st), rstd = at::empty(lead_shape(x), st);
  // The fold kernels read W as (N, H) rows: a forced fold of another layout copies it.
  const Tensor W = W_.contiguous();
  Tensor wc = at::empty({N, H}, x.options());
  Tensor r = at::empty({N}, st), bp = at::empty({N}, st);
  Tensor z;
  if (cuda) {
#ifdef WITH_CUDA
    const DType dt = to_dtype(x.scalar_type());
    const cudaStream_t s = current_stream();
    // Statistics and fold: one launch (two when a row does not fit in registers or is unaligned).
    GP_CUDA_CHECK_STATUS(layernorm_linear_prep_cuda(x.data_ptr(), W.data_ptr(), g.data_ptr(), be.data_ptr(),
                                                    b ? b->data_ptr() : nullptr, mean.data_ptr(), rstd.data_ptr(),
                                                    wc.data_ptr(), r.data_ptr(), bp.data_ptr(), M, N, H, eps, dt, s));
    // The plan asked once (fwd): its EVT check took x for wc too, which is as aligned (a fresh allocation).
    const Plan& plan = fwd;
    if (plan.evt) {
      // sm_90a: one CUTLASS GEMM with the statistics applied in its epilogue, then
      // only the large-mean rows are recomputed (see layernorm_linear_evt_sm90.cu).
      z = evt_gemm(x, wc, mean, rstd, r, bp, M, N, H, dt, s, plan.pdl);
      if (z.defined())  // else the general path below
        GP_CUDA_CHECK_STATUS(layernorm_linear_large_mean_fixup_cuda(
            z.data_ptr(), x.data_ptr(), g.data_ptr(), be.data_ptr(), W.data_ptr(), b ? b->data_ptr() : nullptr,
            mean.data_ptr(), rstd.data_ptr(), M, N, H, dt, s, plan.pdl));
    }
    if (!z.defined()) {
      z = at::mm(x.view({M, H}), wc.t()).contiguous();  // cuBLAS
      GP_CUDA_CHECK_STATUS(layernorm_linear_epilogue_cuda(
          z.data_ptr(), x.data_ptr(), g.data_ptr(), be.data_ptr(), W.data_ptr(), b ? b->data_ptr() : nullptr,
          mean.data_ptr(), rstd.data_ptr(), r.data_ptr(), bp.data_ptr(), M, N, H, dt, s));
    }
#endif
  } else {
    const DType dt = to_dtype(x.scalar_type());
    GP_CPU_CALL(layer_norm_forward_cpu)
    (x.data_ptr(), nullptr, nullptr, nullptr, mean.data_ptr(), rstd.data_ptr(), M, H, eps, dt, false, Norm::kLayer);
    GP_CPU_CALL(layernorm_linear_fold_weight_cpu)
    (W.data_ptr(), g.data_ptr(), be.data_ptr(), opt_ptr(b), wc.data_ptr(), r.data_ptr(), bp.data_ptr(), N, H, dt);
    z = at::mm(x.view({M, H}), wc.t()).contiguous();
    GP_CPU_CALL(layernorm_linear_epilogue_cpu)
    (z.data_ptr(), x.data_ptr(), g.data_ptr(), be.data_ptr(), W.data_ptr(), opt_ptr(b), mean.data_ptr(),
     rstd.data_ptr(), r.data_ptr(), bp.data_ptr(), M, N, H, dt);
  }
  return {z.view(out_shape(x, N)), mean, rstd};
}

// The RMSNorm fold plan (see the top of this file): the statistics, wc = W*gamma (rounded
// to x's dtype once, as the LayerNorm fold stores wc), the GEMM, and the LayerNorm
// epilogue with mean = r = 0 and bp = b (its large-mean recompute never triggers).
// Returns (y (M, N), undefined mean, rstd).
Tensor3 rms_fold_forward(const Tensor& x, const Tensor& g, const Tensor& W_, const c10::optional<Tensor>& b, int64_t M,
                         int64_t N, int64_t H, double eps, bool cuda, const Plan& fwd) {
  Tensor rstd = std::get<2>(layer_norm_impl(x, g, nullptr, eps, cuda, /*want_y=*/false));
  const Tensor W = W_.contiguous();  // the epilogue's (never taken) recompute reads (N, H) rows
  const Tensor wc = (W * g).contiguous();
  const auto st = x.options().dtype(stat_type(x));
  Tensor zeros = at::zeros({std::max(M, N)}, st);  // mean (M) and r (N)
  Tensor bp = b ? b->to(stat_type(x)) : at::zeros({N}, st);
  const DType dt = to_dtype(x.scalar_type());
  Tensor z;
  if (cuda) {
#ifdef WITH_CUDA
    const cudaStream_t s = current_stream();
    // The plan asked once, as in the LayerNorm fold; undefined z (refused): cuBLAS below.
    if (fwd.evt) z = evt_gemm(x, wc, zeros, rstd, zeros, bp, M, N, H, dt, s, false);
    if (!z.defined()) {
      z = at::mm(x.view({M, H}), wc.t()).contiguous();
      GP_CUDA_CHECK_STATUS(layernorm_linear_epilogue_cuda(
          z.data_ptr(), x.data_ptr(), g.data_ptr(), g.data_ptr(), W.data_ptr(), b ? b->data_ptr() : nullptr,
          zeros.data_ptr(), rstd.data_ptr(), zeros.data_ptr(), bp.data_ptr(), M, N, H, dt, s));
    }
#endif
  } else {
    z = at::mm(x.view({M, H}), wc.t()).contiguous();
    GP_CPU_CALL(layernorm_linear_epilogue_cpu)
    (z.data_ptr(), x.data_ptr(), g.data_ptr(), g.data_ptr(), W.data_ptr(), opt_ptr(b), zeros.data_ptr(),
     rstd.data_ptr(), zeros.data_ptr(), bp.data_ptr(), M, N, H, dt);
  }
  return {z, Tensor(), rstd};
}

// lb_ null: RMSNorm+Linear (mean_ not read, dbeta undefined). want_db false: db undefined
// (the RMSNorm+Linear op without a linear bias skips dy's column sums).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> fused_backward_impl(const Tensor& grad_, const Tensor& x_,
                                                                       const Tensor& lw_, const Tensor* lb_,
                                                                       const Tensor& W_, const Tensor& mean_,
                                                                       const Tensor& rstd_, bool cuda,
                                                                       bool want_db = true) {
  const char* op = lb_ ? "fused_layernorm_linear_backward" : "fused_rmsnorm_linear_backward";
  const Norm norm = norm_of(lb_);
  const int64_t H = check_ln(x_, lw_, lb_, op);
  const int64_t N = check_linear(x_, W_, c10::nullopt, H, op);
  check_grad(grad_, at::IntArrayRef(out_shape(x_, N)), W_, "linear_weight", op);
  check_stats(lb_ ? &mean_ : nullptr, rstd_, x_, op);
  // W as it comes: cuBLAS reads any view with a unit stride through its transpose flags.
  const Tensor x = x_.contiguous(), g = lw_.contiguous(), be = lb_ ? lb_->contiguous() : Tensor(), &W = W_;
  const Tensor mean = lb_ ? mean_.contiguous() : Tensor(), rstd = rstd_.contiguous();
  auto ptr = [](const Tensor& t) -> void* { return t.defined() ? t.data_ptr() : nullptr; };
  const int64_t M = x.numel() / H;
  const Tensor dy = grad_.contiguous().view({M, N});
  // A half W under a float32 x (autocast): the GEMMs run in W's dtype, the norm's backward
  // in x's (on CUDA it reads dxn and writes xn in W's dtype; the CPU casts them).
  const auto wt_type = W.scalar_type();
  // dW in W's own layout, so that autograd's accumulation into a transposed parameter
  // (Conv1D's (H, N) weight, seen here through .t()) needs no copy: (xn^T dy)^T then.
  const bool wt = w_transposed(W);
  auto dw_gemm = [&](const Tensor& xn0) {
    const Tensor xn_ = xn0.to(wt_type);
    if (!wt) return at::mm(dy.t(), xn_);  // (N, H)
    Tensor dWt = at::empty({H, N}, dy.options());
    at::mm_out(dWt, xn_.t(), dy);
    return dWt.t();
  };
  // The normalised activation, recomputed for dW (the forward does not keep it).
  if (cuda) {
#ifdef WITH_CUDA
    // The LayerNorm backward reads x anyway: it writes xn too, instead of a separate
    // pass over x (benchmarks/lnlinear_prep_variants.cu), and dx over dxn (one dtype).
    Tensor xn = at::empty({M, H}, x.options().dtype(wt_type));
    Tensor dxn = at::mm(dy, W).view(x.sizes());  // (.., H), W's dtype
    auto [dx, dg, dbeta] = layer_norm_backward_impl(dxn, x, g, mean, rstd, cuda, lb_ ? &be : nullptr, &xn, norm);
    dxn.reset();
    Tensor dW = dw_gemm(xn);  // (N, H)
    xn.reset();
    // db: dy's column sums, in a fixed order; last, so that it starts on the rows of dy
    // the dW GEMM left in L2 (see layernorm_linear_colsum).
    Tensor db;
    if (want_db) {
      db = at::empty({N}, dy.options());
      Tensor ws = at::empty({layernorm_linear_bias_grad_workspace(M, N)}, x.options().dtype(stat_type(x)));
      GP_CUDA_CHECK_STATUS(layernorm_linear_bias_grad_cuda(dy.data_ptr(), db.data_ptr(), ws.data_ptr(), M, N,
                                                           to_dtype(wt_type), current_stream()));
    }
    return {dx, dg, dbeta, dW, db};
#endif
  }
  Tensor xn = at::empty({M, H}, x.options());
  GP_CPU_CALL(layer_norm_forward_cpu)
  (x.data_ptr(), g.data_ptr(), ptr(be), xn.data_ptr(), ptr(mean), rstd.data_ptr(), M, H, 0.0, to_dtype(x.scalar_type()),
   true, norm);
  Tensor db = want_db ? dy.sum(0) : Tensor();
  Tensor dW = dw_gemm(xn);                                         // (N, H)
  Tensor dxn = at::mm(dy, W).view(x.sizes()).to(x.scalar_type());  // (.., H)
  xn.reset();
  auto [dx, dg, dbeta] = layer_norm_backward_impl(dxn, x, g, mean, rstd, cuda, nullptr, nullptr, norm);
  return {dx, dg, dbeta, dW, db};
}

// The curriculum's one-thread-per-row kernel (CUDA); on the CPU the same loop per row.
Tensor naive_impl(const Tensor& x_, const Tensor& lw_, const Tensor& lb_, const Tensor& W_,
                  const c10::optional<Tensor>& b_, double eps, bool cuda) {
  const char* op = "fused_layernorm_linear_naive";
  const int64_t H = check_ln(x_, lw_, &lb_, op);
  check_same_dtype(W_, x_, "fused_layernorm_linear_naive: linear_weight", "x");  // one dtype in the kernel
  const int64_t N = check_linear(x_, W_, b_, H, op);
  const Tensor x = x_.contiguous(), g = lw_.contiguous(), be = lb_.contiguous(), W = W_.contiguous();
  const c10::optional<Tensor> b = b_.has_value() ? c10::optional<Tensor>(b_->contiguous()) : c10::nullopt;
  const int64_t M = x.numel() / H;
  Tensor y = at::empty(out_shape(x, N), x.options());
  if (cuda) {
#ifdef WITH_CUDA
    GP_CUDA_CHECK_STATUS(layernorm_linear_naive_cuda(x.data_ptr(), g.data_ptr(), be.data_ptr(), W.data_ptr(),
                                                     b ? b->data_ptr() : nullptr, y.data_ptr(), M, N, H, eps,
                                                     to_dtype(x.scalar_type()), current_stream()));
#endif
  } else {
    // The loop per row of the CUDA kernel, with its dot products batched into one GEMM.
    const auto st = x.options().dtype(stat_type(x));
    Tensor mean = at::empty({M}, st), rstd = at::empty({M}, st), xn = at::empty({M, H}, x.options());
    GP_CPU_CALL(layer_norm_forward_cpu)
    (x.data_ptr(), g.data_ptr(), be.data_ptr(), xn.data_ptr(), mean.data_ptr(), rstd.data_ptr(), M, H, eps,
     to_dtype(x.scalar_type()), false, Norm::kLayer);
    Tensor y2 = y.view({M, N});
    if (b)
      at::addmm_out(y2, *b, xn, W.t());
    else
      at::mm_out(y2, xn, W.t());
  }
  return y;
}

// The registered kernels, CPU = false / CUDA = true. The dispatcher picks the CUDA
// kernel when any argument is on the GPU, x maybe not. The *_impl checks compare every
// argument's device with x's and name the odd one; a plain DeviceGuard lets them run
// first (a CUDAGuard would reject a CPU x with a message about x alone).
template <bool CUDA>
struct OnXDevice {
  explicit OnXDevice(const Tensor& x) {
    if (CUDA) guard.reset_device(x.device());
  }
  c10::OptionalDeviceGuard guard;
};

template <bool CUDA>
Tensor naive_op(const Tensor& x, const Tensor& lw, const Tensor& lb, const Tensor& W, const c10::optional<Tensor>& b,
                double eps) {
  const OnXDevice<CUDA> on(x);
  return naive_impl(x, lw, lb, W, b, eps, CUDA);
}
template <bool CUDA>
Tensor3 layer_norm_op(const Tensor& x, const Tensor& w, const Tensor& b, double eps) {
  const OnXDevice<CUDA> on(x);
  return layer_norm_impl(x, w, &b, eps, CUDA);
}
template <bool CUDA>
Tensor3 layer_norm_backward_op(const Tensor& g, const Tensor& x, const Tensor& w, const Tensor& m, const Tensor& r) {
  const OnXDevice<CUDA> on(x);
  return layer_norm_backward_impl(g, x, w, m, r, CUDA);
}
template <bool CUDA>
Tensor3 fused_op(const Tensor& x, const Tensor& lw, const Tensor& lb, const Tensor& W, const c10::optional<Tensor>& b,
                 double eps) {
  const OnXDevice<CUDA> on(x);
  return fused_forward_impl(x, lw, &lb, W, b, eps, CUDA);
}
template <bool CUDA>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> fused_backward_op(const Tensor& g, const Tensor& x, const Tensor& lw,
                                                                     const Tensor& lb, const Tensor& W, const Tensor& m,
                                                                     const Tensor& r) {
  const OnXDevice<CUDA> on(x);
  return fused_backward_impl(g, x, lw, &lb, W, m, r, CUDA);
}

// RMSNorm: (y, rstd); backward (dx, dweight).
template <bool CUDA>
Tensor2 rms_norm_op(const Tensor& x, const Tensor& w, double eps) {
  const OnXDevice<CUDA> on(x);
  auto [y, mean, rstd] = layer_norm_impl(x, w, nullptr, eps, CUDA);
  return {y, rstd};
}
template <bool CUDA>
Tensor2 rms_norm_backward_op(const Tensor& g, const Tensor& x, const Tensor& w, const Tensor& r) {
  const OnXDevice<CUDA> on(x);
  auto [dx, dw, unused] = layer_norm_backward_impl(g, x, w, Tensor(), r, CUDA, nullptr, nullptr, Norm::kRms);
  return {dx, dw};
}
template <bool CUDA>
Tensor2 fused_rms_op(const Tensor& x, const Tensor& nw, const Tensor& W, const c10::optional<Tensor>& b, double eps) {
  const OnXDevice<CUDA> on(x);
  auto [y, mean, rstd] = fused_forward_impl(x, nw, nullptr, W, b, eps, CUDA);
  return {y, rstd};
}
// -> (dx, d norm_weight, dW, db): db is (N,) with has_bias, else (0,) (not computed).
template <bool CUDA>
std::tuple<Tensor, Tensor, Tensor, Tensor> fused_rms_backward_op(const Tensor& g, const Tensor& x, const Tensor& nw,
                                                                 const Tensor& W, const Tensor& r, bool has_bias) {
  const OnXDevice<CUDA> on(x);
  auto [dx, dnw, unused, dW, db] = fused_backward_impl(g, x, nw, nullptr, W, Tensor(), r, CUDA, has_bias);
  return {dx, dnw, dW, has_bias ? db : at::empty({0}, W.options())};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gpu_puzzles, m) {
  GP_IMPL(m, "layer_norm", layer_norm_op<false>, layer_norm_op<true>);
  GP_IMPL(m, "layer_norm_backward", layer_norm_backward_op<false>, layer_norm_backward_op<true>);
  GP_IMPL(m, "fused_layernorm_linear", fused_op<false>, fused_op<true>);
  GP_IMPL(m, "fused_layernorm_linear_backward", fused_backward_op<false>, fused_backward_op<true>);
  GP_IMPL(m, "fused_layernorm_linear_naive", naive_op<false>, naive_op<true>);
  GP_IMPL(m, "rms_norm", rms_norm_op<false>, rms_norm_op<true>);
  GP_IMPL(m, "rms_norm_backward", rms_norm_backward_op<false>, rms_norm_backward_op<true>);
  GP_IMPL(m, "fused_rmsnorm_linear", fused_rms_op<false>, fused_rms_op<true>);
  GP_IMPL(m, "fused_rmsnorm_linear_backward", fused_rms_backward_op<false>, fused_rms_backward_op<true>);
}

}  // namespace gpu_puzzles
