"""softmax cases: the benchmark shapes and the tour's small checks.

Byte counts: the forward reads x and writes y; the backward (timed alone, on a
saved output y) reads y and dy and writes dx.
"""
from __future__ import annotations

import functools
import math

import torch

import gpu_puzzles as gp

from .common import Case, backward_fn

OP = "softmax"


def reference_backward(dy, y, dim, log=False):
    """Eager PyTorch's own backward kernel on the saved output."""
    if log:
        return torch._log_softmax_backward_data(dy, y, dim, y.dtype)
    return torch._softmax_backward_data(dy, y, dim, y.dtype)


def _softmax_bwd_math(dy, y, dim):
    """The backward as plain tensor math, for torch.compile to fuse."""
    yf, gf = y.float(), dy.float()
    return (yf * (gf - (gf * yf).sum(dim, keepdim=True))).to(y.dtype)


def _log_softmax_bwd_math(dy, y, dim):
    yf, gf = y.float(), dy.float()
    return (gf - yf.exp() * gf.sum(dim, keepdim=True)).to(y.dtype)


def _esize(dtype):
    return torch.tensor([], dtype=dtype).element_size()


def _randn(shape, device, dtype, view):
    """A random tensor of `shape`; view="drop_last" takes t[:, :-1, :] of a tensor one longer in
    dim 1 (the shifted logits of a language-model loss: strided rows, no copy)."""
    if view == "drop_last":
        full = list(shape)
        full[1] += 1
        return torch.randn(full, device=device, dtype=dtype)[:, :-1]
    return torch.randn(shape, device=device, dtype=dtype)


def _label(shape, dim, log, view):
    return (f"{'log_softmax ' if log else ''}{tuple(shape)} dim={dim}"
            + (" of t[:, :-1, :]" if view else ""))


def _under(knobs, fn):
    """fn called under gpu_puzzles.tuning.override(**knobs)."""
    def run(*args):
        with gp.tuning.override(**knobs):
            return fn(*args)
    return run


# The long rows' shared-memory kernels: "ours" takes the most specialised one the layout
# allows (aligned, or inputs at the output's offset within 16 bytes); "ours-shifted" forces
# the general one (smem_rows_kernel) on the same inputs, for comparison in one run.
SHIFTED = {"shifted": {"softmax_smem_align": "shifted"}}


def fwd_case(device, shape, dim, dtype, compile_=True, algorithms=("auto",), name=None, log=False, view=None,
             variants=None):
    def make():
        return (_randn(shape, device, dtype, view),)
    ours, eager = (gp.log_softmax, torch.log_softmax) if log else (gp.softmax, torch.softmax)
    impls = {("ours" if a == "auto" else f"ours-{a}"): functools.partial(ours, dim=dim, algorithm=a)
             for a in algorithms}
    for label, knobs in (variants or {}).items():
        impls[f"ours-{label}"] = _under(knobs, impls["ours"])
    impls["eager"] = functools.partial(eager, dim=dim)
    if compile_:
        impls["compile"] = torch.compile(functools.partial(eager, dim=dim), dynamic=False)
    n = math.prod(shape)
    params = dict(shape=list(shape), dim=dim, dtype=str(dtype).replace("torch.", ""))
    if log:
        params["log"] = True
    if view:
        params["view"] = view
    return Case(OP, name or _label(shape, dim, log, view), "fwd", make, impls, bytes=2 * n * _esize(dtype),
                params=params)


def bwd_case(device, shape, dim, dtype, compile_=True, algorithms=("auto",), name=None, log=False, variants=None):
    def make():
        x = torch.randn(shape, device=device, dtype=dtype)
        y = torch.log_softmax(x, dim) if log else torch.softmax(x, dim)
        return y, torch.randn(shape, device=device, dtype=dtype)
    op = torch.ops.gpu_puzzles.log_softmax_backward if log else torch.ops.gpu_puzzles.softmax_backward
    impls = {("ours" if a == "auto" else f"ours-{a}"):
             (lambda y, dy, a=a: op(dy, y, dim, a)) for a in algorithms}
    for label, knobs in (variants or {}).items():
        impls[f"ours-{label}"] = _under(knobs, impls["ours"])
    impls["eager"] = lambda y, dy: reference_backward(dy, y, dim, log)
    if compile_:
        math_fn = _log_softmax_bwd_math if log else _softmax_bwd_math
        cf = torch.compile(functools.partial(math_fn, dim=dim), dynamic=False)
        impls["compile"] = lambda y, dy: cf(dy, y)
    n = math.prod(shape)
    params = dict(shape=list(shape), dim=dim, dtype=str(dtype).replace("torch.", ""))
    if log:
        params["log"] = True
    return Case(OP, name or _label(shape, dim, log, None), "bwd", make, impls, bytes=3 * n * _esize(dtype),
                params=params)


