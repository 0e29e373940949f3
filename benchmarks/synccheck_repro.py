"""Smallest runs of the softmax launches that synccheck flagged (session 4), for a bisection.

    compute-sanitizer --tool synccheck --kernel-name kns=gpu_puzzles \
        python benchmarks/synccheck_repro.py cols-st1      # flagged on the H200 (48cf4f6)
    ... cols-st2 / rows-smem8 / rows-smem16 / rows-new  # the persistent twins ran clean

REPRO_ONLY=fwd or bwd runs one direction (bwd takes y from torch.softmax).
Each case runs one forward and one backward of one shape under its knobs (tuning.override) and
checks the result against float64 (a barrier that misbehaves would show as a wrong value too).
"""
import os
import sys

import torch

import gpu_puzzles


def _knobs(**kw):
    return {f"softmax_{k}": str(v) for k, v in kw.items()}


COLS8 = dict(cols="new", col_rows_fwd=8, col_rows_bwd=8)
CASES = {
    # column tiles, bf16 (16, 4096, 256) dim=1: one tile at a time (non-persistent) vs persistent
    "cols-st1": ((16, 4096, 256), 1, torch.bfloat16, _knobs(**COLS8, stages=1)),
    "cols-st1-g1": ((16, 4096, 256), 1, torch.bfloat16, _knobs(**COLS8, stages=1, grid=1)),
    "cols-st2": ((16, 4096, 256), 1, torch.bfloat16, _knobs(**COLS8, stages=2)),
    # long rows, fp32: shared-memory slices (non-persistent) vs the persistent staged kernel
    "rows-smem8": ((64, 131072), -1, torch.float32, _knobs(rows="smem", cluster=8)),
    "rows-smem16": ((64, 131072), -1, torch.float32, _knobs(rows="smem", cluster=16)),
    "rows-smem16-g1": ((64, 131072), -1, torch.float32, _knobs(rows="smem", cluster=16, grid=1)),
    "rows-new": ((64, 131072), -1, torch.float32, _knobs(rows="new", cluster=8, stages=3)),
    # the defaults on the benchmark's dim=1 shape
    "cols-default": ((64, 4096, 256), 1, torch.bfloat16, {}),
}


def run(shape, dim, dtype) -> bool:
    only = os.environ.get("REPRO_ONLY", "")
    x = torch.randn(shape, device="cuda", dtype=dtype)
    r = torch.softmax(x.double(), dim)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    ok = True
    if only == "bwd":
        y = r.to(dtype)
    else:
        y = torch.ops.gpu_puzzles.softmax(x, dim, "auto")
        ok = (y.double() - r).abs().max().item() <= tol
    if only != "fwd":
        g = torch.randn_like(y)
        dx = torch.ops.gpu_puzzles.softmax_backward(g, y, dim, "auto")
        rdx = y.double() * (g.double() - (g.double() * y.double()).sum(dim, keepdim=True))
        ok = ok and (dx.double() - rdx).abs().max().item() <= tol
    return ok


def main() -> int:
    bad = 0
    for name in sys.argv[1:] or list(CASES):
        shape, dim, dtype, knobs = CASES[name]
        with gpu_puzzles.tuning.override(**knobs):
            ok = run(shape, dim, dtype)
        print(f"{name}: {'ok' if ok else 'WRONG'}", flush=True)
        bad += not ok
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
