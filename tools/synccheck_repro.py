"""Smallest runs of the softmax launches that synccheck once flagged (benchmarks/results/sanitizer_h100.txt),
for a bisection.

    compute-sanitizer --tool synccheck --kernel-name kns=gpu_puzzles \
        python tools/synccheck_repro.py cols-st1      # flagged on the H200 (48cf4f6)
    ... cols-st2 / rows-smem8 / rows-smem16 / rows-new  # the persistent twins ran clean

REPRO_ONLY=fwd or bwd runs one direction (bwd takes y from torch.softmax).
Each case runs one forward and one backward of one shape with the softmax kernel knobs
(gpu_puzzles.tuning.override) set, and checks the result against float64 (a barrier that
misbehaves would show as a wrong value too).
"""
import os
import sys

import torch

import gpu_puzzles
from gpu_puzzles.tuning import override

# Knob names and values: gpu_puzzles.tuning.knobs() (the table in csrc/common/kernel_choice.cpp).
COLS = dict(softmax_cols="staged", softmax_col_rows_fwd=8, softmax_col_rows_bwd=8)
CASES = {
    # column tiles, bf16 (16, 4096, 256) dim=1: one tile at a time (non-persistent) vs persistent
    "cols-st1": ((16, 4096, 256), 1, torch.bfloat16, dict(COLS, softmax_stages=1)),
    "cols-st1-g1": ((16, 4096, 256), 1, torch.bfloat16, dict(COLS, softmax_stages=1, softmax_grid=1)),
    "cols-st2": ((16, 4096, 256), 1, torch.bfloat16, dict(COLS, softmax_stages=2)),
    # long rows, fp32: shared-memory slices (non-persistent) vs the persistent staged kernel
    "rows-smem8": ((64, 131072), -1, torch.float32, dict(softmax_rows="smem", softmax_cluster=8)),
    "rows-smem16": ((64, 131072), -1, torch.float32, dict(softmax_rows="smem", softmax_cluster=16)),
    "rows-smem16-g1": ((64, 131072), -1, torch.float32,
                       dict(softmax_rows="smem", softmax_cluster=16, softmax_grid=1)),
    "rows-new": ((64, 131072), -1, torch.float32, dict(softmax_rows="staged", softmax_cluster=8, softmax_stages=3)),
    # the defaults on the benchmark's dim=1 shape
    "cols-default": ((64, 4096, 256), 1, torch.bfloat16, {}),
}


def main() -> int:
    bad = 0
    for name in sys.argv[1:] or list(CASES):
        shape, dim, dtype, knobs = CASES[name]
        only = os.environ.get("REPRO_ONLY", "")
        x = torch.randn(shape, device="cuda", dtype=dtype)
        r = torch.softmax(x.double(), dim)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        ok = True
        with override(**knobs):
            if only == "bwd":
                y = r.to(dtype)
            else:
                y = gpu_puzzles.softmax(x, dim)
                ok = (y.double() - r).abs().max().item() <= tol
            if only != "fwd":
                g = torch.randn_like(y)
                dx = torch.ops.gpu_puzzles.softmax_backward(g, y, dim)
                rdx = y.double() * (g.double() - (g.double() * y.double()).sum(dim, keepdim=True))
                ok = ok and (dx.double() - rdx).abs().max().item() <= tol
        print(f"{name}: {'ok' if ok else 'WRONG'}", flush=True)
        bad += not ok
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
