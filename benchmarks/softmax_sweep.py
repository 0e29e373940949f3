"""Sweep the softmax kernel variants on two bandwidth-bound cases (CUDA only).

    python benchmarks/softmax_sweep.py                 # every variant, ours only
    python benchmarks/softmax_sweep.py --baselines     # plus eager and torch.compile, once
    python benchmarks/softmax_sweep.py --only rows     # just the long-row variants

Each variant runs in this process under gpu_puzzles.tuning.override(**knobs). Each
case is timed with the bench harness (gpu_puzzles.bench.common.time_ms over rotating
input sets, bytes: forward x + y, backward y + dy + dx), then the variant is checked
against a float64 reference on the case's shape and on odd shapes around its
dispatch edges, so a broken variant shows up as FAIL next to its speed.

The knobs and their defaults (csrc/softmax: softmax_tuning()): softmax_rows=smem,
softmax_cluster=8, softmax_stages=1, softmax_cols=staged, softmax_col_rows_fwd=16,
softmax_col_rows_bwd=8, softmax_grid=1. softmax_rows=smem|bulk: the row slices in shared
memory (softmax_cluster = 4|8|16 blocks for a 512 KB row); new: the persistent staged
register kernel (at least 2 stages). softmax_stages=1: column tiles one at a time;
softmax_grid=1|4: clusters launched per resident cluster for the one-stage kernels (4 is
opt-in: synccheck flags it, results/sanitizer_h100.txt). Results:
benchmarks/results/softmax_sweep_h100.txt.
"""
from __future__ import annotations

import argparse
import os


def _knobs(rows=None, cluster=None, stages=None, cols=None, fwd=None, bwd=None):
    keys = {"rows": rows, "cluster": cluster, "stages": stages, "cols": cols, "col_rows_fwd": fwd,
            "col_rows_bwd": bwd}
    return {f"softmax_{k}": str(v) for k, v in keys.items() if v is not None}


# name -> knobs. Earlier rounds (results/softmax_sweep_h100.txt) dropped rows=cluster (then named old), the 2-stage
# rows and cluster 16 (slower).
VARIANTS = {
    "rows": {
        "rows=staged cs8 st3": _knobs("staged", 8, 3),
        **{f"rows={kind} cluster={cs}": _knobs(kind, cs) for kind in ("smem", "bulk") for cs in (8, 16, 4)},
    },
    "cols": {
        "cols=default": {},
        "cols=staged fwd8 bwd8 st2": _knobs(cols="staged", fwd=8, bwd=8, stages=2),
        **{f"cols=staged fwd{r} bwd{r} st1": _knobs(cols="staged", fwd=r, bwd=r, stages=1) for r in (4, 8, 16)},
    },
}

# (group, label, shape, dim, dtype, direction)
CASES = [
    ("rows", "fp32 (4096,131072) fwd", (4096, 131072), -1, "float32", "fwd"),
    ("cols", "bf16 (64,4096,256) d1 fwd", (64, 4096, 256), 1, "bfloat16", "fwd"),
    ("cols", "bf16 (64,4096,256) d1 bwd", (64, 4096, 256), 1, "bfloat16", "bwd"),
]
# Extra correctness shapes per group: dispatch edges of the staged kernels.
CHECKS = {
    "rows": [((3, 8193), -1), ((3, 8196), -1), ((2, 65540), -1), ((5, 131072), -1), ((2, 131076), -1),
             ((2, 262144), -1), ((2, 262148), -1), ((700, 20000), -1)],
    "cols": [((2, 513, 64), 1), ((3, 1000, 40), 1), ((1, 3001, 520), 1), ((2, 8192, 64), 1), ((2, 8193, 64), 1),
             ((300, 1500, 128), 1), ((2, 4096, 8), 1)],
}


