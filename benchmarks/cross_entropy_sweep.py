"""Sweep the fused linear cross-entropy's rows per chunk (CUDA only).

    python benchmarks/cross_entropy_sweep.py [--json out.json] [--rep 20]

Each chunk size runs in this process under gpu_puzzles.tuning.override(cross_entropy_chunk=...),
forward+backward of the LM head and its loss on the bench's shapes (GPT-2's, a Llama-3-style
head, Gemma-2-2B's soft-capped one), beside torch.compile of the unfused math in the same run.
Per variant: milliseconds (the bench harness's median), effective TFLOP/s (6 N H V), the
peak memory above the inputs, and the loss and gradient errors against a float64 reference
on a slice of rows (so a chunking bug shows next to its speed). The question it answers: the
weight gradient is accumulated in float32 once per chunk, V x H x 8 bytes of traffic each
time; at 1024-row chunks of a 128256 x 2048 head that is about as much traffic as the GEMMs'.
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

import gpu_puzzles as gp
from gpu_puzzles.bench import cross_entropy as ce
from gpu_puzzles.bench.common import (
    Case,
    backward_fn,
    copy_bandwidth,
    device_name,
    git_commit,
    peak_extra_mib,
    run_case,
)
from gpu_puzzles.tuning import override

CHUNKS = ("auto", "1024", "2048", "4096", "8192")
SHAPES = [(N, H, V, None) for N, H, V in ce.FUSED_SHAPES] + [(N, H, V, ce.SOFTCAP) for N, H, V in ce.SOFTCAP_SHAPES]


def _ours(chunk, softcap):
    def fn(h, w, t):
        with override(cross_entropy_chunk=None if chunk == "auto" else chunk):
            return gp.fused_linear_cross_entropy(h, w, t, softcap=softcap)
    return fn


def _check(device, H, V, softcap, chunk):
    """Max relative error of loss, dh, dw against float64 on 3000 rows (several chunks at 1024)."""
    h, w, t = ce._fused_inputs(device, 3000, H, V, torch.bfloat16, False)
    h.requires_grad_()
    w.requires_grad_()
    loss = _ours(chunk, softcap)(h, w, t)
    gh, gw = torch.autograd.grad(loss, (h, w))
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    logits = F.linear(h64, w64)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    ref = F.cross_entropy(logits, t)
    rh, rw = torch.autograd.grad(ref, (h64, w64))
    return max([abs(loss.double().item() - ref.item()) / abs(ref.item())] +
               [(a.double() - r).abs().max().item() / r.abs().max().item() for a, r in ((gh, rh), (gw, rw))])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--rep", type=int, default=20)
    args = ap.parse_args()
    device = torch.device("cuda")
    copy = copy_bandwidth(device)
    rows = []
    for N, H, V, cap in SHAPES:
        impls = {f"ours chunk={c}": _ours(c, cap) for c in CHUNKS}
        impls["compile"] = ce.fused_impls(False, cap)["compile"]
        case = Case(ce.OP, ce._fused_name(N, H, V, cap), "fwd+bwd",
                    lambda N=N, H=H, V=V: ce._fused_inputs(device, N, H, V, torch.bfloat16, True),
                    {k: backward_fn(f, 3) for k, f in impls.items()}, flops=6 * N * H * V,
                    params=dict(rows=N, H=H, V=V, softcap=cap))
        got = run_case(case, device, copy, rep=args.rep, rounds=2, pooled=True)
        for r in got:
            label = r["impl"]
            fn = case.impls[label]
            a = case.make()
            try:
                r["peak_extra_MiB"] = peak_extra_mib(fn, a, device)
            finally:
                del a
            if label.startswith("ours"):
                r["max_rel_err"] = _check(device, H, V, cap, label.split("=")[1])
            print(f"{r['case']:48s} {label:18s} {r.get('ms') or float('nan'):8.3f} ms "
                  f"{r.get('TFLOP/s') or float('nan'):6.0f} TFLOP/s {r['peak_extra_MiB']:8.0f} MiB "
                  f"err {r.get('max_rel_err', float('nan')):.2e}", flush=True)
        rows += got
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"commit": git_commit(), "device": device_name(device), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
