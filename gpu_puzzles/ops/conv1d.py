"""Depthwise 1D convolution: ``torch.ops.gpu_puzzles.conv1d``.

out[..., c, i] = bias[c] + sum_j x[..., c, i - s + j] * weight[c, j], zero outside
the sequence, where s = 0 (the seed's look-ahead form) or s = K - 1 (causal).
"""
from typing import Optional

import torch
from torch import Tensor

from ._common import register_fake


# Argument checks live in C++ (csrc/conv1d/conv1d.cpp); the fake kernels compute shapes only.
@register_fake("gpu_puzzles::conv1d")
def _conv1d_fake(x, weight, bias=None, causal=False, algorithm="auto"):
    return x.new_empty(x.shape)


@register_fake("gpu_puzzles::conv1d_backward")
def _conv1d_backward_fake(grad_out, x, weight, causal, algorithm="auto"):
    C = weight.shape[0] if weight.dim() == 2 else 1
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
