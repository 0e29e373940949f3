"""rmsnorm_linear cases: rms_norm alone, and RMSNorm+Linear fused (ours) vs eager
(F.rms_norm + F.linear) vs torch.compile of the same, forward and forward+backward, at
Llama-style shapes (W as (N, H) rows, no bias); plus the peak extra memory of each
implementation's forward+backward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import gpu_puzzles as gp

from .common import Case, backward_fn, norm_linear_memory_rows

OP = "rmsnorm_linear"
EPS = 1e-6


def rms_reference(x, weight):
    return F.rms_norm(x, (x.shape[-1],), weight, EPS)


def reference(x, norm_weight, linear_weight):
    """PyTorch eager: F.linear(F.rms_norm(x)), in x's dtype."""
    return F.linear(F.rms_norm(x, (x.shape[-1],), norm_weight, EPS), linear_weight)


def ours(x, norm_weight, linear_weight):
    return gp.fused_rmsnorm_linear(x, norm_weight, linear_weight, None, EPS)


def ours_rms(x, weight):
    return gp.rms_norm(x, weight, EPS)


def inputs(M, H, N, dtype, device, grad=False):
    """x, norm_weight, W (N, H)."""
    x = torch.randn(M, H, device=device, dtype=dtype, requires_grad=grad)
    nw = (1 + 0.1 * torch.randn(H, device=device, dtype=dtype)).requires_grad_(grad)
    W = (torch.randn(N, H, device=device, dtype=dtype) / H ** 0.5).requires_grad_(grad)
    return x, nw, W


def impls(fused, eager, compile_=True):
    out = {"ours": fused, "eager": eager}
    if compile_:
        out["compile"] = torch.compile(eager, dynamic=False)
    return out


def cases(device, shapes, dtype=torch.bfloat16, compile_=True, rms_alone=()):
    """rms_norm alone for each (M, H) of ``rms_alone``, then RMSNorm+Linear for each (M, H, N) of
    ``shapes``; forward and forward+backward."""
    esize = torch.tensor([], dtype=dtype).element_size()
    dname = str(dtype).replace("torch.", "")
    out = []
    for (M, H) in rms_alone:
        f = impls(ours_rms, rms_reference, compile_)
        params = dict(M=M, H=H, dtype=dname)
        out.append(Case("rms_norm", f"({M},{H})", "fwd", lambda M=M, H=H: inputs(M, H, 1, dtype, device)[:2], f,
                        bytes=2 * M * H * esize, params=params))

        def make_rms(M=M, H=H):
            return (*inputs(M, H, 1, dtype, device, grad=True)[:2], torch.randn(M, H, device=device, dtype=dtype))
        out.append(Case("rms_norm", f"({M},{H})", "fwd+bwd", make_rms, {k: backward_fn(g, 2) for k, g in f.items()},
                        bytes=5 * M * H * esize, params=params))
    for (M, H, N) in shapes:
        params = dict(M=M, H=H, N=N, dtype=dname)
        name = f"M={M} H={H} N={N}"
        flops = 2 * M * H * N
        f = impls(ours, reference, compile_)
        out.append(Case(OP, name, "fwd", lambda M=M, H=H, N=N: inputs(M, H, N, dtype, device), f, flops=flops,
                        params=params))

        def make(M=M, H=H, N=N):
            return (*inputs(M, H, N, dtype, device, grad=True), torch.randn(M, N, device=device, dtype=dtype))
        out.append(Case(OP, name, "fwd+bwd", make, {k: backward_fn(g, 3) for k, g in impls(ours, reference,
                                                                                              compile_).items()},
                        flops=3 * flops, params=params))
    return out


# Llama-style (4 x 2048 tokens, hidden 2048, 32 heads / 8 kv heads of 64, intermediate 8192):
# the fused q,k,v projection (2048 + 512 + 512), gate+up (2 x 8192), and a 4096-wide layer.
BENCH_SHAPES = [(8192, 2048, 3072), (8192, 2048, 16384), (8192, 4096, 4096)]
RMS_ALONE = [(8192, 2048), (8192, 4096)]
CPU_SHAPES = [(512, 512, 768)]


def bench_cases(device):
    if device.type == "cpu":
        return cases(device, CPU_SHAPES, dtype=torch.float32, compile_=False, rms_alone=[(512, 512)])
    return cases(device, BENCH_SHAPES, rms_alone=RMS_ALONE)


def tour_cases(device):
    if device.type == "cuda":
        return cases(device, BENCH_SHAPES[:1], rms_alone=RMS_ALONE[:1])
    return cases(device, CPU_SHAPES, dtype=torch.float32, compile_=False, rms_alone=[(512, 512)])


def peak_memory(device, shapes=BENCH_SHAPES, dtype=torch.bfloat16, compile_=True):
    """Peak memory above the live inputs (MiB) of one forward+backward per implementation."""
    if device.type != "cuda":
        return []

    def fns():
        return {label: backward_fn(fn, 3) for label, fn in impls(ours, reference, compile_).items()}

    return norm_linear_memory_rows(OP, shapes, fns, inputs, dtype, device)


def tour_check(device):
    """Max error of ours vs a float64 reference: rms_norm and the fused op, forward and gradients."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    errs = {}
    x, nw, W = inputs(300, 384, 200, dtype, device, grad=True)
    g = torch.randn(300, 200, device=device, dtype=dtype)
    leaves = [t.detach().double().requires_grad_() for t in (x, nw, W)]
    y64 = reference(*leaves)
    refs = torch.autograd.grad(y64, leaves, g.double())
    y = ours(x, nw, W)
    grads = torch.autograd.grad(y, (x, nw, W), g)
    errs["fwd fused"] = (y.double() - y64).abs().max().item()
    errs["bwd fused"] = max((a.double() - r).abs().max().item() / max(1.0, r.abs().max().item())
                            for a, r in zip(grads, refs))
    errs["fwd rms_norm"] = (ours_rms(x, nw).double() - rms_reference(*leaves[:2])).abs().max().item()
    return errs
