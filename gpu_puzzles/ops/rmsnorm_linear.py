"""RMSNorm and fused RMSNorm+Linear: ``torch.ops.gpu_puzzles.rms_norm``,
``torch.ops.gpu_puzzles.fused_rmsnorm_linear``.

rms_norm(x) = x * rsqrt(mean(x^2 over the last dim) + eps) * weight, statistics in float32
(float64 for float64 inputs), as ``torch.nn.functional.rms_norm`` and Llama's RMSNorm.

fused_rmsnorm_linear(x, ...) = F.linear(rms_norm(x, norm_weight), W, b). The LayerNorm
kernels with the mean forced to zero and no beta, and the same two plans (knob
``layernorm_linear_plan``): "normalize" writes rms_norm(x) and runs one GEMM; "fold" runs
the GEMM on x against W * norm_weight and applies rstd in its epilogue. W may be any 2-D
view with a unit stride (it is not copied; its gradient comes back in its layout). See
csrc/norms/layernorm_linear.cpp.
"""
from typing import Optional

import torch
from torch import Tensor

from ._common import register_fake


def _rstd_like(x):
    return x.new_empty(x.shape[:-1], dtype=torch.float64 if x.dtype == torch.float64 else torch.float32)


# ---- fake kernels: output shapes only (the C++ kernels validate the arguments) ------

@register_fake("gpu_puzzles::rms_norm")
def _rms_norm_fake(x, weight, eps=None):
    return x.new_empty(x.shape), _rstd_like(x)


@register_fake("gpu_puzzles::rms_norm_backward")
def _rms_norm_backward_fake(grad_out, x, weight, rstd):
    return x.new_empty(x.shape), x.new_empty(weight.shape)


@register_fake("gpu_puzzles::fused_rmsnorm_linear")
def _fused_rms_fake(x, norm_weight, linear_weight, linear_bias=None, eps=None):
    return x.new_empty((*x.shape[:-1], linear_weight.shape[0]), dtype=linear_weight.dtype), _rstd_like(x)


@register_fake("gpu_puzzles::fused_rmsnorm_linear_backward")
def _fused_rms_backward_fake(grad_out, x, norm_weight, linear_weight, rstd, has_bias):
    N, H = linear_weight.shape
    W = linear_weight
    # dW in W's layout (the C++ w_transposed): (H, N) memory for a transposed W.
    dW = W.new_empty((H, N)).t() if not W.is_contiguous() and W.t().is_contiguous() else W.new_empty((N, H))
    return x.new_empty(x.shape), x.new_empty((H,)), dW, W.new_empty((N,) if has_bias else (0,))


# Autograd is registered in C++ (csrc/norms/layernorm_linear_autograd.cpp).

_rms_norm = torch.ops.gpu_puzzles.rms_norm.default
_fused = torch.ops.gpu_puzzles.fused_rmsnorm_linear.default

def _eps(x, eps):
    """F.rms_norm's eps: None means the epsilon of the statistics' dtype (ATen's opmath type):
    float32's for float32 and half x, float64's for float64 x."""
    if eps is not None:
        return eps
    return torch.finfo(torch.float64 if x.dtype == torch.float64 else torch.float32).eps


def _ones_if_none(x, weight, op, arg):
    """``None`` weight -> ones (F.rms_norm without a weight); F's ``normalized_shape`` in its
    place is refused by name (we normalise over the last dim only)."""
    if weight is None:
        torch._check(x.dim() >= 1, lambda: f"{op}: x must have at least one dimension, got a scalar")
        return x.new_ones(x.shape[-1])
    if not isinstance(weight, Tensor):
        raise TypeError(f"{op}: {arg} must be a tensor (H,) or None, got {type(weight).__name__}; {op} "
                        f"normalises over the last dim and takes no normalized_shape")
    return weight


def rms_norm(x: Tensor, weight: Optional[Tensor] = None, eps: Optional[float] = None) -> Tensor:
    """RMSNorm over the last dimension: ``x * rsqrt(mean(x^2) + eps) * weight``.

    Same as ``F.rms_norm(x, (H,), weight, eps)``: ``weight`` ``(H,)`` or ``None`` (ones);
    ``eps=None`` is F's default, the epsilon of the statistics' dtype (float32's, 1.19e-7,
    for float32, float16 and bfloat16 x; float64's for float64 x). Statistics in float32
    (float64 for float64 x). The op underneath, ``torch.ops.gpu_puzzles.rms_norm``, takes
    a weight tensor and a float eps (its schema default, 1e-6, is Llama's).
    """
    return _rms_norm(x, _ones_if_none(x, weight, "rms_norm", "weight"), _eps(x, eps))[0]


def fused_rmsnorm_linear(x: Tensor, norm_weight: Optional[Tensor], linear_weight: Tensor,
                         linear_bias: Optional[Tensor] = None, eps: Optional[float] = None) -> Tensor:
    """``F.linear(rms_norm(x, norm_weight, eps), linear_weight, linear_bias)``, fused.

    ``x (..., H)``, ``norm_weight (H,)`` (``None``: ones), ``linear_weight (N, H)`` (any view
    with a unit stride, e.g. ``weight.t()`` of an ``(H, N)`` parameter), ``linear_bias (N,)``
    or ``None``; returns ``(..., N)``. ``eps`` as :func:`rms_norm`'s (``None``: F.rms_norm's
    default). Only x and the row statistics are saved for the backward (the normalised
    activation is recomputed there). A float32 ``x`` may come with a float16/bfloat16
    ``linear_weight`` (as ``torch.autocast`` hands them over): the norm runs in float32, the
    linear and the output in ``linear_weight``'s dtype.
    """
    return _fused(x, _ones_if_none(x, norm_weight, "fused_rmsnorm_linear", "norm_weight"), linear_weight, linear_bias,
                  _eps(x, eps))[0]
