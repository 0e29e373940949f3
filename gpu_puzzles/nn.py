"""nn.Module wrappers around the functional ops."""
import math

import torch
from torch import nn

from . import ops


class Conv1d(nn.Module):
    """Depthwise 1D convolution over (B, C, L) or (C, L) inputs; output as long as the input.

    Initialised like ``torch.nn.Conv1d(channels, channels, kernel_size, groups=channels)``:
    uniform in +-1/sqrt(kernel_size) for weight and bias.
    """

    def __init__(self, channels: int, kernel_size: int, bias: bool = True, causal: bool = False,
                 device=None, dtype=None):
        super().__init__()
        if channels < 1 or kernel_size < 1:
            raise ValueError(f"Conv1d: channels and kernel_size must be >= 1, got {channels}, {kernel_size}")
        factory = {"device": device, "dtype": dtype}
        self.channels, self.kernel_size, self.causal = channels, kernel_size, causal
        self.weight = nn.Parameter(torch.empty(channels, kernel_size, **factory))
        self.bias = nn.Parameter(torch.empty(channels, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self):
        bound = 1.0 / math.sqrt(self.kernel_size)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x):
        return ops.conv1d(x, self.weight, self.bias, causal=self.causal)

    def extra_repr(self):
        return f"{self.channels}, kernel_size={self.kernel_size}, bias={self.bias is not None}, causal={self.causal}"


class Embedding(nn.Module):
    """Lookup table ``(num_embeddings, embedding_dim)``; see :func:`gpu_puzzles.embedding`.

    ``kernel="coalesced"`` (the fast kernel) or ``"2d"`` (the seed's 2D grid). Initialised
    like ``torch.nn.Embedding``: N(0, 1), with the ``padding_idx`` row zeroed.
    """

    _KERNELS = ("coalesced", "2d")

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx=None, kernel: str = "coalesced",
                 device=None, dtype=None):
        super().__init__()
        if num_embeddings < 0 or embedding_dim < 0:
            raise ValueError(f"Embedding: num_embeddings and embedding_dim must be >= 0, got "
                             f"{num_embeddings}, {embedding_dim}")
        if kernel not in self._KERNELS:
            raise ValueError(f"Embedding: kernel must be one of {self._KERNELS}, got {kernel!r}")
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"Embedding: padding_idx must be within [-{num_embeddings}, {num_embeddings}), "
                                 f"got {padding_idx}")
            padding_idx = padding_idx % num_embeddings
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx, self.kernel = padding_idx, kernel
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.normal_(self.weight)
        if self.padding_idx is not None:
            with torch.no_grad():
                self.weight[self.padding_idx].fill_(0)

    def forward(self, indices):
        fn = ops.embedding if self.kernel == "coalesced" else ops.embedding_2d
        return fn(indices, self.weight, self.padding_idx)

    def extra_repr(self):
        s = f"{self.num_embeddings}, {self.embedding_dim}"
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        return s + f", kernel={self.kernel!r}"

class Softmax(nn.Module):
    """Softmax over ``dim`` (like ``torch.nn.Softmax``, but ``dim`` defaults to -1)."""

    def __init__(self, dim: int = -1):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        return ops.softmax(x, self.dim)

    def extra_repr(self):
        return f"dim={self.dim}"


class LogSoftmax(nn.Module):
    """Log-softmax over ``dim`` (like ``torch.nn.LogSoftmax``, but ``dim`` defaults to -1)."""

    def __init__(self, dim: int = -1):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        return ops.log_softmax(x, self.dim)

    def extra_repr(self):
        return f"dim={self.dim}"
