"""layernorm_linear cases: layer_norm alone, and LayerNorm+Linear fused vs unfused vs
eager vs torch.compile vs F.linear alone (the GEMM floor), forward and forward+backward;
plus the peak extra memory of each implementation's forward+backward."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

import gpu_puzzles as gp

from .common import Case, backward_fn, peak_extra_mib

OP = "layernorm_linear"


def reference(x, ln_weight, ln_bias, linear_weight, linear_bias=None):
    """PyTorch eager: F.linear(F.layer_norm(x)), in x's dtype (F.layer_norm's default eps)."""
    return F.linear(F.layer_norm(x, (x.shape[-1],), ln_weight, ln_bias), linear_weight, linear_bias)


def linear_only(x, ln_weight, ln_bias, linear_weight, linear_bias=None):
    """The GEMM floor: F.linear on x, no normalisation."""
    return F.linear(x, linear_weight, linear_bias)


def _linear_only_bwd(x, lw, lb, W, b, g):
    return torch.autograd.grad(F.linear(x, W, b), (x, W, b), g)


def inputs(M, H, N, dtype, device, grad=False):
    x = torch.randn(M, H, device=device, dtype=dtype, requires_grad=grad)
    lw = (1 + 0.1 * torch.randn(H, device=device, dtype=dtype)).requires_grad_(grad)
    lb = (0.1 * torch.randn(H, device=device, dtype=dtype)).requires_grad_(grad)
    W = (torch.randn(N, H, device=device, dtype=dtype) / H ** 0.5).requires_grad_(grad)
    b = (0.1 * torch.randn(N, device=device, dtype=dtype)).requires_grad_(grad)
    return x, lw, lb, W, b


_unfused = functools.partial(gp.fused_layernorm_linear, algorithm="unfused")


def impls(compile_=True):
    out = {"ours fused": gp.fused_layernorm_linear, "ours unfused": _unfused, "eager": reference}
    if compile_:
        out["compile"] = torch.compile(reference, dynamic=False)
    return out


def cases(device, shapes, dtype=torch.bfloat16, directions=("fwd", "fwd+bwd"), compile_=True, ln_alone=(),
          ln_backward=False):
    """LayerNorm+Linear cases for each (M, H, N) of ``shapes``, after layer_norm alone for each (M, H) of
    ``ln_alone`` (forward; forward+backward too with ``ln_backward``)."""
    esize = torch.tensor([], dtype=dtype).element_size()
    dname = str(dtype).replace("torch.", "")
    out = []
    for (M, H) in ln_alone:
        f = {"ours": gp.layer_norm, "eager": lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b)}
        if compile_:
            f["compile"] = torch.compile(lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b), dynamic=False)
        # M, H bound now: the loop below rebinds them (a late-bound lambda timed the last
        # shape's 16384x4096 rows against 8192x4096's bytes: 0.10 ms, "1.3 TB/s").
        out.append(Case("layer_norm", f"({M},{H})", "fwd", lambda M=M, H=H: inputs(M, H, 1, dtype, device)[:3], f,
                        bytes=2 * M * H * esize, params=dict(M=M, H=H, dtype=dname)))
        if ln_backward:
            def make_ln(M=M, H=H):
                return (*inputs(M, H, 1, dtype, device, grad=True)[:3], torch.randn(M, H, device=device, dtype=dtype))
            out.append(Case("layer_norm", f"({M},{H})", "fwd+bwd", make_ln,
                            {k: backward_fn(g, 3) for k, g in f.items()}, bytes=5 * M * H * esize,
                            params=dict(M=M, H=H, dtype=dname)))
    for (M, H, N) in shapes:
        params = dict(M=M, H=H, N=N, dtype=dname)
        name = f"M={M} H={H} N={N}"
        fwd = impls(compile_)
        fwd["F.linear alone"] = linear_only
        flops = 2 * M * H * N
        if "fwd" in directions:
            out.append(Case(OP, name, "fwd", lambda M=M, H=H, N=N: inputs(M, H, N, dtype, device), fwd,
                            flops=flops, params=params))
        if "fwd+bwd" in directions:
            def make(M=M, H=H, N=N):
                return (*inputs(M, H, N, dtype, device, grad=True), torch.randn(M, N, device=device, dtype=dtype))
            bwd = {k: backward_fn(f, 5) for k, f in impls(compile_).items()}
            bwd["F.linear alone"] = _linear_only_bwd
            out.append(Case(OP, name, "fwd+bwd", make, bwd, flops=3 * flops, params=params))
    return out


# Two transformer projections (square, and 4x wide from a narrow H), and a narrow
# projection of wide rows (N << H), where the folded form moves fewer bytes than
# eager's normalise-first (2NH + 2MN < MH).
BENCH_SHAPES = [(8192, 4096, 4096), (16384, 1024, 4096), (16384, 4096, 512)]


# The CPU shapes: GPT-2's fused qkv projection, and the tour's small square one.
CPU_SHAPES = [(512, 768, 2304), (512, 256, 256)]


def bench_cases(device):
    if device.type == "cpu":
        return cases(device, CPU_SHAPES, dtype=torch.float32, compile_=False, ln_alone=[(512, 768), (512, 256)],
                     ln_backward=True)
    return cases(device, BENCH_SHAPES, ln_alone=[(8192, 4096)])


def tour_cases(device):
    if device.type == "cuda":
        return cases(device, [(8192, 4096, 4096)], ln_alone=[(8192, 4096)])
    return cases(device, [(512, 768, 2304)], dtype=torch.float32, compile_=False, ln_alone=[(512, 768)],
                 ln_backward=True)


def peak_memory(device, shapes=BENCH_SHAPES, dtype=torch.bfloat16, compile_=True):
    """Peak memory above the live inputs (MiB) of one forward+backward per implementation."""
    if device.type != "cuda":
        return []
    rows = []
    for (M, H, N) in shapes:
        fns = {k: backward_fn(f, 5) for k, f in impls(compile_).items()}
        fns["F.linear alone"] = _linear_only_bwd
        for label, fn in fns.items():
            args = (*inputs(M, H, N, dtype, device, grad=True), torch.randn(M, N, device=device, dtype=dtype))
            peak = peak_extra_mib(fn, args, device)
            del args
            rows.append({"op": OP, "case": f"M={M} H={H} N={N}", "direction": "fwd+bwd", "impl": label,
                         "peak_extra_MiB": peak, "M": M, "H": H, "N": N,
                         "dtype": str(dtype).replace("torch.", "")})
    return rows


def tour_check(device):
    """Max error of ours vs a float64 reference, forward and the five gradients, fresh inputs."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    errs = {}
    x, lw, lb, W, b = inputs(300, 384, 200, dtype, device, grad=True)
    g = torch.randn(300, 200, device=device, dtype=dtype)
    leaves = [t.detach().double().requires_grad_() for t in (x, lw, lb, W, b)]
    y64 = reference(*leaves)
    refs = torch.autograd.grad(y64, leaves, g.double())
    for label, f in (("fused", gp.fused_layernorm_linear), ("unfused", _unfused)):
        y = f(x, lw, lb, W, b)
        grads = torch.autograd.grad(y, (x, lw, lb, W, b), g)
        errs[f"fwd {label}"] = (y.double() - y64).abs().max().item()
        errs[f"bwd {label}"] = max((a.double() - r).abs().max().item() / max(1.0, r.abs().max().item())
                                   for a, r in zip(grads, refs))
    xl = (x.detach() + 1000).to(dtype)  # large mean: the guard's normalise-first rows
    y64l = reference(xl.double(), *leaves[1:])
    errs["fwd fused, mean 1000"] = (gp.fused_layernorm_linear(xl, lw, lb, W, b).double() - y64l).abs().max().item()
    errs["fwd eager, mean 1000"] = (reference(xl, lw, lb, W, b).double() - y64l).abs().max().item()
    return errs
