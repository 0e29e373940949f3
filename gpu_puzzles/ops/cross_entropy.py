"""Cross-entropy: ``torch.ops.gpu_puzzles.cross_entropy`` and ``fused_linear_cross_entropy``.

The ops take the classes in the **last** dim (logits ``(..., V)``, target ``(...)``): each
row is one sample, loss_r = logsumexp(logits_r) - logits_r[target_r]; targets equal to
``ignore_index`` add nothing and do not count for the mean. The public
:func:`cross_entropy` is ``F.cross_entropy``'s signature and layout (classes on dim 1 of
``(N, C, d1, ...)``, class weights, label smoothing) on top of the op. Statistics in float32
(float64 for float64 logits); half logits are read as they are. The forward keeps only each
row's log-sum-exp for the backward. ``softcap=c`` gives the loss of the soft-capped logits
``c * tanh(logits / c)`` (Gemma 2's and 3's final logits), capped as the kernels read them.

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
import contextlib
from typing import Optional

import torch
from torch import Tensor

from ..tuning import py_knob
from ._common import register_fake


def _acc(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


@register_fake("gpu_puzzles::cross_entropy")
def _cross_entropy_fake(logits, target, ignore_index=-100, reduction="mean", loss_dtype=None, softcap=None):
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
def _cross_entropy_backward_fake(grad_loss, logits, target, lse, ignore_index, reduction, softcap=None):
    return _grad_like(logits)


@register_fake("gpu_puzzles::fused_linear_cross_entropy")
def _fused_fake(hidden, weight, target, bias=None, ignore_index=-100, reduction="mean",
                output_mask=(False, False, False), loss_dtype=None, softcap=None):
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
    def forward(ctx, logits, target, ignore_index, reduction, loss_dtype, softcap):
        loss, lse = _cross_entropy(logits, target, ignore_index, reduction, loss_dtype, softcap)
        ctx.save_for_backward(logits, target, lse)
        ctx.ignore_index, ctx.reduction, ctx.softcap = ignore_index, reduction, softcap
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
        z = logits.to(acc)
        if ctx.softcap is not None:  # z = c * tanh(x / c), dz/dx = 1 - tanh(x / c)^2
            th = torch.tanh(z / ctx.softcap)
            z, scale = th * ctx.softcap, scale * (1 - th * th)
        grad = (torch.exp(z - lse.unsqueeze(-1)) - onehot.to(acc)) * scale
        return grad.to(logits.dtype), None, None, None, None, None


def _weighted(logits, target, weight, ignore_index, reduction, label_smoothing, loss_dtype, softcap):
    """F.cross_entropy's class ``weight`` and ``label_smoothing`` (classes last here), from
    the op's per-row losses: ``loss_r = (1 - s) w[t_r] nll_r + s / V sum_c w_c (lse_r -
    x_rc)``, the mean over ``sum w[t_r]`` of the non-ignored rows (their count without
    ``weight``), as ATen's cross_entropy_loss_label_smoothing. The smoothing term reads the
    logits once more (ATen ops): these options are not on the fast path."""
    V = logits.shape[-1]
    acc = _acc(logits.dtype)
    dev = logits.device.type
    # The ops' devices only (meta has no autocast; is_autocast_available does not trace).
    autocast = dev in ("cpu", "cuda") and torch.is_autocast_enabled(dev)
    # The loss's dtype as the op's: float32 for half logits under autocast, as F.cross_entropy's.
    half = logits.dtype in (torch.float16, torch.bfloat16)
    out_dtype = loss_dtype or (torch.float32 if autocast and half else logits.dtype)
    if weight is not None:
        if not isinstance(weight, Tensor):
            raise TypeError(f"cross_entropy: weight must be a tensor of class weights or None, got "
                            f"{type(weight).__name__}")
        if weight.dim() != 1 or weight.shape[0] != V:
            raise ValueError(f"cross_entropy: weight must have shape ({V},) (one weight per class), got "
                             f"{tuple(weight.shape)}")
        if not weight.is_floating_point() or weight.device != logits.device:
            raise ValueError(f"cross_entropy: weight must be a floating tensor on {logits.device}, got "
                             f"{weight.dtype} on {weight.device}")
    nll = _rows(logits, target, ignore_index, "none", acc, softcap)  # 0 at ignored rows
    # The weighting and smoothing in the accumulate type, as the op's statistics (autocast
    # would run x @ w in half).
    with torch.autocast(dev, enabled=False) if autocast else contextlib.nullcontext():
        return _weigh(logits, target, nll, weight, ignore_index, reduction, label_smoothing, acc, out_dtype, softcap)


def _weigh(logits, target, nll, weight, ignore_index, reduction, label_smoothing, acc, out_dtype, softcap):
    V = logits.shape[-1]
    valid = target != ignore_index
    # Ignored (or, on CUDA, out-of-range) targets gather class 0; their rows are masked.
    safe = torch.where(valid, target, 0).clamp(0, V - 1).long()
    w = weight.to(acc) if weight is not None else None
    w_rows = torch.where(valid, w[safe], 0.0) if w is not None else valid.to(acc)
    loss = nll * w_rows if w is not None else nll
    if label_smoothing:
        x = logits.to(acc)
        if softcap is not None:
            x = softcap * torch.tanh(x / softcap)
        lse = nll + x.gather(-1, safe.unsqueeze(-1)).squeeze(-1)  # nll_r = lse_r - x[t_r]
        smooth = lse * w.sum() - x @ w if w is not None else lse * V - x.sum(-1)
        smooth = torch.where(valid, smooth, 0.0)
        loss = (1 - label_smoothing) * loss + (label_smoothing / V) * smooth
    if reduction == "none":
        return loss.to(out_dtype)
    total = loss.sum()
    return (total / w_rows.sum() if reduction == "mean" else total).to(out_dtype)


def _rows(logits, target, ignore_index, reduction, loss_dtype, softcap):
    """The op on classes-last logits (under torch.compile: with the ATen backward, as the knob says)."""
    if torch.compiler.is_compiling() and py_knob("cross_entropy_compiled_backward") == "inductor":
        return _CrossEntropyTraced.apply(logits, target, ignore_index, reduction, loss_dtype, softcap)
    return _cross_entropy(logits, target, ignore_index, reduction, loss_dtype, softcap)[0]


_REDUCTIONS = ("mean", "sum", "none")


def cross_entropy(input: Tensor, target: Tensor, weight: Optional[Tensor] = None, size_average: Optional[bool] = None,
                  ignore_index: int = -100, reduce: Optional[bool] = None, reduction: str = "mean",
                  label_smoothing: float = 0.0, *, loss_dtype: Optional[torch.dtype] = None,
                  softcap: Optional[float] = None) -> Tensor:
    """``F.cross_entropy`` with class-index targets, same arguments in the same order.

    Shapes as F's: ``input`` ``(C,)`` with a 0-d ``target``, ``(N, C)`` with ``(N,)``, or
    ``(N, C, d1, ...)`` with ``(N, d1, ...)`` (the classes on dim 1); targets int64 or
    int32. Class-probability targets (a float ``target``) raise.

    ``weight`` ``(C,)``, ``ignore_index``, ``reduction`` (``"mean"``: over the non-ignored
    targets, weighted by ``weight``; none of them gives NaN, as PyTorch; ``"sum"``;
    ``"none"``: the shape of ``target``), ``label_smoothing`` in ``[0, 1]``, and the
    deprecated ``size_average`` / ``reduce``, as F's. Without ``weight`` and smoothing the
    loss runs on our op alone; with them the op gives the per-row losses and ATen ops weigh
    and smooth them.

    The loss has the input's dtype, or ``loss_dtype``; under ``torch.autocast`` float32, as
    ``F.cross_entropy``'s there (the logits are still read in their own dtype, never
    copied). A target outside ``[0, C)`` that is not ``ignore_index`` raises on the CPU; on
    CUDA it gives a NaN loss for its row (no out-of-bounds read, no host sync).

    ``softcap=c`` (a positive number) is the loss of ``c * tanh(input / c)``, Gemma 2's and
    3's final-logit soft-capping, computed as the logits are read (no capped copy) and
    differentiated through the cap.

    The op underneath, ``torch.ops.gpu_puzzles.cross_entropy``, takes the classes on the
    **last** dim (logits ``(..., C)``, target ``(...)``); ``(N, C, d1, ...)`` input is handed
    to it as the view ``input.movedim(1, -1)``. The rows are read in place when the class dim
    has a unit stride, so a language model's ``logits[:, :-1].transpose(1, 2)`` (the layout F
    wants) or its 2-D ``(N, C)`` logits cost no copy.
    """
    if size_average is not None or reduce is not None:
        reduction = torch.nn._reduction.legacy_get_string(size_average, reduce)
    if input.dim() > 2:
        if target.shape != input.shape[:1] + input.shape[2:]:
            raise ValueError(f"cross_entropy: target must have shape (N, d1, ...) = "
                             f"{tuple(input.shape[:1] + input.shape[2:])} for input of shape {tuple(input.shape)} "
                             f"(classes on dim 1), got {tuple(target.shape)}")
        input = input.movedim(1, -1)
    if weight is None and not label_smoothing:
        return _rows(input, target, ignore_index, reduction, loss_dtype, softcap)
    if reduction not in _REDUCTIONS:
        raise ValueError(f"cross_entropy: reduction must be one of 'mean', 'sum', 'none', got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing}")
    return _weighted(input, target, weight, ignore_index, reduction, label_smoothing, loss_dtype, softcap)


def fused_linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor] = None,
                               ignore_index: int = -100, reduction: str = "mean", *,
                               loss_dtype: Optional[torch.dtype] = None, softcap: Optional[float] = None) -> Tensor:
    """The loss of ``F.linear(hidden, weight, bias)`` without storing those logits: each row
    of ``hidden`` is one sample, so for 2-D ``hidden`` this is
    ``F.cross_entropy(F.linear(hidden, weight, bias), target, ignore_index=..., reduction=...)``
    and for ``(..., H)`` the same over ``hidden.reshape(-1, H)`` and ``target.reshape(-1)``
    (the classes are the rows of ``weight``, never dim 1 of ``hidden``). No class weights or
    label smoothing.

    ``hidden`` ``(..., H)``, ``weight`` ``(V, H)`` (a transposed view is fine: tied
    embeddings), ``bias`` ``(V,)`` or None, ``target`` ``hidden.shape[:-1]``.
    The rows run in chunks (knob ``cross_entropy_chunk`` overrides their size); the
    gradients of ``hidden``, ``weight`` and ``bias`` are computed in the forward for
    the inputs that require them (float32 accumulation across chunks), so the backward
    costs one scaling. ``reduction``: ``"mean"`` or ``"sum"``. The loss has ``hidden``'s
    dtype, or ``loss_dtype``. Under ``torch.autocast`` the GEMMs run in the autocast dtype
    and the loss is float32, as ``F.linear`` followed by ``F.cross_entropy`` there.
    ``softcap=c`` soft-caps the logits first, as :func:`cross_entropy`'s.
    """
    return _fused(hidden, weight, target, bias, ignore_index, reduction, _NO_MASK, loss_dtype, softcap)[0]
