"""LayerNorm and fused LayerNorm+Linear: ``torch.ops.gpu_puzzles.layer_norm``,
``torch.ops.gpu_puzzles.fused_layernorm_linear``.

layer_norm(x) = (x - mean) / sqrt(var + eps) * weight + bias over the last dim,
biased variance, statistics in float32 (float64 for float64 inputs).

fused_layernorm_linear(x, ...) = F.linear(layer_norm(x, ln_weight, ln_bias), W, b),
by the cheaper of two plans (by the bytes each moves; knob ``layernorm_linear_plan``):
"fold" runs the GEMM on x against W with ln_weight folded in and its rows centred, and
an epilogue applies the per-row statistics, never writing layer_norm(x); "normalize"
writes layer_norm(x) and runs one cuBLAS GEMM with the bias in its epilogue. W may be any
2-D view with a unit stride (GPT-2's Conv1D ``weight.t()``): it is not copied, and its
gradient comes back in its layout. See csrc/norms/layernorm_linear.cpp for the
algebra and the large-mean guard, layernorm_linear_plan.h for the choice.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ._common import register_fake, schema_default


def _stat_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _stats_like(x):
    return (x.new_empty(x.shape[:-1], dtype=_stat_dtype(x)), x.new_empty(x.shape[:-1], dtype=_stat_dtype(x)))


# ---- fake kernels: output shapes only (the C++ kernels validate the arguments) ------

@register_fake("gpu_puzzles::layer_norm")
def _layer_norm_fake(x, weight, bias, eps=None):  # eps: not needed for shapes
    return (x.new_empty(x.shape), *_stats_like(x))


@register_fake("gpu_puzzles::layer_norm_backward")
def _layer_norm_backward_fake(grad_out, x, weight, mean, rstd):
    return x.new_empty(x.shape), x.new_empty(weight.shape), x.new_empty(weight.shape)


# Autograd is registered in C++ (csrc/norms/layernorm_linear_autograd.cpp; why: csrc/common/autograd.h).


@register_fake("gpu_puzzles::fused_layernorm_linear")
def _fused_fake(x, ln_weight, ln_bias, linear_weight, linear_bias=None, eps=None):
    return (x.new_empty((*x.shape[:-1], linear_weight.shape[0]), dtype=linear_weight.dtype), *_stats_like(x))


@register_fake("gpu_puzzles::fused_layernorm_linear_backward")
def _fused_backward_fake(grad_out, x, ln_weight, ln_bias, linear_weight, mean, rstd):
    N, H = linear_weight.shape
    # dW in W's layout (the C++ w_transposed): (H, N) memory for a transposed W.
    W = linear_weight
    dW = W.new_empty((H, N)).t() if not W.is_contiguous() and W.t().is_contiguous() else W.new_empty((N, H))
    return (x.new_empty(x.shape), x.new_empty((H,)), x.new_empty((H,)), dW, W.new_empty((N,)))


@register_fake("gpu_puzzles::fused_layernorm_linear_naive")
def _naive_fake(x, ln_weight, ln_bias, linear_weight, linear_bias=None, eps=None):
    return x.new_empty((*x.shape[:-1], linear_weight.shape[0]))


_layer_norm = torch.ops.gpu_puzzles.layer_norm.default  # the overloads: no packet lookup per call
_fused = torch.ops.gpu_puzzles.fused_layernorm_linear.default
_naive = torch.ops.gpu_puzzles.fused_layernorm_linear_naive.default


_EPS = schema_default(_layer_norm, "eps")  # the default is written in the schema only


# ---- public functions ----------------------------------------------------------------

def _affine(x, weight, bias, op="layer_norm", names=("weight", "bias")):
    """``None`` -> ones / zeros, as F.layer_norm; F's ``normalized_shape`` in the weight's
    place is refused by name (we normalise over the last dim only)."""
    if isinstance(weight, Tensor) and isinstance(bias, Tensor):
        return weight, bias
    for t, name in ((weight, names[0]), (bias, names[1])):
        if t is not None and not isinstance(t, Tensor):
            raise TypeError(f"{op}: {name} must be a tensor (H,) or None, got {type(t).__name__}; {op} normalises "
                            f"over the last dim and takes no normalized_shape")
    torch._check(x.dim() >= 1, lambda: f"{op}: x must have at least one dimension, got a scalar")
    H = x.shape[-1]
    if weight is None:
        weight = x.new_ones(H)
    if bias is None:
        bias = x.new_zeros(H)
    return weight, bias


def layer_norm(x: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None,
               eps: float = _EPS) -> Tensor:
    """LayerNorm over the last dimension: ``(x - mean) / sqrt(var + eps) * weight + bias``.

    Biased variance; statistics in float32 (float64 for float64 x). ``weight`` and
    ``bias`` have shape ``(H,)``; ``None`` means ones / zeros. Same as
    ``F.layer_norm(x, (H,), weight, bias, eps)``, default eps included; there is no
    ``normalized_shape`` argument (a shape passed in the weight's place raises).
    """
    weight, bias = _affine(x, weight, bias)
    return _layer_norm(x, weight, bias, eps)[0]


ALGORITHMS = ("auto", "naive", "unfused")


def fused_layernorm_linear(x: Tensor, ln_weight: Optional[Tensor], ln_bias: Optional[Tensor], linear_weight: Tensor,
                           linear_bias: Optional[Tensor] = None, eps: float = _EPS, *,
                           algorithm: str = "auto") -> Tensor:
    """``F.linear(F.layer_norm(x, (H,), ln_weight, ln_bias, eps), linear_weight, linear_bias)``, fused.

    ``x (..., H)``, ``ln_weight``/``ln_bias (H,)`` (``None``: ones / zeros),
    ``linear_weight (N, H)``, ``linear_bias (N,)`` or ``None``; returns ``(..., N)``. ``eps``
    may come by position, as in :func:`layer_norm` and :func:`fused_rmsnorm_linear`.

    ``algorithm``:

    * ``"auto"``: the fused op, by the cheaper plan for the shape and W's layout ("fold":
      the normalised activation is never written; "normalize": written once and read by
      one GEMM). Nothing is saved but x and the row statistics (the backward recomputes
      the normalised activation); the backward returns all five gradients, the weight's
      in the weight's layout. A float32 ``x`` may come with a float16/bfloat16
      ``linear_weight`` (as ``torch.autocast`` hands them over): the norm runs in float32,
      the linear and the output in ``linear_weight``'s dtype.
    * ``"naive"``: the curriculum's kernel (one thread per row computes the statistics,
      then all N outputs; ``torch.ops.gpu_puzzles.fused_layernorm_linear_naive``).
      Forward only: it raises if a gradient would be needed.
    * ``"unfused"``: two steps for comparison: our :func:`layer_norm` writes the
      normalised activation, then ``F.linear`` (cuBLAS) reads it.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"fused_layernorm_linear: algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    ln_weight, ln_bias = _affine(x, ln_weight, ln_bias, "fused_layernorm_linear", ("ln_weight", "ln_bias"))
    if algorithm == "auto":
        return _fused(x, ln_weight, ln_bias, linear_weight, linear_bias, eps)[0]
    if algorithm == "naive":
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                           for t in (x, ln_weight, ln_bias, linear_weight, linear_bias)):
            raise RuntimeError("fused_layernorm_linear: algorithm='naive' (the curriculum kernel) is forward only "
                               "and an input requires grad; use algorithm='auto', or call it under torch.no_grad()")
        return _naive(x, ln_weight, ln_bias, linear_weight, linear_bias, eps)
    # "unfused". Plain checks (not torch._check with closures) so that torch.compile traces them.
    op = "fused_layernorm_linear(algorithm='unfused')"
    mixed = x.dtype == torch.float32 and linear_weight.dtype in (torch.float16, torch.bfloat16)
    for t, name in ((linear_weight, "linear_weight"), (linear_bias, "linear_bias")):
        if t is not None and ((t.dtype != x.dtype and not mixed) or t.device != x.device):
            raise RuntimeError(f"{op}: {name} has dtype {t.dtype} on {t.device} but x has dtype {x.dtype} on "
                               f"{x.device}; they must match")
    if x.dim() >= 1 and (linear_weight.dim() != 2 or linear_weight.shape[1] != x.shape[-1]):
        raise RuntimeError(f"{op}: linear_weight must have shape (N, {x.shape[-1]}) to match x's last dimension, "
                           f"got {tuple(linear_weight.shape)}")
    if linear_bias is not None and (linear_bias.dim() != 1 or linear_bias.shape[0] != linear_weight.shape[0]):
        raise RuntimeError(f"{op}: linear_bias must have shape ({linear_weight.shape[0]},) to match linear_weight, "
                           f"got {tuple(linear_bias.shape)}")
    return F.linear(layer_norm(x, ln_weight, ln_bias, eps).to(linear_weight.dtype), linear_weight, linear_bias)
