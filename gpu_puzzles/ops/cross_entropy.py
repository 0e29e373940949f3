"""Cross-entropy over the last dim: ``torch.ops.gpu_puzzles.cross_entropy`` and
``fused_linear_cross_entropy``.

loss_r = logsumexp(logits_r) - logits_r[target_r], as ``F.cross_entropy`` with the
classes in the last dim; targets equal to ``ignore_index`` add nothing and do not
count for the mean. Statistics in float32 (float64 for float64 logits); half logits
are read as they are. The forward keeps only each row's log-sum-exp for the backward.

The fused op never stores the (N, V) logits: it runs the GEMM, the loss and the
gradients chunk by chunk (rows), in the forward; the backward only scales them.
Under torch.compile, ``cross_entropy`` runs our forward kernel and hands inductor its
backward as ATen math (knob ``cross_entropy_compiled_backward``): the gradient
(exp(logits - lse) - onehot(target)) * scale is then one pointwise kernel that inductor
fuses with its neighbours, such as the addition of the logits' own gradient when a model
returns them besides the loss (an opaque backward op would leave that addition, a
further pass over the (N, V) gradient, to a kernel of its own).
Argument checks live in C++ (csrc/cross_entropy/cross_entropy.cpp); the fake kernels
compute shapes only, with the real kernels' strides: contiguous, except the backward's
gradient, which keeps the logits' strides when their rows are evenly spaced (padded rows).
"""
from typing import Optional

import torch
from torch import Tensor

from ..tuning import py_knob
from ._common import register_fake


