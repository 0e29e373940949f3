"""gated_act cases: the gated MLP's middle at the shapes real models hand over, and the
tour's checks."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

import gpu_puzzles as gp

from .common import Case, backward_fn, backward_only_fn

OP = "gated_act"


def reference(gate, up, activation="silu"):
    """PyTorch's act(gate) * up, as transformers' MLPs write it, in the inputs' dtype."""
    if activation == "silu":
        return F.silu(gate) * up
    return F.gelu(gate, approximate="tanh" if activation == "gelu_tanh" else "none") * up


def _inputs(T, inner, dtype, device, grad=False, fused=False):
    """gate and up (T, I): two tensors, or (fused) the halves of one (T, 2 I) projection."""
    if fused:
        gu = torch.randn(T, 2 * inner, device=device, dtype=dtype, requires_grad=grad)
        return gu.chunk(2, dim=-1) if not grad else (gu,)
    gate = torch.randn(T, inner, device=device, dtype=dtype, requires_grad=grad)
    return gate, torch.randn(T, inner, device=device, dtype=dtype, requires_grad=grad)


def _halves(f):
    """f over the halves of one (T, 2 I) tensor: the leaf whose gradient the backward writes."""
    return lambda gu: f(*gu.chunk(2, dim=-1))


# (label, T tokens, inner, activation, halves of one projection):
# Llama-1B / Llama-3-8B at 8192 tokens, Phi-3-mini's gate_up_proj, Gemma-2-2B's GeGLU.
SHAPES = [("Llama-1B", 8192, 8192, "silu", False), ("Llama-3-8B", 8192, 14336, "silu", False),
          ("Phi-3-mini gate_up", 8192, 8192, "silu", True), ("Gemma-2-2B", 8192, 9216, "gelu_tanh", False)]


def cases(device, shapes, dtype=torch.bfloat16, directions=("fwd", "bwd"), compile_=True):
    out = []
    for label, T, inner, act, fused in shapes:
        esize = torch.tensor([], dtype=dtype).element_size()
        n = T * inner
        ours = functools.partial(gp.gated_act, activation=act)
        eager = functools.partial(reference, activation=act)
        impls_f = {"ours": ours, "eager": eager}
        if compile_:
            impls_f["compile"] = torch.compile(functools.partial(reference, activation=act), dynamic=False)
        params = dict(T=T, inner=inner, activation=act, halves=fused, dtype=str(dtype).replace("torch.", ""))
        name = f"{label} ({T},{inner}) {act}{' halves' if fused else ''}"
        if "fwd" in directions:
            # reads gate and up, writes out
            out.append(Case(OP, name, "fwd", functools.partial(_inputs, T, inner, dtype, device, fused=fused),
                            impls_f, bytes=3 * n * esize, params=params))
        n_in = 1 if fused else 2
        impls_g = {k: (_halves(f) if fused else f) for k, f in impls_f.items()}

        def make(T=T, inner=inner, f=fused):
            dy = torch.randn(T, inner, device=device, dtype=dtype)
            return (*_inputs(T, inner, dtype, device, grad=True, fused=f), dy)
        if "fwd+bwd" in directions:
            impls_fb = {k: backward_fn(f, n_in) for k, f in impls_g.items()}
            out.append(Case(OP, name, "fwd+bwd", make, impls_fb, bytes=8 * n * esize, params=params))
        if "bwd" in directions:
            # reads grad_out, gate and up; writes dgate and dup
            impls_b = {k: backward_only_fn(f, n_in) for k, f in impls_g.items()}
            out.append(Case(OP, name, "bwd", make, impls_b, bytes=5 * n * esize, params=params))
    return out


# The CPU shapes: a small MLP's width, fp32.
CPU_SHAPES = [("small", 512, 1024, "silu", False), ("small", 512, 1024, "gelu_tanh", True)]


def bench_cases(device):
    if device.type == "cpu":
        return cases(device, CPU_SHAPES, dtype=torch.float32, directions=("fwd", "fwd+bwd"), compile_=False)
    return cases(device, SHAPES)


def tour_cases(device):
    if device.type == "cuda":
        return cases(device, SHAPES[:1], directions=("fwd", "bwd"))
    return cases(device, CPU_SHAPES[:1], dtype=torch.float32, directions=("fwd", "fwd+bwd"), compile_=False)


def tour_check(device):
    """Max error of ours vs a float64 reference, forward and gradients, on fresh inputs."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    errs = {}
    for act in ("silu", "gelu_tanh"):
        (gu,) = _inputs(300, 700, dtype, device, grad=True, fused=True)
        dy = torch.randn(300, 700, device=device, dtype=dtype)
        y = gp.gated_act(*gu.chunk(2, dim=-1), act)
        (d,) = torch.autograd.grad(y, gu, dy)
        g64 = gu.detach().double().requires_grad_()
        y64 = reference(*g64.chunk(2, dim=-1), act)
        (d64,) = torch.autograd.grad(y64, g64, dy.double())
        errs[f"fwd {act}"] = (y.double() - y64).abs().max().item() / max(1.0, y64.abs().max().item())
        errs[f"bwd {act}"] = (d.double() - d64).abs().max().item() / max(1.0, d64.abs().max().item())
    return errs
