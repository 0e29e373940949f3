"""Embedding lookup: ``torch.ops.gpu_puzzles.embedding``.

out[..., :] = weight[indices[...], :]; an index outside [0, V) (negative too) gives
a zero row and no gradient; ``padding_idx`` rows are returned but get no gradient.
Two CUDA kernels, chosen by ``algorithm``: the coalesced 1D grid ("auto" or
"coalesced") and the curriculum's 16x16 2D grid ("2d"), the coalescing counter-example.
Argument checks live in C++ (csrc/embedding/embedding.cpp); the fake kernels
compute shapes only.
"""
from typing import Optional

import torch
from torch import Tensor

from ._common import register_fake


@register_fake("gpu_puzzles::embedding")
def _embedding_fake(indices, weight, padding_idx=None, algorithm="auto"):
    torch._check(weight.dim() == 2,
                 lambda: "embedding: weight must be 2-D (num_embeddings, embedding_dim), got shape "
                         f"{tuple(weight.shape)}")
    return weight.new_empty((*indices.shape, weight.shape[1]))


@register_fake("gpu_puzzles::embedding_backward")
def _embedding_backward_fake(grad_out, indices, num_weights, padding_idx, deterministic, algorithm="auto"):
    return grad_out.new_empty((num_weights, grad_out.shape[-1]))


# Autograd is registered in C++ (csrc/embedding/embedding_autograd.cpp): the Python
# autograd kernel would cost more host time per call than the seed-size lookup.
_embedding = torch.ops.gpu_puzzles.embedding.default  # the overload: no packet lookup per call


def embedding(indices: Tensor, weight: Tensor, padding_idx: Optional[int] = None, *,
              algorithm: str = "auto") -> Tensor:
    """Embedding lookup: ``out[..., :] = weight[indices[...], :]``.

    ``indices``: any shape, int32 or int64, on ``weight``'s device; ``weight``: ``(V, E)``
    float. Returns ``indices.shape + (E,)`` in ``weight``'s dtype. An index outside
    ``[0, V)`` (negative included) gives a zero row and no gradient (the seed's rule,
    unlike F.embedding, which raises). ``padding_idx`` behaves as in
    ``torch.nn.functional.embedding``: the row is returned, its gradient stays zero.

    ``algorithm`` picks the CUDA kernel (the CPU has one): ``"auto"`` / ``"coalesced"``,
    a 1D grid whose warps read whole rows in 16-byte vectors, or ``"2d"``, the
    curriculum's 16x16 blocks that put consecutive lanes on consecutive tokens, so one
    warp request touches 16 different rows (see notebooks/embedding.ipynb).

    The weight gradient is dense ``(V, E)``, summed in float32 for half types. It is
    bit-identical run to run, except for ``"2d"`` on CUDA, which keeps the
    curriculum's float atomics unless ``torch.are_deterministic_algorithms_enabled()``.
    """
    return _embedding(indices, weight, padding_idx, algorithm)
