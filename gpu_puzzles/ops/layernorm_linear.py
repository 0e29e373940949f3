"""LayerNorm and fused LayerNorm+Linear: ``torch.ops.gpu_puzzles.layer_norm``,
``torch.ops.gpu_puzzles.fused_layernorm_linear``.

layer_norm(x) = (x - mean) / sqrt(var + eps) * weight + bias over the last dim,
biased variance, statistics in float32 (float64 for float64 inputs).

fused_layernorm_linear(x, ...) = F.linear(layer_norm(x, ln_weight, ln_bias), W, b),
computed without writing layer_norm(x): the GEMM runs on x against W with
ln_weight folded in and its rows centred, and our epilogue applies the per-row
statistics (see csrc/layernorm_linear/layernorm_linear.cpp for the algebra and
the large-mean guard).
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ._common import check_float, check_same


def _stat_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _check_ln(x, weight, bias, op, prefix=""):
    torch._check(x.dim() >= 1, lambda: f"{op}: x must have at least one dimension, got a scalar")
    check_float(x, f"{op}: x")
    H = x.shape[-1]
    torch._check(H >= 1, lambda: f"{op}: x's last dimension (hidden size) must be >= 1, got shape {tuple(x.shape)}")
    for t, name in ((weight, "weight"), (bias, "bias")):
        check_same(t, x, f"{op}: {prefix}{name}", "x")
        torch._check(t.dim() == 1 and t.shape[0] == H,
                     lambda: f"{op}: {prefix}{name} must have shape ({H},) to match x's last dimension, "
                             f"got {tuple(t.shape)}")
    return H


def _check_linear(x, W, b, H, op):
    check_same(W, x, f"{op}: linear_weight", "x")
    torch._check(W.dim() == 2 and W.shape[1] == H,
                 lambda: f"{op}: linear_weight must have shape (N, {H}) to match x's last dimension, "
                         f"got {tuple(W.shape)}")
    N = W.shape[0]
    if b is not None:
        check_same(b, x, f"{op}: linear_bias", "x")
        torch._check(b.dim() == 1 and b.shape[0] == N,
                     lambda: f"{op}: linear_bias must have shape ({N},) to match linear_weight, got {tuple(b.shape)}")
    return N


def _stats_like(x):
    return (x.new_empty(x.shape[:-1], dtype=_stat_dtype(x)), x.new_empty(x.shape[:-1], dtype=_stat_dtype(x)))


# ---- layer_norm ------------------------------------------------------------------

@torch.library.register_fake("gpu_puzzles::layer_norm")
def _layer_norm_fake(x, weight, bias, eps=1e-5):
    _check_ln(x, weight, bias, "layer_norm")
    return (x.new_empty(x.shape), *_stats_like(x))


@torch.library.register_fake("gpu_puzzles::layer_norm_backward")
def _layer_norm_backward_fake(grad_out, x, weight, mean, rstd):
    H = _check_ln(x, weight, weight, "layer_norm_backward")
    torch._check(grad_out.shape == x.shape, lambda: "layer_norm_backward: grad_out must have x's shape")
    return x.new_empty(x.shape), x.new_empty((H,)), x.new_empty((H,))


# Autograd is registered in C++ (csrc/layernorm_linear/layernorm_linear_autograd.cpp; why: csrc/common/autograd.h).


# ---- fused_layernorm_linear -------------------------------------------------------

@torch.library.register_fake("gpu_puzzles::fused_layernorm_linear")
def _fused_fake(x, ln_weight, ln_bias, linear_weight, linear_bias=None, eps=1e-5):
    op = "fused_layernorm_linear"
    H = _check_ln(x, ln_weight, ln_bias, op, prefix="ln_")
    N = _check_linear(x, linear_weight, linear_bias, H, op)
    return (x.new_empty((*x.shape[:-1], N)), *_stats_like(x))


@torch.library.register_fake("gpu_puzzles::fused_layernorm_linear_backward")
def _fused_backward_fake(grad_out, x, ln_weight, ln_bias, linear_weight, mean, rstd):
    op = "fused_layernorm_linear_backward"
    H = _check_ln(x, ln_weight, ln_bias, op, prefix="ln_")
    N = _check_linear(x, linear_weight, None, H, op)
    torch._check(grad_out.shape == (*x.shape[:-1], N), lambda: f"{op}: grad_out must have the output's shape")
    return (x.new_empty(x.shape), x.new_empty((H,)), x.new_empty((H,)), x.new_empty((N, H)), x.new_empty((N,)))


@torch.library.register_fake("gpu_puzzles::fused_layernorm_linear_naive")
def _naive_fake(x, ln_weight, ln_bias, linear_weight, linear_bias=None, eps=1e-5):
    op = "fused_layernorm_linear_naive"
    H = _check_ln(x, ln_weight, ln_bias, op, prefix="ln_")
    N = _check_linear(x, linear_weight, linear_bias, H, op)
    return x.new_empty((*x.shape[:-1], N))


_layer_norm = torch.ops.gpu_puzzles.layer_norm.default  # the overloads: no packet lookup per call
_fused = torch.ops.gpu_puzzles.fused_layernorm_linear.default


# ---- public functions ----------------------------------------------------------------

def _affine(x, weight, bias):
    if weight is not None and bias is not None:
        return weight, bias
    torch._check(x.dim() >= 1, lambda: "layer_norm: x must have at least one dimension, got a scalar")
    H = x.shape[-1]
    if weight is None:
        weight = x.new_ones(H)
    if bias is None:
        bias = x.new_zeros(H)
    return weight, bias


def layer_norm(x: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None,
               eps: float = 1e-5) -> Tensor:
    """LayerNorm over the last dimension: ``(x - mean) / sqrt(var + eps) * weight + bias``.

    Biased variance; statistics in float32 (float64 for float64 x). ``weight`` and
    ``bias`` have shape ``(H,)``; ``None`` means ones / zeros. Same as
    ``F.layer_norm(x, (H,), weight, bias, eps)``.
    """
    weight, bias = _affine(x, weight, bias)
    return _layer_norm(x, weight, bias, eps)[0]


def fused_layernorm_linear(x: Tensor, ln_weight: Optional[Tensor], ln_bias: Optional[Tensor], linear_weight: Tensor,
                           linear_bias: Optional[Tensor] = None, eps: float = 1e-5) -> Tensor:
    """``F.linear(F.layer_norm(x, (H,), ln_weight, ln_bias, eps), linear_weight, linear_bias)``, fused.

    ``x (..., H)``, ``ln_weight``/``ln_bias (H,)`` (``None``: ones / zeros),
    ``linear_weight (N, H)``, ``linear_bias (N,)`` or ``None``; returns ``(..., N)``.
    The normalised activation is never written to memory, forward or saved for
    the backward (which recomputes it); the backward returns all five gradients.
    """
    ln_weight, ln_bias = _affine(x, ln_weight, ln_bias)
    return _fused(x, ln_weight, ln_bias, linear_weight, linear_bias, eps)[0]


def unfused_layernorm_linear(x: Tensor, ln_weight: Optional[Tensor], ln_bias: Optional[Tensor],
                             linear_weight: Tensor, linear_bias: Optional[Tensor] = None, eps: float = 1e-5) -> Tensor:
    """Same result as :func:`fused_layernorm_linear`, as two steps: our :func:`layer_norm`
    writes the normalised activation, then ``F.linear`` (cuBLAS) reads it. For comparison."""
    # Plain checks (not torch._check with closures) so that torch.compile traces this function.
    op = "unfused_layernorm_linear"
    for t, name in ((linear_weight, "linear_weight"), (linear_bias, "linear_bias")):
        if t is not None and (t.dtype != x.dtype or t.device != x.device):
            raise RuntimeError(f"{op}: {name} has dtype {t.dtype} on {t.device} but x has dtype {x.dtype} on "
                               f"{x.device}; they must match")
    if x.dim() >= 1 and (linear_weight.dim() != 2 or linear_weight.shape[1] != x.shape[-1]):
        raise RuntimeError(f"{op}: linear_weight must have shape (N, {x.shape[-1]}) to match x's last dimension, "
                           f"got {tuple(linear_weight.shape)}")
    if linear_bias is not None and (linear_bias.dim() != 1 or linear_bias.shape[0] != linear_weight.shape[0]):
        raise RuntimeError(f"{op}: linear_bias must have shape ({linear_weight.shape[0]},) to match linear_weight, "
                           f"got {tuple(linear_bias.shape)}")
    return F.linear(layer_norm(x, ln_weight, ln_bias, eps), linear_weight, linear_bias)
