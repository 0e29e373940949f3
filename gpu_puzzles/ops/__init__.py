"""Functional API: one module per op, each registering its fake kernel and autograd."""
from .conv1d import conv1d
from .softmax import log_softmax, softmax

__all__ = ["conv1d", "softmax", "log_softmax"]
