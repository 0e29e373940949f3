"""Depthwise 1D convolution: ``torch.ops.gpu_puzzles.conv1d``.

out[..., c, i] = bias[c] + sum_j x[..., c, i - s + j] * weight[c, j], zero outside
the sequence, where s = 0 (the seed's look-ahead form) or s = K - 1 (causal).
"""
from typing import Optional

import torch
from torch import Tensor

from ._common import check_float, check_same

_ALGORITHMS = ("auto", "fast", "tiled", "naive")


def _check(x, weight, bias, algorithm):
    torch._check(1 <= x.dim() <= 3, lambda: f"conv1d: x must be 1-D, 2-D or 3-D, got shape {tuple(x.shape)}")
    check_float(x, "conv1d: x")
    check_same(weight, x, "conv1d: weight", "x")
    want_wdim = 1 if x.dim() == 1 else 2
    torch._check(weight.dim() == want_wdim,
                 lambda: f"conv1d: weight must be {want_wdim}-D for a {x.dim()}-D x, got shape {tuple(weight.shape)}")
    C = 1 if x.dim() == 1 else x.shape[-2]
    if x.dim() > 1:
        torch._check(weight.shape[0] == C, lambda: f"conv1d: weight has {weight.shape[0]} channels but x has {C}")
    torch._check(weight.shape[-1] >= 1, lambda: "conv1d: weight must have at least one tap (K >= 1)")
    if bias is not None:
        check_same(bias, x, "conv1d: bias", "x")
        torch._check(bias.dim() <= 1 and bias.numel() == C and (bias.dim() == 1 or x.dim() == 1),
                     lambda: f"conv1d: bias must have shape ({C},), got {tuple(bias.shape)}")
    torch._check(algorithm in _ALGORITHMS, lambda: f"conv1d: algorithm must be one of {_ALGORITHMS}, got {algorithm!r}")
    return C


@torch.library.register_fake("gpu_puzzles::conv1d")
def _conv1d_fake(x, weight, bias=None, causal=False, algorithm="auto"):
    _check(x, weight, bias, algorithm)
    return x.new_empty(x.shape)


@torch.library.register_fake("gpu_puzzles::conv1d_backward")
def _conv1d_backward_fake(grad_out, x, weight, causal, algorithm="auto"):
    C = _check(x, weight, None, algorithm)
    torch._check(grad_out.shape == x.shape, lambda: "conv1d_backward: grad_out must have x's shape")
    return x.new_empty(x.shape), weight.new_empty(weight.shape), weight.new_empty((C,))


# Autograd is registered in C++ (csrc/conv1d/conv1d_autograd.cpp; why: csrc/common/autograd.h).
_conv1d = torch.ops.gpu_puzzles.conv1d.default  # the overload: no packet lookup per call


def conv1d(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, *, causal: bool = False,
           algorithm: str = "auto") -> Tensor:
    """Depthwise 1D convolution, output as long as the input.

    Shapes: ``x (L,)`` with ``weight (K,)``; ``x (C, L)`` or ``x (B, C, L)`` with
    ``weight (C, K)``; optional ``bias (C,)``. ``causal=False`` is the seed's form
    ``out[i] = sum_j x[i+j] w[j]`` (zero past the end); ``causal=True`` looks back:
    ``out[i] = sum_j x[i-K+1+j] w[j]`` (zero before the start).

    ``algorithm`` picks the CUDA kernel: ``"auto"`` (fastest), or the curriculum's
    steps ``"fast"`` (K <= 9), ``"tiled"`` and ``"naive"``; the CPU ignores it.
    """
    return _conv1d(x, weight, bias, causal, algorithm)
