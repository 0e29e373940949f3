"""Attention: ``torch.ops.gpu_puzzles.attention`` (fused) and the curriculum's chain.

attention(q, k, v) = softmax(q k^T * scale) v, scale = 1/sqrt(D) unless given,
causal as SDPA's ``is_causal`` (key j visible to query i iff j <= i, aligned to the
top-left corner also when Sq != Sk), ``enable_gqa`` as SDPA's (k and v with fewer heads:
query head h reads kv head h // (H // Hkv); the fused op never repeats them in memory).
The fused op returns ``(out, lse)``: lse is each query row's log-sum-exp, saved so the
backward recomputes the probabilities instead of storing the S x S matrix;
:func:`attention` hides it.

``attention(..., algorithm="unfused")`` is the seed's chain: our tiled transpose, our
tiled matmul, our softmax, our matmul; the S x S scores live in memory.
"""
import math
from typing import Optional

import torch
from torch import Tensor

from ._common import check_float, check_same, register_fake, schema_default

_ALGORITHMS = ("auto", "unfused")
# Head dims (D == Dv) of the tensor-core kernels (attention_plan.cu: tc_head_dims); on CUDA other
# head dims run the portable SIMT kernels.
TC_HEAD_DIMS = (64, 128)


def _lse_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---- fake kernels: output shapes only (the C++ kernels validate the arguments) ------
# The arguments that do not shape the output are taken as *_ (a caller may leave out
# those at their schema defaults).

def _empty_in_order_of(x, shape):
    """An empty tensor of ``shape`` laid out densely in ``x``'s memory order: x's leading dims by
    decreasing stride (ties keep their order), the last dim innermost. The rule of
    empty_in_order_of in csrc/attention/attention.cpp, which out, dq, dk and dv follow: views
    transposed out of a (B, S, H, D) projection get (B, S, H, D)-ordered results."""
    n = x.dim()
    perm = sorted(range(n - 1), key=x.stride, reverse=True) + [n - 1]  # sorted is stable, also reversed
    strides = [0] * n
    run = 1
    for i in reversed(perm):
        strides[i] = run
        run = run * torch.sym_max(shape[i], 1)
    return x.new_empty_strided(tuple(shape), tuple(strides))


@register_fake("gpu_puzzles::attention")
def _attention_fake(q, k, v, *_):
    out = _empty_in_order_of(q, (*q.shape[:-1], v.shape[-1]))
    lse = q.new_empty(q.shape[:-1], dtype=_lse_dtype(q.dtype))
    return out, lse


@register_fake("gpu_puzzles::attention_backward")
def _attention_backward_fake(grad_out, q, k, v, *_):
    return _empty_in_order_of(q, q.shape), _empty_in_order_of(k, k.shape), _empty_in_order_of(v, v.shape)


@register_fake("gpu_puzzles::transpose_last2")
def _transpose_fake(x):
    torch._check(x.dim() >= 2, lambda: f"transpose_last2: x must have at least 2 dims, got shape {tuple(x.shape)}")
    return x.new_empty((*x.shape[:-2], x.shape[-1], x.shape[-2]))


@register_fake("gpu_puzzles::matmul")
def _matmul_fake(a, b, *_):
    return a.new_empty((*a.shape[:-1], b.shape[-1]))


# Autograd of all four is registered in C++ (csrc/attention/attention_autograd.cpp; why:
# csrc/common/autograd.h); the chain's backward goes through these same ops.

_attention = torch.ops.gpu_puzzles.attention.default  # the overloads: no packet lookup per call
_transpose = torch.ops.gpu_puzzles.transpose_last2.default
_matmul = torch.ops.gpu_puzzles.matmul.default


# The defaults are written in the schemas only.
_CAUSAL = schema_default(_attention, "causal")
_ENABLE_GQA = schema_default(_attention, "enable_gqa")
_ALPHA = schema_default(_matmul, "alpha")
_CAUSAL_MASK = schema_default(_matmul, "causal_mask")


