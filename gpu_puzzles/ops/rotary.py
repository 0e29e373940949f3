"""Rotary position embedding of q and k: ``torch.ops.gpu_puzzles.rotary``.

``x * cos + rotate_half(x) * sin`` for x = q and x = k in one pass, as transformers'
``apply_rotary_pos_emb`` writes it (after it unsqueezes cos and sin over the heads), where
eager PyTorch makes five passes per tensor (two products, the halves' negation and
concatenation, the sum) and as many in the backward. The backward applies the transpose of
the rotation to the outputs' gradients; nothing is saved but cos and sin.
"""
import torch
from torch import Tensor

from ._common import register_fake


def _out_dtype(x, cos):
    return x.dtype if cos.dtype == x.dtype else torch.float32


# Argument checks live in C++ (csrc/rotary/rotary.cpp); the fake kernels give shapes and dtypes.
@register_fake("gpu_puzzles::rotary")
def _rotary_fake(q, k, cos, sin):
    dt = _out_dtype(q, cos)
    return q.new_empty(q.shape, dtype=dt), k.new_empty(k.shape, dtype=dt)


@register_fake("gpu_puzzles::rotary_backward")
def _rotary_backward_fake(grad_q, grad_k, cos, sin, dtype):
    return grad_q.new_empty(grad_q.shape, dtype=dtype), grad_k.new_empty(grad_k.shape, dtype=dtype)


# Autograd is registered in C++ (csrc/rotary/rotary_autograd.cpp; why: csrc/common/autograd.h).
_rotary = torch.ops.gpu_puzzles.rotary.default


def rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Rotary position embedding of ``q`` and ``k``: ``(x * cos + rotate_half(x) * sin)`` for each.

    ``q`` and ``k`` are ``(..., D)`` with 1 to 4 dims (e.g. ``(B, H, S, D)`` and ``(B, Hkv, S, D)``,
    views of a projection's output read in place); ``cos`` and ``sin`` are ``(..., R)`` and
    broadcast over each one's leading dims (transformers' ``cos.unsqueeze(1)``: ``(B, 1, S, R)``).
    ``rotate_half(x) = cat(-x[..., R/2:R], x[..., :R/2])``; with ``R < D`` (partial rotary) the
    last ``D - R`` elements pass through unchanged. ``cos`` and ``sin`` have ``q``'s dtype, or
    float32 for float16/bfloat16 ``q`` (then the outputs are float32, as PyTorch's type promotion
    gives ``q * cos``). Differentiable in ``q`` and ``k``; ``cos`` and ``sin`` must not require
    grad. Outputs are contiguous. No autocast rule (as ``torch.mul``).
    """
    return _rotary(q, k, cos, sin)