def _acc(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


@register_fake("gpu_puzzles::cross_entropy")
def _cross_entropy_fake(logits, target, ignore_index=-100, reduction="mean", loss_dtype=None):
    torch._check(logits.dim() >= 1, lambda: "cross_entropy: logits must have at least 1 dimension")
    loss = logits.new_empty(target.shape if reduction == "none" else (), dtype=loss_dtype or logits.dtype)
    return loss, logits.new_empty(logits.shape[:-1], dtype=_acc(logits.dtype))


def _grad_like(logits):
    """The C++ empty_grad_like: the logits' strides when the rows (all dims but the last,
    size-1 dims aside) collapse to one stride >= V and the last dim is contiguous."""
    if logits.stride(-1) == 1:
        rows = None  # (count, stride) of the rows merged so far, innermost first
        for size, stride in zip(reversed(logits.shape[:-1]), reversed(logits.stride()[:-1])):
            if size == 1:
                continue
            if rows is None:
                rows = (size, stride)
            elif stride == rows[0] * rows[1]:
                rows = (rows[0] * size, rows[1])
            else:
                return logits.new_empty(logits.shape)
        if rows is not None and rows[1] >= logits.shape[-1]:
            return logits.new_empty_strided(logits.shape, logits.stride())
    return logits.new_empty(logits.shape)


@register_fake("gpu_puzzles::cross_entropy_backward")
def _cross_entropy_backward_fake(grad_loss, logits, target, lse, ignore_index, reduction):
    return _grad_like(logits)


@register_fake("gpu_puzzles::fused_linear_cross_entropy")
def _fused_fake(hidden, weight, target, bias=None, ignore_index=-100, reduction="mean",
                output_mask=(False, False, False), loss_dtype=None):
    torch._check(reduction != "none", lambda: "fused_linear_cross_entropy: reduction must be 'mean' or 'sum'")
    gh = hidden.new_empty(hidden.shape if output_mask[0] else (0,))
    gw = weight.new_empty(weight.shape if output_mask[1] else (0,))
    gb = weight.new_empty(bias.shape if bias is not None and output_mask[2] else (0,))
    return hidden.new_empty((), dtype=loss_dtype or hidden.dtype), gh, gw, gb


# Autograd is registered in C++ (csrc/cross_entropy/cross_entropy_autograd.cpp).
_cross_entropy = torch.ops.gpu_puzzles.cross_entropy.default
_fused = torch.ops.gpu_puzzles.fused_linear_cross_entropy.default
_NO_MASK = [False, False, False]  # output_mask's default, passed by position (kwargs cost host time per call)


class _CrossEntropyTraced(torch.autograd.Function):
    """cross_entropy as torch.compile traces it: our forward op, the backward in ATen ops."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index, reduction, loss_dtype):
        loss, lse = _cross_entropy(logits, target, ignore_index, reduction, loss_dtype)
        ctx.save_for_backward(logits, target, lse)
        ctx.ignore_index, ctx.reduction = ignore_index, reduction
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, target, lse = ctx.saved_tensors
        acc = _acc(logits.dtype)
        valid = target != ctx.ignore_index
        scale = grad_loss.to(acc)
        if ctx.reduction == "mean":
            scale = scale / valid.sum().to(acc)  # no valid target: every row below is 0
        # As the backward op: ignored rows 0; a target outside [0, V) has no one-hot term.
        scale = torch.where(valid, scale, 0.0).unsqueeze(-1)
        onehot = torch.arange(logits.shape[-1], device=logits.device) == target.unsqueeze(-1)
        grad = (torch.exp(logits.to(acc) - lse.unsqueeze(-1)) - onehot.to(acc)) * scale
        return grad.to(logits.dtype), None, None, None, None


def cross_entropy(logits: Tensor, target: Tensor, ignore_index: int = -100, reduction: str = "mean", *,
                  loss_dtype: Optional[torch.dtype] = None) -> Tensor:
    """``F.cross_entropy(logits, target, ignore_index=..., reduction=...)`` with the
    classes in the **last** dim: ``logits`` ``(..., V)``, ``target`` ``(...)`` int64 or int32.

    ``reduction``: ``"mean"`` (over the non-ignored targets; none of them gives NaN, as
    PyTorch), ``"sum"`` or ``"none"`` (shape of ``target``). The loss has the logits'
    dtype, or ``loss_dtype``; under ``torch.autocast`` float32, as ``F.cross_entropy``'s
    there (the logits are still read in their own dtype, never copied). A target outside
    ``[0, V)`` that is not ``ignore_index`` raises on the CPU; on CUDA it gives a NaN loss
    for its row (no out-of-bounds read, no host sync).
    Strided logits such as ``logits[:, :-1]`` are read in place when the last dim is
    contiguous.
    """
    if torch.compiler.is_compiling() and py_knob("cross_entropy_compiled_backward") == "inductor":
        return _CrossEntropyTraced.apply(logits, target, ignore_index, reduction, loss_dtype)
    return _cross_entropy(logits, target, ignore_index, reduction, loss_dtype)[0]


def fused_linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor] = None,
                               ignore_index: int = -100, reduction: str = "mean", *,
                               loss_dtype: Optional[torch.dtype] = None) -> Tensor:
    """``cross_entropy(hidden @ weight.T + bias, target)`` without storing the logits.

    ``hidden`` ``(..., H)``, ``weight`` ``(V, H)`` (a transposed view is fine: tied
    embeddings), ``bias`` ``(V,)`` or None, ``target`` ``hidden.shape[:-1]``.
    The rows run in chunks (knob ``cross_entropy_chunk`` overrides their size); the
    gradients of ``hidden``, ``weight`` and ``bias`` are computed in the forward for
    the inputs that require them (float32 accumulation across chunks), so the backward
    costs one scaling. ``reduction``: ``"mean"`` or ``"sum"``. The loss has ``hidden``'s
    dtype, or ``loss_dtype``. Under ``torch.autocast`` the GEMMs run in the autocast dtype
    and the loss is float32, as ``F.linear`` followed by ``F.cross_entropy`` there.
    """
    return _fused(hidden, weight, target, bias, ignore_index, reduction, _NO_MASK, loss_dtype)[0]
