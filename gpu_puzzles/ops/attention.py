"""Attention: ``torch.ops.gpu_puzzles.attention`` (fused) and the curriculum's chain.

attention(q, k, v) = softmax(q k^T * scale) v, scale = 1/sqrt(D) unless given,
causal as SDPA's ``is_causal`` (key j visible to query i iff j <= i, aligned to the
top-left corner also when Sq != Sk). The fused op returns ``(out, lse)``: lse is
each query row's log-sum-exp, saved so the backward recomputes the probabilities
instead of storing the S x S matrix; :func:`attention` hides it.

:func:`attention_unfused` is the seed's chain: our tiled transpose, our tiled
matmul, our softmax, our matmul; the S x S scores live in memory.
"""
import math
from typing import Optional

import torch
from torch import Tensor

from ._common import check_float, check_same


def _check_qkv(q, k, v, op):
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
        for i in range(q.dim() - 2):
            torch._check(k.shape[i] == q.shape[i], lambda: f"{op}: k has leading dims {tuple(k.shape[:-2])} but q "
                                                           f"has {tuple(q.shape[:-2])}; they must be equal")
            torch._check(v.shape[i] == q.shape[i], lambda: f"{op}: v has leading dims {tuple(v.shape[:-2])} but q "
                                                           f"has {tuple(q.shape[:-2])}; they must be equal")
    torch._check(q.shape[-1] >= 1, lambda: f"{op}: q must have a head dim >= 1, got shape {tuple(q.shape)}")
    torch._check(k.shape[-1] == q.shape[-1],
                 lambda: f"{op}: k has head dim {k.shape[-1]} but q has head dim {q.shape[-1]}")
    torch._check(v.shape[-2] == k.shape[-2],
                 lambda: f"{op}: v has sequence length {v.shape[-2]} but k has {k.shape[-2]}")


def _lse_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.library.register_fake("gpu_puzzles::attention")
def _attention_fake(q, k, v, scale=None, causal=False):
    _check_qkv(q, k, v, "attention")
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    lse = q.new_empty(q.shape[:-1], dtype=_lse_dtype(q.dtype))
    return out, lse


@torch.library.register_fake("gpu_puzzles::attention_backward")
def _attention_backward_fake(grad_out, q, k, v, out, lse, scale, causal):
    _check_qkv(q, k, v, "attention_backward")
    check_same(grad_out, q, "attention_backward: grad_out", "q")
    torch._check(grad_out.shape == out.shape, lambda: "attention_backward: grad_out must have out's shape")
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# Autograd is registered in C++ (csrc/attention/attention_autograd.cpp; why: csrc/common/autograd.h).


# ---- the chain ------------------------------------------------------------------

@torch.library.register_fake("gpu_puzzles::transpose_last2")
def _transpose_fake(x):
    check_float(x, "transpose_last2: x")
    torch._check(x.dim() >= 2, lambda: f"transpose_last2: x must have at least 2 dims, got shape {tuple(x.shape)}")
    return x.new_empty((*x.shape[:-2], x.shape[-1], x.shape[-2]))


@torch.library.register_fake("gpu_puzzles::matmul")
def _matmul_fake(a, b, alpha=1.0, causal_mask=False):
    check_float(a, "matmul: a")
    check_same(b, a, "matmul: b", "a")
    torch._check(a.dim() >= 2, lambda: f"matmul: a must be (..., M, K), got shape {tuple(a.shape)}")
    torch._check(b.dim() == a.dim(), lambda: f"matmul: b must have as many dims as a ({a.dim()})")
    for i in range(a.dim() - 2):
        torch._check(b.shape[i] == a.shape[i], lambda: "matmul: b and a must have equal leading dims")
    torch._check(b.shape[-2] == a.shape[-1], lambda: f"matmul: b has {b.shape[-2]} rows but a has {a.shape[-1]} columns")
    return a.new_empty((*a.shape[:-1], b.shape[-1]))


# Their autograd is in C++ too (attention_autograd.cpp); the backward goes through these same ops.


# ---- public functions --------------------------------------------------------------

def attention(q: Tensor, k: Tensor, v: Tensor, *, scale: Optional[float] = None, causal: bool = False) -> Tensor:
    """Scaled dot-product attention ``softmax(q k^T * scale) v``, fused (flash-style).

    Shapes: the seed's vector form ``q (D,)``, ``k (S, D)``, ``v (S, Dv)`` -> ``(Dv,)``;
    or ``q (..., Sq, D)``, ``k (..., Sk, D)``, ``v (..., Sk, Dv)`` with equal leading dims
    -> ``(..., Sq, Dv)``. ``scale`` defaults to ``1/sqrt(D)`` like
    ``F.scaled_dot_product_attention`` (the seed uses ``scale=1.0``); ``causal`` matches
    SDPA's ``is_causal`` (query i sees keys ``j <= i``, also when Sq != Sk).

    The S x S scores never reach memory: online softmax in the forward, the row
    log-sum-exp saved for the backward. CPU: float32/float64. CUDA: float32, float64,
    float16, bfloat16, head dims up to 256 (64 and 128 fastest). Differentiable in q, k, v.
    """
    out, _ = torch.ops.gpu_puzzles.attention(q, k, v, scale, causal)
    return out


def transpose_last2(x: Tensor) -> Tensor:
    """``x`` with its last two dims swapped, as a new contiguous tensor (the seed's tiled transpose)."""
    return torch.ops.gpu_puzzles.transpose_last2(x)


def matmul(a: Tensor, b: Tensor, alpha: float = 1.0, causal_mask: bool = False) -> Tensor:
    """``alpha * a @ b`` for ``a (..., M, K)``, ``b (..., K, N)`` with equal leading dims (the seed's
    tiled matmul); ``causal_mask`` writes ``-inf`` where column > row."""
    return torch.ops.gpu_puzzles.matmul(a, b, alpha, causal_mask)


def attention_unfused(q: Tensor, k: Tensor, v: Tensor, *, scale: Optional[float] = None,
                      causal: bool = False) -> Tensor:
    """The curriculum's attention chain: ``matmul(q, transpose(k)) -> softmax -> matmul(., v)``.

    Same arguments and result as :func:`attention`, built from our transpose, tiled
    matmul and softmax ops; the ``(..., Sq, Sk)`` scores and probabilities are written
    to memory (O(S^2)). Differentiable through its components. Kept for the comparison.
    """
    if not torch.compiler.is_compiling():  # dynamo cannot trace the message closures; the ops check again
        _check_qkv(q, k, v, "attention_unfused")
    vector = q.dim() == 1
    if vector:
        q = q.unsqueeze(0)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    scores = torch.ops.gpu_puzzles.matmul(q, torch.ops.gpu_puzzles.transpose_last2(k), scale, causal)
    probs = torch.ops.gpu_puzzles.softmax(scores, -1, "auto")
    out = torch.ops.gpu_puzzles.matmul(probs, v, 1.0, False)
    return out.squeeze(0) if vector else out
