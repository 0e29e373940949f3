"""Embedding lookup: ``torch.ops.gpu_puzzles.embedding`` and ``embedding_2d``.

out[..., :] = weight[indices[...], :]; an index outside [0, V) (negative too) gives
a zero row and no gradient; ``padding_idx`` rows are returned but get no gradient.
"""
from typing import Optional

import torch
from torch import Tensor

from ._common import check_float

_INDEX_DTYPES = (torch.int32, torch.int64)


def _check_indices(indices, op):
    torch._check(indices.dtype in _INDEX_DTYPES,
                 lambda: f"{op}: indices must be an int32 or int64 tensor, got {indices.dtype}")


def _check_padding(padding_idx, V, op):
    if padding_idx is not None:
        torch._check(-V <= padding_idx < V,
                     lambda: f"{op}: padding_idx must be within [-num_embeddings, num_embeddings) = "
                             f"[{-V}, {V}), got {padding_idx}")


def _check_forward(indices, weight, padding_idx, op):
    _check_indices(indices, op)
    check_float(weight, f"{op}: weight")
    torch._check(weight.dim() == 2,
                 lambda: f"{op}: weight must be 2-D (num_embeddings, embedding_dim), got shape {tuple(weight.shape)}")
    torch._check(indices.device == weight.device,
                 lambda: f"{op}: indices is on {indices.device} but weight is on {weight.device}; "
                         f"they must be on the same device")
    _check_padding(padding_idx, weight.shape[0], op)


def _check_backward(grad_out, indices, num_weights, padding_idx, op):
    _check_indices(indices, op)
    check_float(grad_out, f"{op}: grad_out")
    torch._check(indices.device == grad_out.device,
                 lambda: f"{op}: indices is on {indices.device} but grad_out is on {grad_out.device}")
    torch._check(grad_out.dim() == indices.dim() + 1 and grad_out.shape[:-1] == indices.shape,
                 lambda: f"{op}: grad_out must have shape indices.shape + (embedding_dim,), got "
                         f"{tuple(grad_out.shape)} and {tuple(indices.shape)}")
    torch._check(num_weights >= 0, lambda: f"{op}: num_weights must be >= 0")
    _check_padding(padding_idx, num_weights, op)


def _register(name):
    qual = f"gpu_puzzles::{name}"

    @torch.library.register_fake(qual)
    def _fake(indices, weight, padding_idx=None):
        _check_forward(indices, weight, padding_idx, name)
        return weight.new_empty((*indices.shape, weight.shape[1]))

    @torch.library.register_fake(f"{qual}_backward")
    def _fake_backward(grad_out, indices, num_weights, padding_idx, deterministic):
        _check_backward(grad_out, indices, num_weights, padding_idx, f"{name}_backward")
        return grad_out.new_empty((num_weights, grad_out.shape[-1]))

    # Autograd is registered in C++ (csrc/embedding/embedding_autograd.cpp): the Python
    # autograd kernel would cost more host time per call than the seed-size lookup.


_register("embedding")
_register("embedding_2d")

# The overloads themselves: skips the packet lookup on every call.
_embedding = torch.ops.gpu_puzzles.embedding.default
_embedding_2d = torch.ops.gpu_puzzles.embedding_2d.default


def embedding(indices: Tensor, weight: Tensor, padding_idx: Optional[int] = None) -> Tensor:
    """Embedding lookup with the coalesced CUDA kernel: ``out[..., :] = weight[indices[...], :]``.

    ``indices``: any shape, int32 or int64, on ``weight``'s device; ``weight``: ``(V, E)``
    float. Returns ``indices.shape + (E,)`` in ``weight``'s dtype. An index outside
    ``[0, V)`` (negative included) gives a zero row and no gradient (the seed's rule,
    unlike F.embedding, which raises). ``padding_idx`` behaves as in
    ``torch.nn.functional.embedding``: the row is returned, its gradient stays zero.

    The weight gradient is dense ``(V, E)``, summed in float32 for half types, in a
    fixed order (bit-identical run to run) on every device.
    """
    return _embedding(indices, weight, padding_idx)


def embedding_2d(indices: Tensor, weight: Tensor, padding_idx: Optional[int] = None) -> Tensor:
    """Embedding lookup with the seed's 2D-grid kernel (the coalescing counter-example).

    Same semantics as :func:`embedding`. On CUDA, 16x16 blocks put consecutive lanes
    of a warp on consecutive tokens, so one warp request touches 16 different rows.
    Its backward uses float atomics on the same grid (non-deterministic) unless
    ``torch.are_deterministic_algorithms_enabled()``, which selects the sorted path.
    """
    return _embedding_2d(indices, weight, padding_idx)
