"""Run two softmax cases a few times each, for a profiler (CUDA only).

    ncu --kernel-name regex:staged_rows --launch-skip 1 --launch-count 1 \
        python benchmarks/softmax_profile.py rows softmax_rows=staged softmax_stages=3

Cases: rows = fp32 (4096, 131072) dim=-1 forward; cols = bf16 (64, 4096, 256) dim=1
forward and backward. Arguments name=value are knobs (gpu_puzzles.tuning.knobs()) set for
the run: the kernel variant to profile; without them, the defaults.
"""
import sys

import torch

import gpu_puzzles as gp

args = sys.argv[1:]
knobs = dict(a.split("=", 1) for a in args if "=" in a)
which = [a for a in args if "=" not in a] or ["rows", "cols"]
g = torch.Generator(device="cuda").manual_seed(0)
with gp.tuning.override(**knobs):
    if "rows" in which:
        x = torch.randn(4096, 131072, device="cuda", generator=g)
        for _ in range(3):
            gp.softmax(x, -1)
    if "cols" in which:
        x = torch.randn(64, 4096, 256, device="cuda", dtype=torch.bfloat16, generator=g)
        y = gp.softmax(x, 1)
        dy = torch.randn_like(y)
        for _ in range(3):
            gp.softmax(x, 1)
            torch.ops.gpu_puzzles.softmax_backward(dy, y, 1)
    torch.cuda.synchronize()
