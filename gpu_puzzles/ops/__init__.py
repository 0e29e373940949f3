"""Functional API: one module per op, each registering its fake kernel and autograd."""
from .conv1d import conv1d
from .layernorm_linear import fused_layernorm_linear, layer_norm, unfused_layernorm_linear

__all__ = ["conv1d", "layer_norm", "fused_layernorm_linear", "unfused_layernorm_linear"]
