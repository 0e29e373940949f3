"""Functional API: one module per op, each registering its fake kernel and autograd."""
from .attention import attention
from .conv1d import conv1d
from .cross_entropy import cross_entropy, fused_linear_cross_entropy
from .embedding import embedding
from .gated_act import gated_act
from .layernorm_linear import fused_layernorm_linear, layer_norm
from .rmsnorm_linear import fused_rmsnorm_linear, rms_norm
from .rotary import rotary
from .softmax import log_softmax, softmax

__all__ = ["conv1d", "embedding", "softmax", "log_softmax", "layer_norm", "fused_layernorm_linear", "attention",
           "rms_norm", "fused_rmsnorm_linear", "cross_entropy", "fused_linear_cross_entropy", "gated_act",
           "rotary"]
