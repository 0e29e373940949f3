// cross_entropy and fused_linear_cross_entropy host side: argument checks, the plan,
// the CPU/CUDA calls and their registrations (kernels: cross_entropy_cpu.cpp,
// cross_entropy_cuda.cu). Logits are (..., V) with the classes last, target (...).
// The reductions across rows run in a fixed order (deterministic, no float atomics): the CPU
// sums in double, CUDA in one block (cross_entropy_reduce_cuda).
// Out-of-range targets (not ignore_index): a RuntimeError on the CPU; on CUDA the
// kernels never index with them, the row's loss is NaN (so is a mean or sum) and its
// gradient carries no one-hot term: no host synchronisation to check them.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <array>
#include <atomic>
#include <cmath>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/checks.h"
#include "common/cuda_launch.h"
#include "common/register.h"
#include "common/tensor_rows.h"
#include "cross_entropy/cross_entropy.h"
#include "cross_entropy/cross_entropy_plan.h"

namespace gpu_puzzles {
namespace {

using Tensor = at::Tensor;
using Tensor2 = std::tuple<Tensor, Tensor>;
using Tensor4 = std::tuple<Tensor, Tensor, Tensor, Tensor>;

enum class Reduction { None, Mean, Sum };

Reduction parse_reduction(c10::string_view r, const char* op) {
  if (r == "mean") return Reduction::Mean;
  if (r == "sum") return Reduction::Sum;
  if (r == "none") return Reduction::None;
  TORCH_CHECK(false, op, ": reduction must be one of 'mean', 'sum', 'none', got '", std::string(r), "'");
}

// target: int32/int64 of shape `rows_shape` (the logits' or hidden's shape without its last dim).
void check_target(const Tensor& target, at::IntArrayRef rows_shape, const Tensor& ref, const char* op,
                  const char* ref_name) {
  TORCH_CHECK(target.scalar_type() == at::kLong || target.scalar_type() == at::kInt, op,
              ": target must be an int64 or int32 tensor of class indices, got ", target.scalar_type());
  TORCH_CHECK(target.sizes() == rows_shape, op, ": target must have shape ", ref_name, ".shape[:-1] = ", rows_shape,
              ", got ", target.sizes());
  const std::string t = std::string(op) + ": target";
  check_same_device(target, ref, t.c_str(), ref_name);
}

// Logits (..., V), V >= 1.
void check_logits(const Tensor& logits, const char* op) {
  const std::string name = std::string(op) + ": logits";
  check_float(logits, name.c_str());
  TORCH_CHECK(logits.dim() >= 1, op, ": logits must have at least 1 dimension (..., num_classes), got a 0-d tensor");
  TORCH_CHECK(logits.size(-1) >= 1, op, ": logits must have at least one class (last dim), got shape ", logits.sizes());
}

// CPU: how many targets are not ignore_index (the mean's count) and, with V > 0, that every
// target is in [0, V) or ignore_index. One pass over the indices: a chain of tensor ops (the
// range check, ne + sum) cost ~30 us a call at small sizes. CUDA counts in its reduce kernel.
double kept_targets_cpu(const Tensor& target, int64_t ignore, int64_t V, const char* op) {
  const Tensor t = target.contiguous();
  const auto scan = [&](const auto* p) {
    int64_t kept = 0;
    for (int64_t i = 0; i < t.numel(); ++i) {
      const int64_t v = p[i];
      TORCH_CHECK(V <= 0 || v == ignore || (v >= 0 && v < V), op, ": target holds ", v, " at flat position ", i,
                  ", outside [0, ", V, ") and not ignore_index (", ignore, ")");
      kept += v != ignore;
    }
    return kept;
  };
  return static_cast<double>(t.scalar_type() == at::kLong ? scan(t.const_data_ptr<int64_t>())
                                                          : scan(t.const_data_ptr<int32_t>()));
}

// softcap: None (0: off) or a positive finite number.
double check_softcap(c10::optional<double> softcap, const char* op) {
  if (!softcap.has_value()) return 0;
  const double c = *softcap;
  TORCH_CHECK(c > 0 && std::isfinite(c), op, ": softcap must be a positive finite number or None, got ", c);
  return c;
}

void launch_forward(const CeFwdArgs& a, bool cpu) {
  if (a.rows == 0) return;
  if (cpu) {
    GP_CPU_CALL(cross_entropy_forward_cpu)(a);
    return;
  }
#ifdef WITH_CUDA
  GP_CUDA_CHECK_STATUS(cross_entropy_forward_cuda(a, current_stream()));
#else
  TORCH_CHECK(false, "gpu_puzzles was built without CUDA");
#endif
}

void launch_backward(const CeBwdArgs& a, bool cpu) {
  if (a.rows == 0) return;
  if (cpu) {
    GP_CPU_CALL(cross_entropy_backward_cpu)(a);
    return;
  }
#ifdef WITH_CUDA
  GP_CUDA_CHECK_STATUS(cross_entropy_backward_cuda(a, current_stream()));
#else
  TORCH_CHECK(false, "gpu_puzzles was built without CUDA");
#endif
}

// Per-row loss and lse (accumulate type, (rows,)) of logits (rows as (..., V)) into
// `loss` and `lse` (contiguous). CPU half logits are computed in float. With
// grad_scale (CUDA only) the kernel also overwrites the logits with their gradient.
// softcap: 0 or the checked cap.
void forward_rows(const Tensor& logits0, const Tensor& target, int64_t ignore, const Tensor& loss, const Tensor& lse,
                  double softcap, const Tensor& grad_scale = Tensor()) {
  const bool cpu = logits0.device().is_cpu();
  const Tensor logits = cpu && is_half(logits0.scalar_type()) ? logits0.to(at::kFloat) : logits0;
  const int64_t V = logits.size(-1), rows = loss.numel();
  const auto [lt, ls] = tensor_rows(logits, true);
  const auto [tt, ts] = tensor_rows(target, false);
  const CrossEntropyPlan plan = cross_entropy_plan(rows, V, logits.element_size());
  CeFwdArgs a{
      lt.data_ptr(), ls, tt.data_ptr(), tt.scalar_type() == at::kLong, ts,          loss.data_ptr(), lse.data_ptr(),
      rows,          V,  ignore,        to_dtype(lt.scalar_type()),    plan.threads};
  a.softcap = softcap;
  if (grad_scale.defined()) {
    TORCH_CHECK(!cpu && lt.data_ptr() == logits0.data_ptr(), "gpu_puzzles: in-place gradient rows need CUDA logits");
    a.grad_in_place = true;
    a.scale = grad_scale.data_ptr();
  }
  launch_forward(a, cpu);
}

// The backward's gradient takes the logits' strides when their rows are evenly spaced
// (one stride s >= V between rows, the last dim contiguous): padded rows, as inductor lays
// out a (.., 50257) GEMM output, then need no copy on either side, and the kernel's vectors
// see input and output rows at the same alignment. Otherwise contiguous. The fake kernel
// (gpu_puzzles/ops/cross_entropy.py) applies the same rule.
Tensor empty_grad_like(const Tensor& logits, const at::TensorOptions& opts) {
  RowStrides s;
  const int64_t V = logits.size(-1);
  const bool spaced = logits.stride(-1) == 1 &&
                      collapse_rows(logits.sizes().data(), logits.strides().data(), logits.dim() - 1, s) == 1 &&
                      s.s0 >= V;
  return spaced ? at::empty_strided(logits.sizes(), logits.strides(), opts) : at::empty(logits.sizes(), opts);
}

// grad: rows evenly spaced (empty_grad_like), or the logits themselves (in place) when grad is logits.
void backward_rows(const Tensor& logits, const Tensor& target, const Tensor& lse, const Tensor& scale, bool per_row,
                   int64_t ignore, double softcap, const Tensor& grad) {
  const bool cpu = logits.device().is_cpu();
  const int64_t V = logits.size(-1), rows = lse.numel();
  const auto [lt, ls] = tensor_rows(logits, true);
  const auto [tt, ts] = tensor_rows(target, false);
  RowStrides gs;
  const int levels = collapse_rows(grad.sizes().data(), grad.strides().data(), grad.dim() - 1, gs);
  TORCH_INTERNAL_ASSERT(levels <= 1 && grad.stride(-1) == 1, "cross_entropy: gradient rows must be evenly spaced");
  const int64_t grad_stride = levels == 1 ? gs.s0 : V;
  const CrossEntropyPlan plan = cross_entropy_plan(rows, V, logits.element_size());
  CeBwdArgs a{lt.data_ptr(),
              ls,
              tt.data_ptr(),
              tt.scalar_type() == at::kLong,
              ts,
              lse.data_ptr(),
              scale.data_ptr(),
              per_row,
              grad.data_ptr(),
              grad_stride,
              rows,
              V,
              ignore,
              to_dtype(lt.scalar_type()),
              plan.threads};
  a.softcap = softcap;
  launch_backward(a, cpu);
}

// CPU: a tensor of `shape` (0-d or (1,)) holding v, written in place: the loss's few
// scalar steps as ATen ops (sum, div by a wrapped scalar, cast) cost ~4 us each, several
// times the kernel at a small batch.
Tensor cpu_scalar(double v, at::IntArrayRef shape, const at::TensorOptions& opts) {
  Tensor r = at::empty(shape, opts);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, r.scalar_type(), "cpu_scalar",
                                  [&] { *r.data_ptr<scalar_t>() = static_cast<scalar_t>(v); });
  return r;
}

// CPU: the per-row losses (float or double, contiguous) summed in double, in order.
double sum_cpu(const Tensor& loss_rows) {
  double s = 0;
  AT_DISPATCH_FLOATING_TYPES(loss_rows.scalar_type(), "sum_cpu", [&] {
    const scalar_t* p = loss_rows.const_data_ptr<scalar_t>();
    for (int64_t i = 0; i < loss_rows.numel(); ++i) s += p[i];
  });
  return s;
}

#ifdef WITH_CUDA
// The single-block count/sum kernel (CeReduceArgs): the loss (loss_rows defined) or the
// backward's scale.
Tensor reduce_cuda(const Tensor& loss_rows, const Tensor& target, int64_t ignore, bool mean, const Tensor& grad_loss,
                   const at::TensorOptions& out_opts, at::ScalarType dtype) {
  const auto [tt, ts] = tensor_rows(target, false);
  Tensor out = at::empty({}, out_opts);
  const CeReduceArgs a{loss_rows.defined() ? loss_rows.data_ptr() : nullptr,
                       tt.data_ptr(),
                       tt.scalar_type() == at::kLong,
                       ts,
                       target.numel(),
                       ignore,
                       mean,
                       grad_loss.defined() ? grad_loss.data_ptr() : nullptr,
                       out.data_ptr(),
                       to_dtype(dtype)};
  GP_CUDA_CHECK_STATUS(cross_entropy_reduce_cuda(a, current_stream()));
  return out;
}
#endif

// The loss from the per-row losses (0 at ignored rows): as is, summed, or over the count
// (`kept`: the CPU's, from kept_targets_cpu).
Tensor finalize(const Tensor& loss_rows, const Tensor& target, int64_t ignore, Reduction red, at::ScalarType out,
                double kept) {
  if (red == Reduction::None) return loss_rows.view(target.sizes()).to(out);
#ifdef WITH_CUDA
  if (loss_rows.is_cuda())
    return reduce_cuda(loss_rows, target, ignore, red == Reduction::Mean, Tensor(), loss_rows.options().dtype(out),
                       out);
#endif
  const double s = sum_cpu(loss_rows);
  // 0 targets: 0 / 0 = nan, as PyTorch.
  return cpu_scalar(red == Reduction::Mean ? s / kept : s, {}, loss_rows.options().dtype(out));
}

// ---- cross_entropy ---------------------------------------------------------------

// The loss's dtype: loss_dtype (a floating type), else the logits'.
at::ScalarType loss_type(c10::optional<at::ScalarType> loss_dtype, at::ScalarType logits, const char* op) {
  if (!loss_dtype.has_value()) return logits;
  TORCH_CHECK(is_supported_float(*loss_dtype), op, ": loss_dtype must be float32, float64, float16 or bfloat16, got ",
              *loss_dtype);
  return *loss_dtype;
}

Tensor2 cross_entropy_impl(const Tensor& logits, const Tensor& target, int64_t ignore, c10::string_view reduction,
                           c10::optional<at::ScalarType> loss_dtype, c10::optional<double> softcap) {
  const char* op = "cross_entropy";
  check_logits(logits, op);
  const double cap = check_softcap(softcap, op);
  const at::ScalarType out_type = loss_type(loss_dtype, logits.scalar_type(), op);
  const Reduction red = parse_reduction(reduction, op);
  const auto rows_shape = logits.sizes().slice(0, logits.dim() - 1);
  check_target(target, rows_shape, logits, op, "logits");
  const int64_t V = logits.size(-1);
  const double kept = logits.device().is_cpu() ? kept_targets_cpu(target, ignore, V, op) : 0;
#ifdef WITH_CUDA
  c10::optional<c10::cuda::CUDAGuard> guard;
  if (logits.is_cuda()) guard.emplace(logits.device());
#endif
  const auto acc = acc_type(logits.scalar_type());
  const Tensor loss_rows = at::empty({target.numel()}, logits.options().dtype(acc));
  Tensor lse = at::empty(target.sizes(), logits.options().dtype(acc));
  forward_rows(logits, target, ignore, loss_rows, lse, cap);
  return {finalize(loss_rows, target, ignore, red, out_type, kept), lse};
}

Tensor cross_entropy_backward_impl(const Tensor& grad_loss, const Tensor& logits, const Tensor& target,
                                   const Tensor& lse, int64_t ignore, c10::string_view reduction,
                                   c10::optional<double> softcap) {
  const char* op = "cross_entropy_backward";
  check_logits(logits, op);
  const double cap = check_softcap(softcap, op);
  const Reduction red = parse_reduction(reduction, op);
  const auto rows_shape = logits.sizes().slice(0, logits.dim() - 1);
  check_target(target, rows_shape, logits, op, "logits");
  const auto acc = acc_type(logits.scalar_type());
  TORCH_CHECK(lse.scalar_type() == acc && lse.sizes() == rows_shape, op, ": lse must be the forward's ", acc,
              " tensor of shape ", rows_shape, ", got ", lse.scalar_type(), " ", lse.sizes());
  check_same_device(lse, logits, "cross_entropy_backward: lse", "logits");
  check_float(grad_loss, "cross_entropy_backward: grad_loss");
  check_same_device(grad_loss, logits, "cross_entropy_backward: grad_loss", "logits");
  if (red == Reduction::None) {
    TORCH_CHECK(grad_loss.sizes() == rows_shape, op, ": grad_loss must have shape ", rows_shape,
                " (reduction='none'), got ", grad_loss.sizes());
  } else {
    TORCH_CHECK(grad_loss.dim() == 0, op, ": grad_loss must be 0-d for reduction='", std::string(reduction),
                "', got shape ", grad_loss.sizes());
  }
#ifdef WITH_CUDA
  c10::optional<c10::cuda::CUDAGuard> guard;
  if (logits.is_cuda()) guard.emplace(logits.device());
#endif
  Tensor scale;
  if (red == Reduction::None) {
    scale = grad_loss.to(acc).reshape({-1}).contiguous();
#ifdef WITH_CUDA
  } else if (logits.is_cuda()) {
    // grad_loss is read in its own dtype (no cast kernel) when that shares the logits'
    // accumulate type, never in the logits' half dtype: a float32 grad_loss of 65536
    // (GradScaler's first scale, under autocast's float32 loss) would be inf in float16.
    const Tensor g = acc_type(grad_loss.scalar_type()) == acc ? grad_loss : grad_loss.to(acc);
    scale =
        reduce_cuda(Tensor(), target, ignore, red == Reduction::Mean, g, logits.options().dtype(acc), g.scalar_type())
            .reshape({1});
#endif
  } else {
    const double g = grad_loss.item<double>();  // on the CPU: no sync
    scale = cpu_scalar(red == Reduction::Sum ? g : g / kept_targets_cpu(target, ignore, 0, op), {1},
                       logits.options().dtype(acc));
  }
  const bool cpu_half = logits.device().is_cpu() && is_half(logits.scalar_type());
  Tensor grad = empty_grad_like(logits, logits.options());
  if (!cpu_half) {
    backward_rows(logits, target, lse.contiguous(), scale, red == Reduction::None, ignore, cap, grad);
    return grad;
  }
  const Tensor lg = logits.to(at::kFloat);
  Tensor g32 = at::empty(lg.sizes(), lg.options());
  backward_rows(lg, target, lse.contiguous(), scale, red == Reduction::None, ignore, cap, g32);
  grad.copy_(g32);
  return grad;
}

// ---- fused_linear_cross_entropy -----------------------------------------------------

// grad_weight (fp32 accumulator) += a^T-free product a @ b for half inputs: cuBLAS's
// half-in / float-out GEMM when ATen has it, else a half product added in float.
void accumulate_mm(Tensor& acc, const Tensor& a, const Tensor& b) {
  if (acc.scalar_type() == a.scalar_type()) {
    acc.addmm_(a, b);
    return;
  }
  static std::atomic<bool> dtype_mm_ok{true};
  if (dtype_mm_ok.load(std::memory_order_relaxed)) {
    try {
      at::addmm_out(acc, acc, a, b, acc.scalar_type());
      return;
    } catch (const c10::Error&) {
      dtype_mm_ok.store(false, std::memory_order_relaxed);
    }
  }
  acc.add_(at::mm(a, b));
}

Tensor4 fused_impl(const Tensor& hidden, const Tensor& weight, const Tensor& target, const c10::optional<Tensor>& bias,
                   int64_t ignore, c10::string_view reduction, std::array<bool, 3> mask,
                   c10::optional<at::ScalarType> loss_dtype, c10::optional<double> softcap) {
  const char* op = "fused_linear_cross_entropy";
  check_float(hidden, "fused_linear_cross_entropy: hidden");
  const double cap = check_softcap(softcap, op);
  const at::ScalarType out_type = loss_type(loss_dtype, hidden.scalar_type(), op);
  TORCH_CHECK(hidden.dim() >= 1, op, ": hidden must have at least 1 dimension (..., H), got a 0-d tensor");
  check_same_dtype(weight, hidden, "fused_linear_cross_entropy: weight", "hidden");
  check_same_device(weight, hidden, "fused_linear_cross_entropy: weight", "hidden");
  TORCH_CHECK(weight.dim() == 2, op, ": weight must be 2-D (num_classes, H), got shape ", weight.sizes());
  TORCH_CHECK(weight.size(0) >= 1, op, ": weight must have at least one class (row), got shape ", weight.sizes());
  TORCH_CHECK(weight.size(1) == hidden.size(-1), op, ": weight has shape ", weight.sizes(),
              " but hidden has H = ", hidden.size(-1), " (last dim); weight must be (num_classes, H)");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    check_same_dtype(*bias, hidden, "fused_linear_cross_entropy: bias", "hidden");
    check_same_device(*bias, hidden, "fused_linear_cross_entropy: bias", "hidden");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0), op, ": bias must have shape (", weight.size(0),
                ",), got ", bias->sizes());
  }
  const Reduction red = parse_reduction(reduction, op);
  TORCH_CHECK(red != Reduction::None, op,
              ": reduction must be 'mean' or 'sum': the gradients are computed in the forward and scaled by "
              "one number in the backward; for per-row losses use cross_entropy(F.linear(hidden, weight, bias), "
              "target, reduction='none'); got 'none'");
  const auto rows_shape = hidden.sizes().slice(0, hidden.dim() - 1);
  check_target(target, rows_shape, hidden, op, "hidden");
  const int64_t V = weight.size(0), H = weight.size(1), N = target.numel();
  const bool cpu = hidden.device().is_cpu();
  const double kept = cpu ? kept_targets_cpu(target, ignore, V, op) : 0;
  if (cpu && is_half(hidden.scalar_type())) {  // the CPU computes half types in float
    const auto f = [](const Tensor& t) { return t.to(at::kFloat); };
    auto [l, gh, gw, gb] = fused_impl(f(hidden), f(weight), target, has_bias ? c10::optional<Tensor>(f(*bias)) : bias,
                                      ignore, reduction, mask, out_type, softcap);
    const auto dt = hidden.scalar_type();
    return {l, gh.to(dt), gw.to(dt), gb.to(dt)};
  }