# ---- the chain's own argument check ------------------------------------------------
# No op sees q, k and v together in the chain, so it checks them here, with the messages
# of the fused op's C++ check (check_qkv in attention.cpp).

def _check_qkv(q, k, v, op, enable_gqa=False):
    check_float(q, f"{op}: q")
    check_same(k, q, f"{op}: k", "q")
    check_same(v, q, f"{op}: v", "q")
    if q.dim() == 1:
        torch._check(k.dim() == 2 and v.dim() == 2,
                     lambda: f"{op}: for a 1-D q (D,), k and v must be 2-D (S, D), got k shape "
                             f"{tuple(k.shape)} and v shape {tuple(v.shape)}")
    else:
        torch._check(q.dim() >= 2, lambda: f"{op}: q must be (D,) or (..., Sq, D), got a 0-d tensor")
        torch._check(k.dim() == q.dim(), lambda: f"{op}: k must have as many dims as q ({q.dim()}), got shape "
                                                 f"{tuple(k.shape)}")
        torch._check(v.dim() == q.dim(), lambda: f"{op}: v must have as many dims as q ({q.dim()}), got shape "
                                                 f"{tuple(v.shape)}")
        for i in range(q.dim() - 3):  # the batch dims; the heads (dim -3) below
            torch._check(k.shape[i] == q.shape[i], lambda: f"{op}: k has leading dims {tuple(k.shape[:-2])} but q "
                                                           f"has {tuple(q.shape[:-2])}; they must be equal")
            torch._check(v.shape[i] == q.shape[i], lambda: f"{op}: v has leading dims {tuple(v.shape[:-2])} but q "
                                                           f"has {tuple(q.shape[:-2])}; they must be equal")
        if q.dim() >= 3:
            H, Hkv = q.shape[-3], k.shape[-3]
            torch._check(v.shape[-3] == Hkv, lambda: f"{op}: v has {v.shape[-3]} heads (dim -3) but k has {Hkv}; "
                                                     f"they must be equal")
            if enable_gqa:
                torch._check(Hkv == H or (Hkv >= 1 and H % Hkv == 0),
                             lambda: f"{op}: with enable_gqa, q's heads ({H}) must be a multiple of k's and v's "
                                     f"heads ({Hkv}, dim -3)")
            else:
                torch._check(Hkv == H, lambda: f"{op}: k has {Hkv} heads (dim -3) but q has {H}; they must be "
                                               f"equal, or pass enable_gqa=True for grouped k/v heads")
    torch._check(q.shape[-1] >= 1, lambda: f"{op}: q must have a head dim >= 1, got shape {tuple(q.shape)}")
    torch._check(k.shape[-1] == q.shape[-1],
                 lambda: f"{op}: k has head dim {k.shape[-1]} but q has head dim {q.shape[-1]}")
    torch._check(v.shape[-2] == k.shape[-2],
                 lambda: f"{op}: v has sequence length {v.shape[-2]} but k has {k.shape[-2]}")


def _attention_unfused(q, k, v, scale, causal, enable_gqa):
    """``matmul(q, transpose(k)) -> softmax -> matmul(., v)``; the (..., Sq, Sk) scores and
    probabilities are written to memory (O(S^2)). Differentiable through its ops. Grouped k/v
    heads are repeated here (this chain stores O(S^2) per head anyway; the fused op does not
    repeat them)."""
    if not torch.compiler.is_compiling():  # dynamo cannot trace the message closures; the ops check again
        _check_qkv(q, k, v, "attention", enable_gqa)
    if enable_gqa and q.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        group = q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(group, dim=-3)
        v = v.repeat_interleave(group, dim=-3)
    vector = q.dim() == 1
    if vector:
        q = q.unsqueeze(0)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    scores = _matmul(q, _transpose(k), scale, causal)
    probs = torch.ops.gpu_puzzles.softmax(scores, -1)
    out = _matmul(probs, v, 1.0, False)
    return out.squeeze(0) if vector else out


