"""Functional API: one module per op, each registering its fake kernel and autograd."""
from .conv1d import conv1d
from .embedding import embedding, embedding_2d
from .softmax import log_softmax, softmax

__all__ = ["conv1d", "embedding", "embedding_2d", "softmax", "log_softmax"]