#ifdef WITH_CUDA
  c10::optional<c10::cuda::CUDAGuard> guard;
  if (!cpu) guard.emplace(hidden.device());
#endif
  const auto dt = hidden.scalar_type();
  const auto acc = acc_type(dt);
  const bool want_h = mask[0], want_w = mask[1], want_b = mask[2] && has_bias;
  const bool any = want_h || want_w || want_b;
  const Tensor h2 = hidden.reshape({N, H});
  const Tensor t1 = target.reshape({N}).contiguous();
  const Tensor loss_rows = at::empty({N}, hidden.options().dtype(acc));
  Tensor scale;
  // The scale of a loss of 1; 0 targets: inf, unused (every row is ignored).
  if (any) {
#ifdef WITH_CUDA
    if (!cpu)
      scale = reduce_cuda(Tensor(), t1, ignore, red == Reduction::Mean, Tensor(), hidden.options().dtype(acc), dt)
                  .reshape({1});
#endif
    if (cpu) {
      scale = cpu_scalar(red == Reduction::Mean ? 1.0 / kept : 1.0, {1}, hidden.options().dtype(acc));
    }
  }
  // fp16: the per-element gradient (p - onehot) / count falls below fp16's range at large
  // V and N (p ~ 1/V), so the chunk gradients are unscaled and the scale applied at the end.
  const bool late_scale = any && dt == at::kHalf;
  const Tensor kernel_scale = late_scale ? at::ones({1}, hidden.options().dtype(acc)) : scale;
  Tensor gh = want_h ? at::empty({N, H}, hidden.options()) : at::empty({0}, hidden.options());
  // Weight and bias gradients sum over every chunk: in the accumulate type (gw below).
  Tensor gb = want_b ? at::zeros({V}, weight.options().dtype(acc)) : at::empty({0}, weight.options());
  const int64_t chunk = cross_entropy_plan(N, V, hidden.element_size()).chunk_rows;
  // On CUDA the GEMMs run over V rounded up to 16 bytes of elements, against a copy of the
  // weight (and bias) with zero rows appended: with an odd V (GPT-2: 50257) cuBLAS runs its
  // unaligned kernels for all three GEMMs, 3-4x slower on an H100. The zero rows give zero
  // logits, which meet zero weight rows in the hidden gradient and only fill weight-gradient
  // rows that are dropped; the loss reads the first V columns.
  const int64_t per16 = std::max<int64_t>(1, 16 / hidden.element_size());
  const int64_t Vp = cpu ? V : (V + per16 - 1) / per16 * per16;
  const auto pad_rows = [&](const Tensor& t) {  // dim 0 to Vp, zeros after
    if (Vp == V) return t;
    std::vector<int64_t> pad(2 * t.dim(), 0);  // last dim first: the final entry pads dim 0's end
    pad.back() = Vp - V;
    return at::constant_pad_nd(t, pad);
  };
  Tensor wp = pad_rows(weight), wt = wp.t();
  c10::optional<Tensor> bp = has_bias ? c10::optional<Tensor>(pad_rows(*bias)) : c10::nullopt;
  Tensor gw = want_w ? at::zeros({Vp, H}, weight.options().dtype(acc)) : at::empty({0}, weight.options());
  Tensor buf;
  for (int64_t s = 0; s < N; s += chunk) {
    const int64_t n = std::min(chunk, N - s);
    const Tensor hc = h2.narrow(0, s, n);
    const Tensor tc = t1.narrow(0, s, n);
    if (!buf.defined()) buf = at::empty({n, Vp}, hidden.options());
    Tensor full = buf.narrow(0, 0, n);
    if (bp) {
      at::addmm_out(full, *bp, hc, wt);
    } else {
      at::mm_out(full, hc, wt);
    }
    const Tensor logits = full.narrow(1, 0, V);  // (n, V), rows Vp apart
    const Tensor lse = at::empty({n}, hidden.options().dtype(acc));
    // d loss / d logits over the logits, in place: in the forward kernel on CUDA (the row
    // is still in L2), a second pass on the CPU.
    forward_rows(logits, tc, ignore, loss_rows.narrow(0, s, n), lse, cap, any && !cpu ? kernel_scale : Tensor());
    if (!any) continue;
    if (cpu) backward_rows(logits, tc, lse, kernel_scale, false, ignore, cap, logits);
    if (want_h) {
      Tensor ghc = gh.narrow(0, s, n);
      at::mm_out(ghc, full, wp);
    }
    if (want_w) accumulate_mm(gw, full.t(), hc);
    if (want_b) gb.add_(logits.sum(0, false, acc));
  }
  // Freed before the weight gradient's conversion below allocates: the chunk's logits and
  // the padded weight would otherwise add to the op's peak.
  buf.reset();
  wt.reset();
  wp.reset();
  bp.reset();
  if (want_w && Vp != V) gw = gw.narrow(0, 0, V);
  const Tensor loss = finalize(loss_rows, t1, ignore, red, out_type, kept);
  if (late_scale) {
    const Tensor s0 = scale.reshape({});
    if (want_h) gh.mul_(s0);
    if (want_w) gw.mul_(s0);
    if (want_b) gb.mul_(s0);
  }
  if (want_h) gh = gh.view(hidden.sizes());
  if (want_w && gw.scalar_type() != dt) gw = gw.to(dt);
  if (want_b && gb.scalar_type() != dt) gb = gb.to(dt);
  return {loss, gh, gw, gb};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gpu_puzzles, m) {
  // One kernel per op for both backends: the device is dispatched inside (the fused op's
  // GEMMs are ATen's on either).
  m.impl("cross_entropy", torch::dispatch(c10::DispatchKey::CPU, &cross_entropy_impl));
  m.impl("cross_entropy_backward", torch::dispatch(c10::DispatchKey::CPU, &cross_entropy_backward_impl));
  m.impl("fused_linear_cross_entropy", torch::dispatch(c10::DispatchKey::CPU, &fused_impl));
#ifdef WITH_CUDA
  m.impl("cross_entropy", torch::dispatch(c10::DispatchKey::CUDA, &cross_entropy_impl));
  m.impl("cross_entropy_backward", torch::dispatch(c10::DispatchKey::CUDA, &cross_entropy_backward_impl));
  m.impl("fused_linear_cross_entropy", torch::dispatch(c10::DispatchKey::CUDA, &fused_impl));
#endif
}

}  // namespace gpu_puzzles
