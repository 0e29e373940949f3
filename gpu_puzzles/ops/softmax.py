"""Softmax and log-softmax over one dim: ``torch.ops.gpu_puzzles.softmax`` / ``log_softmax``.

softmax(x)_i = exp(x_i - max x) / sum_j exp(x_j - max x), computed with the max
subtracted (numerically stable); statistics in float32 (float64 for float64).
The backward ops take the forward's *output*: softmax dx = y (dy - sum(dy y)),
log_softmax dx = dy - exp(y) sum(dy).
"""
from typing import Optional

import torch
from torch import Tensor

from ._common import register_fake


# The fake kernels only give the output's shape; the C++ ops check the arguments
# (dim, algorithm, dtypes, shapes) with messages naming them. Outputs are fresh
# contiguous tensors whatever the inputs' strides (the CUDA rows read strided
# inputs in place, without a copy), as new_empty gives.
@register_fake("gpu_puzzles::softmax")
def _softmax_fake(x, *_):  # dim, algorithm: not needed for the shape
    return x.new_empty(x.shape)


@register_fake("gpu_puzzles::log_softmax")
def _log_softmax_fake(x, *_):
    return x.new_empty(x.shape)


@register_fake("gpu_puzzles::softmax_backward")
def _softmax_backward_fake(grad_out, out, *_):
    return out.new_empty(out.shape)


@register_fake("gpu_puzzles::log_softmax_backward")
def _log_softmax_backward_fake(grad_out, out, *_):
    return out.new_empty(out.shape)


# Autograd is registered in C++ (csrc/softmax/softmax_autograd.cpp; why: csrc/common/autograd.h).
_softmax = torch.ops.gpu_puzzles.softmax.default  # the overloads: no packet lookup per call
_log_softmax = torch.ops.gpu_puzzles.log_softmax.default


def softmax(x: Tensor, dim: int = -1, *, dtype: Optional[torch.dtype] = None, algorithm: str = "auto") -> Tensor:
    """Softmax of ``x`` over ``dim`` (any rank, including 0-d; any dim, negative too).

    Matches ``torch.softmax`` / ``F.softmax(x, dim, dtype=dtype)`` (``x`` cast to ``dtype``
    first), including its NaN for a row of all ``-inf`` and for a row holding ``+inf``.
    ``dim`` defaults to -1 (F's deprecated implicit choice is not followed).
    Differentiable; the backward reuses the output.

    ``algorithm`` picks the CUDA kernel: ``"auto"`` (fastest), or the curriculum's
    steps ``"tree"``, ``"shuffle"`` and ``"online"`` (see the notebook); the CPU
    ignores it.
    """
    if dtype is not None:
        x = x.to(dtype)
    return _softmax(x, dim, algorithm)


def log_softmax(x: Tensor, dim: int = -1, *, dtype: Optional[torch.dtype] = None, algorithm: str = "auto") -> Tensor:
    """Log-softmax of ``x`` over ``dim``: ``x - max - log(sum(exp(x - max)))``.

    Same shapes, dtypes, ``dtype`` and ``algorithm`` choices as :func:`softmax`
    (``F.log_softmax(x, dim, dtype=dtype)``).
    """
    if dtype is not None:
        x = x.to(dtype)
    return _log_softmax(x, dim, algorithm)
