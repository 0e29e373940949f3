"""cross_entropy cases: the benchmark shapes and the tour's small checks.

Byte counts: the forward reads the logits once (the per-row lse it writes is negligible);
forward+backward also reads them again and writes their gradient (3 x the logits).
The fused linear cross-entropy is counted in GEMM FLOPs: 2 N H V forward, 3x that with
the gradients; its peak memory (``peak_memory(device)``) is the point of it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import gpu_puzzles as gp

from .common import Case, backward_fn, peak_memory_rows

OP = "cross_entropy"

# (rows, V): GPT-2 (8 x 1024 tokens, vocabulary 50257: rows at every 16-byte offset), Llama-3.
CE_SHAPES = [(8192, 50257), (8192, 128256)]
# (rows, H, V): GPT-2's and a Llama-style model's LM head.
FUSED_SHAPES = [(8192, 768, 50257), (8192, 2048, 128256)]
# Gemma-2-2B's head, whose final logits are soft-capped at 30 (softcap=30.0).
SOFTCAP_SHAPES = [(8192, 2304, 256000)]
SOFTCAP = 30.0


def _targets(n, V, device, frac=0.05):
    t = torch.randint(0, V, (n,), device=device)
    t[torch.rand(n, device=device) < frac] = -100  # some padding, as a real batch has
    return t


def _eager_ce(x, t):
    return F.cross_entropy(x.reshape(-1, x.shape[-1]), t.reshape(-1))


def _hf_ce(x, t):
    """What transformers does: upcast the logits to float32 first."""
    return F.cross_entropy(x.reshape(-1, x.shape[-1]).float(), t.reshape(-1))


def ce_case(device, rows, V, dtype, backward, view=False):
    def make():
        if view:  # logits[:, :-1] of (8, S + 1, V): strided rows, read in place
            x = torch.randn(8, rows // 8 + 1, V, device=device, dtype=dtype)[:, :-1]
            t = _targets(rows, V, device).view(8, rows // 8)
        else:
            x = torch.randn(rows, V, device=device, dtype=dtype)
            t = _targets(rows, V, device)
        if backward:
            return x.requires_grad_(), t, torch.tensor(1.0, device=device, dtype=dtype)
        return x, t
    # The view case hands ours F's layout (8, V, S), a transposed view of the same rows.
    ours = (lambda x, t: gp.cross_entropy(x.transpose(1, 2), t)) if view else gp.cross_entropy
    impls = {"ours": ours, "eager": _eager_ce, "eager-fp32": _hf_ce,
             "compile": torch.compile(_eager_ce, dynamic=False)}
    if backward:
        impls = {k: backward_fn(f, 2) for k, f in impls.items()}
    n = rows * V * torch.tensor([], dtype=dtype).element_size()
    name = f"({rows}, {V})" + (" of t[:, :-1]" if view else "")
    return Case(OP, name, "fwd+bwd" if backward else "fwd", make, impls, bytes=(3 if backward else 1) * n,
                params=dict(rows=rows, V=V, dtype=str(dtype).replace("torch.", ""), view=view))


def _linear_ce(h, w, t):
    return F.cross_entropy(F.linear(h, w), t)


def _linear_ce_fp32(h, w, t):
    return F.cross_entropy(F.linear(h, w).float(), t)


def fused_impls(backward, softcap=None):
    if softcap is None:
        impls = {"ours": gp.fused_linear_cross_entropy, "eager": _linear_ce, "eager-fp32": _linear_ce_fp32,
                 "compile": torch.compile(_linear_ce, dynamic=False)}
    else:
        def capped_ce(h, w, t):  # as Gemma 2's forward caps its logits
            return F.cross_entropy(torch.tanh(F.linear(h, w) / softcap) * softcap, t)

        def capped_ce_fp32(h, w, t):
            return F.cross_entropy(torch.tanh(F.linear(h, w).float() / softcap) * softcap, t)

        impls = {"ours": lambda h, w, t: gp.fused_linear_cross_entropy(h, w, t, softcap=softcap),
                 "eager": capped_ce, "eager-fp32": capped_ce_fp32,
                 "compile": torch.compile(capped_ce, dynamic=False)}
    return {k: backward_fn(f, 3) for k, f in impls.items()} if backward else impls


def _fused_name(N, H, V, softcap=None):
    return f"linear+ce ({N}, {H}) -> {V}" + (f", softcap {softcap:g}" if softcap is not None else "")


def _fused_inputs(device, N, H, V, dtype, backward):
    h = (torch.randn(N, H, device=device) * H ** -0.5).to(dtype)
    w = (torch.randn(V, H, device=device) * 0.02).to(dtype)
    t = _targets(N, V, device)
    if backward:
        return h.requires_grad_(), w.requires_grad_(), t, torch.tensor(1.0, device=device, dtype=dtype)
    return h, w, t


def fused_case(device, N, H, V, dtype, backward, softcap=None):
    flops = 2 * N * H * V * (3 if backward else 1)
    params = dict(rows=N, H=H, V=V, dtype=str(dtype).replace("torch.", ""), fused=True)
    if softcap is not None:
        params["softcap"] = softcap
    return Case(OP, _fused_name(N, H, V, softcap), "fwd+bwd" if backward else "fwd",
                lambda: _fused_inputs(device, N, H, V, dtype, backward), fused_impls(backward, softcap), flops=flops,
                params=params)


def bench_cases(device):
    if device.type == "cpu":
        f32 = torch.float32
        return [ce_case(device, 512, 50257, f32, b) for b in (False, True)] + \
               [fused_case(device, 512, 256, 8192, f32, b) for b in (False, True)]
    bf16 = torch.bfloat16
    cases = [ce_case(device, r, V, bf16, b) for r, V in CE_SHAPES for b in (False, True)]
    cases += [ce_case(device, 8192, 50257, bf16, b, view=True) for b in (False, True)]
    cases += [fused_case(device, N, H, V, bf16, b) for N, H, V in FUSED_SHAPES for b in (False, True)]
    cases += [fused_case(device, N, H, V, bf16, True, SOFTCAP) for N, H, V in SOFTCAP_SHAPES]
    return cases


def peak_memory(device, shapes=FUSED_SHAPES, dtype=torch.bfloat16):
    """Peak memory above the live inputs (MiB) of one forward+backward of the LM head's loss, per
    implementation (the soft-capped head too)."""
    if device.type != "cuda":
        return []
    rows = []
    for (N, H, V), cap in [(s, None) for s in shapes] + [(s, SOFTCAP) for s in SOFTCAP_SHAPES]:
        rows += peak_memory_rows(fused_impls(True, cap),
                                 lambda N=N, H=H, V=V: _fused_inputs(device, N, H, V, dtype, True),
                                 device, op=OP, case=_fused_name(N, H, V, cap), direction="fwd+bwd",
                                 logits_MiB=N * V * 2 / 2**20, dtype=str(dtype).replace("torch.", ""))
    return rows


def tour_cases(device):
    if device.type == "cuda":
        return [ce_case(device, 8192, 50257, torch.bfloat16, b) for b in (False, True)]
    return [ce_case(device, 256, 50257, torch.float32, b) for b in (False, True)]


def tour_check(device):
    """Max error of ours vs a float64 reference (loss and gradient), fresh inputs."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    errs = {}
    for rows, V in ((37, 1000), (16, 50257)):
        x = torch.randn(rows, V, device=device, dtype=dtype, requires_grad=True)
        t = _targets(rows, V, device, frac=0.2)
        loss = gp.cross_entropy(x, t)
        (g,) = torch.autograd.grad(loss, x)
        x64 = x.detach().double().requires_grad_()
        ref = F.cross_entropy(x64, t)
        (g64,) = torch.autograd.grad(ref, x64)
        n = max(1, int((t != -100).sum()))
        errs[f"fwd ({rows}, {V})"] = abs(loss.double().item() - ref.item())
        errs[f"bwd ({rows}, {V})"] = (g.double() - g64).abs().max().item() * n
    h = torch.randn(40, 32, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(300, 32, device=device, dtype=dtype, requires_grad=True)
    t = _targets(40, 300, device, frac=0.2)
    loss = gp.fused_linear_cross_entropy(h, w, t)
    gh, gw = torch.autograd.grad(loss, (h, w))
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = F.cross_entropy(F.linear(h64, w64), t)
    rh, rw = torch.autograd.grad(ref, (h64, w64))
    errs["fwd linear+ce (40, 32) -> 300"] = abs(loss.double().item() - ref.item())
    errs["bwd linear+ce (40, 32) -> 300"] = max((a.double() - r).abs().max().item() / max(1e-12, r.abs().max().item())
                                                for a, r in ((gh, rh), (gw, rw)))
    return errs