def run_group(group: str, baselines: bool) -> dict:
    """Times and checks the cases of `group` under the knobs in force."""
    import functools

    import torch

    from gpu_puzzles.bench.common import n_sets_for, time_ms

    dev = torch.device(os.environ.get("GPU_PUZZLES_SWEEP_DEVICE", "cuda"))  # "cpu": a smoke test of the script
    out = {"cases": {}, "checks": {}}
    for g, label, shape, dim, dt, direction in CASES:
        if g != group:
            continue
        dtype = getattr(torch, dt)
        n = 1
        for s in shape:
            n *= s
        es = torch.empty((), dtype=dtype).element_size()
        nbytes = (2 if direction == "fwd" else 3) * n * es
        sets = []
        for _ in range(n_sets_for(nbytes)):
            x = torch.randn(shape, device=dev, dtype=dtype)
            sets.append((x,) if direction == "fwd" else (torch.softmax(x, dim), torch.randn_like(x)))
        impls = {}
        if direction == "fwd":
            impls["ours"] = lambda x: torch.ops.gpu_puzzles.softmax(x, dim, "auto")
            if baselines:
                impls["eager"] = lambda x: torch.softmax(x, dim)
                impls["compile"] = torch.compile(functools.partial(torch.softmax, dim=dim), dynamic=False)
        else:
            impls["ours"] = lambda y, dy: torch.ops.gpu_puzzles.softmax_backward(dy, y, dim, "auto")
            if baselines:
                impls["eager"] = lambda y, dy: torch._softmax_backward_data(dy, y, dim, y.dtype)

                def math_bwd(dy, y):
                    yf, gf = y.float(), dy.float()
                    return (yf * (gf - (gf * yf).sum(dim, keepdim=True))).to(y.dtype)
                cf = torch.compile(math_bwd, dynamic=False)
                impls["compile"] = lambda y, dy: cf(dy, y)
        res = {}
        for name, fn in impls.items():
            ms = time_ms(fn, sets, dev, warmup=5, rep=40)
            res[name] = nbytes / (ms * 1e-3) / 1e12
        # Correctness on the case itself (float64 reference, forward and backward).
        x = sets[0][0] if direction == "fwd" else torch.randn(shape, device=dev, dtype=dtype)
        res["err"] = _check(x, dim, torch)
        out["cases"][label] = res
        del sets
        torch.cuda.empty_cache()
    for shape, dim in CHECKS[group]:
        for dt in ("float32", "bfloat16", "float16"):
            x = torch.randn(shape, device=dev, dtype=getattr(torch, dt)) * 3
            out["checks"][f"{shape} {dt}"] = _check(x, dim, torch)
    return out


def _check(x, dim, torch):
    """Max error of softmax / log_softmax forward and softmax backward vs float64, relative to
    the dtype's tolerance (<= 1 passes)."""
    tol = {torch.float32: 2e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}[x.dtype]
    worst = 0.0
    x64 = x.double()
    for op, ref in ((torch.ops.gpu_puzzles.softmax, torch.softmax),
                    (torch.ops.gpu_puzzles.log_softmax, torch.log_softmax)):
        y = op(x, dim, "auto")
        r = ref(x64, dim)
        if torch.isnan(y).any():
            return float("inf")
        worst = max(worst, (y.double() - r).abs().max().item() / (tol * max(1.0, r.abs().max().item()) * 4))
    y = torch.ops.gpu_puzzles.softmax(x, dim, "auto")
    g = torch.randn_like(x)
    dx = torch.ops.gpu_puzzles.softmax_backward(g, y, dim, "auto")
    y64, g64 = y.double(), g.double()
    rdx = y64 * (g64 - (g64 * y64).sum(dim, keepdim=True))
    if torch.isnan(dx).any():
        return float("inf")
    worst = max(worst, (dx.double() - rdx).abs().max().item() / (tol * max(1.0, rdx.abs().max().item()) * 4))
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=sorted(VARIANTS), help="one group of variants")
    ap.add_argument("--baselines", action="store_true", help="also time eager and torch.compile (first variant)")
    args = ap.parse_args()
    import traceback

    import gpu_puzzles
    failed = False
    for group, variants in VARIANTS.items():
        if args.only and group != args.only:
            continue
        print(f"\n== {group} ==")
        for i, (name, knobs) in enumerate(variants.items()):
            try:
                with gpu_puzzles.tuning.override(**knobs):
                    res = run_group(group, args.baselines and i == 0)
            except Exception:  # report it and go on (after a sticky CUDA error the rest fail too)
                print(f"{name:28s} CRASH\n{traceback.format_exc()[-3000:]}")
                failed = True
                continue
            bad = [k for k, v in res["checks"].items() if not v <= 1.0]
            for label, c in res["cases"].items():
                extra = "".join(f"  {k} {v:.2f}" for k, v in c.items() if k not in ("ours", "err"))
                ok = "ok" if c["err"] <= 1.0 else f"FAIL err {c['err']:.2f}x tol"
                print(f"{name:28s} {label:28s} ours {c['ours']:.3f} TB/s{extra}  [{ok}]")
            print(f"{name:28s} edge checks: " + ("ok" if not bad else "FAIL " + ", ".join(bad)))
            failed |= bool(bad) or any(not c["err"] <= 1.0 for c in res["cases"].values())
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