# ---- public functions --------------------------------------------------------------

def attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None, dropout_p: float = 0.0,
              is_causal: bool = False, scale: Optional[float] = None, enable_gqa: bool = _ENABLE_GQA, *,
              causal: bool = _CAUSAL, algorithm: str = "auto") -> Tensor:
    """Scaled dot-product attention ``softmax(q k^T * scale) v``.

    Shapes: the seed's vector form ``q (D,)``, ``k (S, D)``, ``v (S, Dv)`` -> ``(Dv,)``;
    or ``q (..., Sq, D)``, ``k (..., Sk, D)``, ``v (..., Sk, Dv)`` with equal leading dims
    -> ``(..., Sq, Dv)``. ``scale`` defaults to ``1/sqrt(D)`` like
    ``F.scaled_dot_product_attention`` (the seed uses ``scale=1.0``); ``causal`` matches
    SDPA's ``is_causal`` (query i sees keys ``j <= i``, also when Sq != Sk).
    ``enable_gqa`` matches SDPA's: k and v may have ``Hkv`` heads (dim -3) where q has
    ``H``, ``Hkv`` dividing ``H`` (grouped-query attention; ``Hkv = 1``: multi-query);
    query head ``h`` attends with kv head ``h // (H // Hkv)``. The fused path reads k and v
    as they are (no repeat); their gradients are summed over each group's query heads.

    ``algorithm="auto"``: fused (flash-style); the S x S scores never reach memory: online
    softmax in the forward, the row log-sum-exp saved for the backward. CPU:
    float32/float64 (float16/bfloat16, as ``torch.autocast`` hands them over on the CPU, are
    computed in float32 and rounded). CUDA: float32, float64, float16, bfloat16, head dims up
    to 256; half types at D = 64 and 128 run the tensor-core kernels, everything else portable
    SIMT kernels that are far slower (D = 256, (4,8,4,2048) GQA causal on an H100: 28 ms forward
    against SDPA's 0.15 ms), which is why ``hf.patch`` hands those head dims to SDPA.
    ``algorithm="unfused"``: the curriculum's chain, our :func:`transpose_last2`, tiled
    :func:`matmul`, softmax and matmul, with the ``(..., Sq, Sk)`` scores and probabilities in
    memory (O(S^2)); kept for the comparison.
    Both are differentiable in q, k, v.

    The arguments are ``F.scaled_dot_product_attention``'s, in its order: ``is_causal`` is a
    synonym of ``causal``; ``attn_mask`` must be None and ``dropout_p`` 0 (anything else
    raises, naming the argument: use ``causal`` or SDPA).
    """
    if attn_mask is not None:
        raise ValueError("attention: attn_mask is not supported (only causal=True masking); use "
                         "F.scaled_dot_product_attention for an explicit mask")
    if dropout_p:
        raise ValueError(f"attention: dropout_p must be 0 (no attention dropout), got {dropout_p}")
    causal = causal or is_causal
    if algorithm not in _ALGORITHMS:
        raise ValueError(f"attention: algorithm must be one of {_ALGORITHMS}, got {algorithm!r}")
    if algorithm == "unfused":
        return _attention_unfused(q, k, v, scale, causal, enable_gqa)
    out, _ = _attention(q, k, v, scale, causal, enable_gqa)
    return out


def transpose_last2(x: Tensor) -> Tensor:
    """``x`` with its last two dims swapped, as a new contiguous tensor (the seed's tiled transpose)."""
    return _transpose(x)


def matmul(a: Tensor, b: Tensor, alpha: float = _ALPHA, causal_mask: bool = _CAUSAL_MASK) -> Tensor:
    """``alpha * a @ b`` for ``a (..., M, K)``, ``b (..., K, N)`` with equal leading dims (the seed's
    tiled matmul); ``causal_mask`` writes ``-inf`` where column > row."""
    return _matmul(a, b, alpha, causal_mask)
