"""conv1d cases: the benchmark shapes and the tour's small checks."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

import gpu_puzzles as gp

from .common import Case, backward_fn, backward_only_fn

OP = "conv1d"


def reference(x, weight, bias=None, causal=False):
    """PyTorch's depthwise F.conv1d with explicit padding, in x's dtype; any of our input ranks."""
    shape = x.shape
    K = weight.shape[-1]
    x3 = x.reshape(-1, 1 if x.dim() == 1 else shape[-2], shape[-1])
    w3 = weight.reshape(x3.shape[1], 1, K)
    y = F.conv1d(x3, w3, None if bias is None else bias.reshape(-1), padding=K - 1, groups=x3.shape[1])
    L = shape[-1]
    y = y[..., :L] if causal else y[..., K - 1:K - 1 + L]
    return y.reshape(shape)


def _inputs(B, C, L, K, dtype, device, grad=False, bias=True):
    x = torch.randn(B, C, L, device=device, dtype=dtype, requires_grad=grad)
    w = (torch.randn(C, K, device=device, dtype=dtype) / K ** 0.5).requires_grad_(grad)
    b = torch.randn(C, device=device, dtype=dtype).requires_grad_(grad) if bias else None
    return x, w, b


def cases(device, shapes, dtype=torch.bfloat16, directions=("fwd", "bwd"), compile_=True):
    out = []
    for (B, C, L, K) in shapes:
        for causal in (True, False):
            esize = torch.tensor([], dtype=dtype).element_size()
            n = B * C * L
            ours = functools.partial(gp.conv1d, causal=causal)
            eager = functools.partial(reference, causal=causal)
            impls_f = {"ours": ours, "eager": eager}
            if compile_:
                impls_f["compile"] = torch.compile(functools.partial(reference, causal=causal), dynamic=False)
            params = dict(B=B, C=C, L=L, K=K, causal=causal, dtype=str(dtype).replace("torch.", ""))
            name = f"({B},{C},{L}) K={K} {'causal' if causal else 'lookahead'}"
            if "fwd" in directions:
                out.append(Case(OP, name, "fwd", lambda B=B, C=C, L=L, K=K: _inputs(B, C, L, K, dtype, device),
                                impls_f, bytes=2 * n * esize, params=params))
            def make(B=B, C=C, L=L, K=K):
                x, w, b = _inputs(B, C, L, K, dtype, device, grad=True)
                return x, w, b, torch.randn(B, C, L, device=device, dtype=dtype)
            if "fwd+bwd" in directions:
                impls_fb = {k: backward_fn(f, 3) for k, f in impls_f.items()}
                out.append(Case(OP, name, "fwd+bwd", make, impls_fb, bytes=5 * n * esize, params=params))
            if "bwd" in directions:
                # The backward alone (dx, dw and dbias together): reads x and grad_out,
                # writes dx; the weight and bias are negligible.
                impls_b = {k: backward_only_fn(f, 3) for k, f in impls_f.items()}
                out.append(Case(OP, name, "bwd", make, impls_b, bytes=3 * n * esize, params=params))
    return out


# The CPU shapes: the tour's small case and a GPT-sized depthwise convolution.
CPU_SHAPES = [(2, 64, 1024, 4), (16, 768, 256, 4)]


def bench_cases(device):
    if device.type == "cpu":
        return cases(device, CPU_SHAPES, dtype=torch.float32, directions=("fwd", "fwd+bwd"), compile_=False)
    return cases(device, [(8, 4096, 2048, 4), (4, 1024, 16384, 4)])


def tour_cases(device):
    if device.type == "cuda":
        return cases(device, [(8, 4096, 2048, 4)], directions=("fwd", "bwd"))
    return cases(device, [(16, 768, 256, 4)], dtype=torch.float32, directions=("fwd", "fwd+bwd"), compile_=False)


def tour_check(device):
    """Max abs error of ours vs a float64 reference, forward and gradients, on fresh inputs."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    errs = {}
    for causal in (False, True):
        x, w, b = _inputs(2, 48, 777, 4, dtype, device, grad=True)
        g = torch.randn_like(x)
        y = gp.conv1d(x, w, b, causal=causal)
        grads = torch.autograd.grad(y, (x, w, b), g)
        x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
        y64 = reference(x64, w64, b64, causal=causal)
        grads64 = torch.autograd.grad(y64, (x64, w64, b64), g.double())
        key = "causal" if causal else "lookahead"
        errs[f"fwd {key}"] = (y.double() - y64).abs().max().item() / max(1.0, y64.abs().max().item())
        errs[f"bwd {key}"] = max((a.double() - r).abs().max().item() / max(1.0, r.abs().max().item())
                                 for a, r in zip(grads, grads64))
    return errs