def cpu_case(device, shape, log, direction):
    """fp32 softmax / log_softmax over the last dim, forward or forward+backward, ours vs eager."""
    ours, eager = (gp.log_softmax, torch.log_softmax) if log else (gp.softmax, torch.softmax)
    impls = {"ours": functools.partial(ours, dim=-1), "eager": functools.partial(eager, dim=-1)}
    n = math.prod(shape)
    params = dict(shape=list(shape), dim=-1, dtype="float32", log=log)
    name = f"{'log_softmax' if log else 'softmax'} {tuple(shape)}"
    if direction == "fwd":
        return Case(OP, name, "fwd", lambda: (torch.randn(shape, device=device),), impls, bytes=8 * n,
                    params=params)

    def make():
        return torch.randn(shape, device=device, requires_grad=True), torch.randn(shape, device=device)
    return Case(OP, name, "fwd+bwd", make, {k: backward_fn(f, 1) for k, f in impls.items()}, bytes=20 * n,
                params=params)


# The CPU shapes: a short and a long softmax row, and a GPT-2 vocabulary's log_softmax.
CPU_SHAPES = [((2048, 1024), False), ((256, 1024), False), ((512, 50257), True)]


def bench_cases(device):
    if device.type == "cpu":
        return [cpu_case(device, s, log, d) for s, log in CPU_SHAPES for d in ("fwd", "fwd+bwd")]
    bf16, f32 = torch.bfloat16, torch.float32
    return [
        fwd_case(device, (32768, 4096), -1, bf16),
        bwd_case(device, (32768, 4096), -1, bf16),
        fwd_case(device, (4096, 131072), -1, f32, variants=SHIFTED),
        bwd_case(device, (4096, 131072), -1, f32, variants=SHIFTED),
        fwd_case(device, (65536, 512), -1, bf16),
        bwd_case(device, (65536, 512), -1, bf16),
        fwd_case(device, (64, 4096, 256), 1, bf16),
        bwd_case(device, (64, 4096, 256), 1, bf16),
        # Language-model vocabularies: odd (GPT-2's 50257, rows not 16-byte aligned), padded
        # (50304) and Llama-3's 128256; the shifted logits t[:, :-1, :] as a strided view.
        *[c(device, shape, -1, dt, log=True, variants=SHIFTED) for shape, dt in
          (((8192, 50257), bf16), ((8184, 50257), f32), ((8192, 50304), f32), ((8192, 128256), bf16))
          for c in (fwd_case, bwd_case)],
        fwd_case(device, (8, 1024, 50257), -1, bf16, log=True, view="drop_last"),
    ]


def tour_cases(device):
    if device.type == "cuda":
        return [fwd_case(device, (32768, 4096), -1, torch.bfloat16),
                bwd_case(device, (32768, 4096), -1, torch.bfloat16)]
    return [cpu_case(device, (2048, 1024), False, d) for d in ("fwd", "fwd+bwd")]


def tour_check(device):
    """Max abs error of ours vs a float64 reference, forward and gradient, on fresh inputs."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    errs = {}
    for shape, dim in (((37, 1000), -1), ((3, 777, 5), 1), ((4, 70000), -1)):
        for log in (False, True):
            x = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
            g = torch.randn_like(x)
            f, ref = (gp.log_softmax, torch.log_softmax) if log else (gp.softmax, torch.softmax)
            y = f(x, dim)
            (dx,) = torch.autograd.grad(y, (x,), g)
            x64 = x.detach().double().requires_grad_()
            y64 = ref(x64, dim)
            (dx64,) = torch.autograd.grad(y64, (x64,), g.double())
            key = f"{'log_softmax' if log else 'softmax'} {tuple(shape)} dim={dim}"
            errs[f"fwd {key}"] = (y.double() - y64).abs().max().item()
            errs[f"bwd {key}"] = (dx.double() - dx64).abs().max().item() / max(1.0, dx64.abs().max().item())
    return errs
