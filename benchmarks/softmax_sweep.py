"""Sweep the softmax kernel variants on the issue's two missed cases (CUDA only).

    python benchmarks/softmax_sweep.py                 # every variant, ours only
    python benchmarks/softmax_sweep.py --baselines     # plus eager and torch.compile, once
    python benchmarks/softmax_sweep.py --only rows     # just the long-row variants

Each variant runs in its own subprocess with its GPU_PUZZLES_SOFTMAX_* environment
(the extension reads it once per process). A child times each case with the
bench harness (gpu_puzzles.bench.common.time_ms over rotating input sets, bytes:
forward x + y, backward y + dy + dx), then checks the variant against a float64
reference on the case's shape and on odd shapes around its dispatch edges, so a
broken variant shows up as FAIL next to its speed.

Built-in defaults (used when a variable is unset): ROWS_VARIANT=smem, CLUSTER=8, STAGES=1,
COL_VARIANT=new, COL_ROWS_FWD=16, COL_ROWS_BWD=8, GRID=1 (all prefixed GPU_PUZZLES_SOFTMAX_).
ROWS_VARIANT=smem|bulk: the row slices in shared memory (CLUSTER = 4|8|16 blocks for a 512 KB
row); new: the persistent staged register kernel (at least 2 stages). STAGES=1: column tiles
one at a time; GRID=1|4: clusters launched per resident cluster for the one-stage kernels
(4 is opt-in: synccheck flags it, results/sanitizer_h100.txt). Per call, tests use algorithm
"auto:rows=smem,cluster=16,...".
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(rows=None, cluster=None, stages=None, cols=None, fwd=None, bwd=None):
    keys = {"ROWS_VARIANT": rows, "CLUSTER": cluster, "STAGES": stages, "COL_VARIANT": cols,
            "COL_ROWS_FWD": fwd, "COL_ROWS_BWD": bwd}
    return {f"GPU_PUZZLES_SOFTMAX_{k}": str(v) for k, v in keys.items() if v is not None}


# name -> environment: rows from the previous default on, cols from the current one. Earlier rounds
# (results/softmax_sweep_h100.txt) dropped rows=old, the 2-stage rows and cluster 16 (slower).
VARIANTS = {
    "rows": {
        "rows=new cs8 st3": _env("new", 8, 3),  # the default before 8227b70
        **{f"rows={kind} cluster={cs}": _env(kind, cs) for kind in ("smem", "bulk") for cs in (8, 16, 4)},
    },
    "cols": {
        "cols=default": {},
        "cols=new fwd8 bwd8 st2": _env(cols="new", fwd=8, bwd=8, stages=2),
        **{f"cols=new fwd{r} bwd{r} st1": _env(cols="new", fwd=r, bwd=r, stages=1) for r in (4, 8, 16)},
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


def child(group: str, baselines: bool) -> None:
    import functools

    import torch

    import gpu_puzzles  # noqa: F401  (loads the ops)
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
    print("RESULT " + json.dumps(out))


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
    ap.add_argument("--child", nargs=2, metavar=("GROUP", "BASELINES"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.child[1] == "1")
        return
    failed = False
    for group, variants in VARIANTS.items():
        if args.only and group != args.only:
            continue
        print(f"\n== {group} ==")
        for i, (name, env) in enumerate(variants.items()):
            e = {k: v for k, v in os.environ.items() if not k.startswith("GPU_PUZZLES_SOFTMAX_")}
            e.update(env)
            e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
            base = "1" if (args.baselines and i == 0) else "0"
            r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", group, base], env=e,
                               capture_output=True, text=True, timeout=900)
            line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
            if r.returncode != 0 or not line:
                print(f"{name:28s} CRASH rc={r.returncode}\n{r.stderr[-3000:]}")
                failed = True
                continue
            res = json.loads(line[0][7:])
            bad = [k for k, v in res["checks"].items() if not v <= 1.0]
            for label, c in res["cases"].items():
                extra = "".join(f"  {k} {v:.2f}" for k, v in c.items() if k not in ("ours", "err"))
                ok = "ok" if c["err"] <= 1.0 else f"FAIL err {c['err']:.2f}x tol"
                print(f"{name:28s} {label:28s} ours {c['ours']:.3f} TB/s{extra}  [{ok}]")
            print(f"{name:28s} edge checks: " + ("ok" if not bad else "FAIL " + ", ".join(bad)))
            failed |= bool(bad) or any(not c["err"] <= 1.0 for c in res["cases"].values())
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
