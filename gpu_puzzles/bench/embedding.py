"""embedding cases: the benchmark shapes and the tour's small checks."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

import gpu_puzzles as gp

from .common import Case, backward_fn, backward_only_fn

OP = "embedding"


def reference(indices, weight, padding_idx=None):
    """The op's semantics in stock PyTorch: F.embedding on valid indices, zero rows elsewhere."""
    V = weight.shape[0]
    valid = (indices >= 0) & (indices < V)
    out = F.embedding(torch.where(valid, indices, torch.zeros_like(indices)), weight, padding_idx)
    return out * valid.unsqueeze(-1).to(out.dtype)


def reference_grad(grad_out, indices, V, padding_idx=None):
    """Dense weight gradient in float64: index_add over valid, non-padding tokens."""
    E = grad_out.shape[-1]
    i = indices.reshape(-1).long()
    g = grad_out.reshape(-1, E).double()
    keep = (i >= 0) & (i < V)
    if padding_idx is not None:
        keep &= i != padding_idx % V
    return torch.zeros(V, E, dtype=torch.float64, device=g.device).index_add_(0, i[keep], g[keep])


def _inputs(T, V, E, dtype, device, grad=False, idx_dtype=torch.int64):
    idx = torch.randint(0, V, (T,), device=device, dtype=idx_dtype)
    w = torch.randn(V, E, device=device, dtype=dtype, requires_grad=grad)
    return idx, w


def _esize(dtype):
    return torch.tensor([], dtype=dtype).element_size()


def cases(device, shapes, dtype=torch.bfloat16, directions=("fwd", "bwd"), compile_=True, idx_dtype=torch.int64,
          graph_timing=False):
    out = []
    for (T, V, E) in shapes:
        es, isz = _esize(dtype), _esize(idx_dtype)
        impls_f = {"ours": gp.embedding, "2d": functools.partial(gp.embedding, algorithm="2d"),
                   "eager": F.embedding}
        if compile_:
            impls_f["compile"] = torch.compile(F.embedding, dynamic=False)
        params = dict(T=T, V=V, E=E, dtype=str(dtype).replace("torch.", ""),
                      idx_dtype=str(idx_dtype).replace("torch.", ""), graph_timing=graph_timing)
        name = f"T={T} V={V} E={E}"
        if "fwd" in directions:
            out.append(Case(OP, name, "fwd", lambda T=T, V=V, E=E: _inputs(T, V, E, dtype, device, idx_dtype=idx_dtype),
                            impls_f, bytes=2 * T * E * es + T * isz, params=params))
        if "fwd+bwd" in directions:
            def make(T=T, V=V, E=E):
                idx, w = _inputs(T, V, E, dtype, device, grad=True, idx_dtype=idx_dtype)
                return idx, w, torch.randn(T, E, device=device, dtype=dtype)
            impls_fb = {k: backward_fn(f, 2) for k, f in impls_f.items()}
            out.append(Case(OP, name, "fwd+bwd", make, impls_fb, bytes=(3 * T * E + V * E) * es + T * isz,
                            params=params))
        if "bwd" in directions:
            # The backward alone. Traffic: read grad_out (T*E) and the indices, write the
            # dense (V, E) grad.
            def make(T=T, V=V, E=E):
                idx, w = _inputs(T, V, E, dtype, device, grad=True, idx_dtype=idx_dtype)
                return idx, w, torch.randn(T, E, device=device, dtype=dtype)
            impls_b = {k: backward_only_fn(f, 2) for k, f in impls_f.items()}
            out.append(Case(OP, name, "bwd", make, impls_b, bytes=(T * E + V * E) * es + T * isz, params=params))
    return out


# The CPU shapes: the seed's size, and a GPT-2 vocabulary with a (2, 256) batch of tokens.
CPU_SHAPES = [(4096, 10000, 512), (2 * 256, 50257, 768)]


def bench_cases(device):
    if device.type == "cpu":
        return cases(device, CPU_SHAPES, dtype=torch.float32, directions=("fwd", "fwd+bwd"), compile_=False)
    # A Llama-3 vocabulary in bf16 and the seed's size in fp32 with
    # int32 indices (B=8, L=512 -> T=4096 tokens).
    return (cases(device, [(16384, 128256, 4096)]) +
            # At this size per-call timing also measures the host's dispatch: the seed case is
            # timed both per call and replayed from a CUDA graph (device time alone).
            cases(device, [(8 * 512, 10000, 512)], dtype=torch.float32, idx_dtype=torch.int32, graph_timing=True))


def tour_cases(device):
    if device.type == "cuda":
        return cases(device, [(16384, 128256, 4096)], directions=("fwd",))
    return cases(device, [(4096, 10000, 512)], dtype=torch.float32, directions=("fwd", "fwd+bwd"), compile_=False)


def tour_check(device):
    """Max abs error of ours vs a float64 reference, forward and weight gradient, on fresh inputs."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    errs = {}
    T, V, E = 3000, 500, 96
    for name in ("coalesced", "2d"):
        fn = functools.partial(gp.embedding, algorithm=name)
        idx = torch.randint(-3, V + 3, (T,), device=device)  # a few out of range
        w = torch.randn(V, E, device=device, dtype=dtype, requires_grad=True)
        g = torch.randn(T, E, device=device, dtype=dtype)
        y = fn(idx, w, 7)
        (gw,) = torch.autograd.grad(y, (w,), g)
        y64 = reference(idx, w.detach().double(), 7)
        gw64 = reference_grad(g, idx, V, 7)
        errs[f"fwd {name}"] = (y.double() - y64).abs().max().item()
        errs[f"bwd {name}"] = (gw.double() - gw64).abs().max().item() / max(1.0, gw64.abs().max().item())
    return errs
