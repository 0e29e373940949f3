"""The gated MLP's middle: ``torch.ops.gpu_puzzles.gated_act``.

out = act(gate) * up, elementwise: SwiGLU (``activation="silu"``, Llama, Qwen, Mistral) and
GeGLU (``"gelu_tanh"``, Gemma; ``"gelu"``, erf-GELU). One pass where eager PyTorch makes
two (the activation, then the product) and keeps act(gate) for the backward as well; the
backward is one pass too. Math in float32 (float64 for float64), rounded once.
"""
import torch
from torch import Tensor

from ._common import register_fake

ACTIVATIONS = ("silu", "gelu_tanh", "gelu")


# Argument checks live in C++ (csrc/gated_act/gated_act.cpp); the fake kernels give shapes.
# Outputs are contiguous whatever the inputs' strides, as new_empty gives.
@register_fake("gpu_puzzles::gated_act")
def _gated_act_fake(gate, up, activation="silu"):
    return gate.new_empty(gate.shape)


@register_fake("gpu_puzzles::gated_act_backward")
def _gated_act_backward_fake(grad_out, gate, up, activation):
    return gate.new_empty(gate.shape), gate.new_empty(gate.shape)


# Autograd is registered in C++ (csrc/gated_act/gated_act_autograd.cpp; why: csrc/common/autograd.h).
_gated_act = torch.ops.gpu_puzzles.gated_act.default  # the overload: no packet lookup per call


def gated_act(gate: Tensor, up: Tensor, activation: str = "silu") -> Tensor:
    """``act(gate) * up`` for ``gate`` and ``up`` of one shape ``(..., I)`` and dtype.

    ``activation``: ``"silu"`` (SwiGLU: ``F.silu(gate) * up``), ``"gelu_tanh"`` (GeGLU:
    ``F.gelu(gate, approximate="tanh") * up``) or ``"gelu"`` (``F.gelu(gate) * up``).
    ``gate`` and ``up`` may be views, e.g. the two halves of one projection
    (``gate_up.chunk(2, dim=-1)``): the CUDA kernel reads them in place. Differentiable; the
    backward reads gate and up again instead of a saved act(gate). No autocast rule (as
    ``F.silu``): it runs in the dtype it is given.
    """
    return _gated_act(gate, up, activation)
