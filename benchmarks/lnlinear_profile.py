"""Where the LayerNorm+Linear time goes, per kernel (CUDA only).

    python benchmarks/lnlinear_profile.py [fwd] [fwd+bwd] [knob=value ...]

knob=value pairs (e.g. layernorm_linear_pdl=plain, layernorm_linear_evt=cublas) run the
whole profile under gpu_puzzles.tuning.override, to compare a kernel choice with the default.

For two transformer shapes (M, H, N = 8192x4096x4096, 16384x1024x4096) and each
implementation (ours fused / unfused, eager, compile, F.linear alone), the bench's own cases (gpu_puzzles.bench.layernorm_linear):
the bench's time per call (time_ms) and, from torch.profiler, every kernel's mean
duration per call. The difference between the two is the time the GPU sat between
kernels of one call.
"""
import sys

import torch

import gpu_puzzles as gp
from torch.profiler import ProfilerActivity, profile

from gpu_puzzles.bench import layernorm_linear as L
from gpu_puzzles.bench.common import n_sets_for, time_ms

SHAPES = [(8192, 4096, 4096), (16384, 1024, 4096)]
REPS = 20


def kernel_table(fn, sets, reps=REPS):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(reps):
            fn(*sets[i % len(sets)])
        torch.cuda.synchronize()
    rows = {}
    for ev in prof.events():
        if ev.device_type.name != "CUDA":
            continue
        t = rows.setdefault(ev.name, [0, 0.0])
        t[0] += 1
        t[1] += ev.device_time_total
    return sorted(((n, c / reps, us / reps / 1000) for n, (c, us) in rows.items()), key=lambda r: -r[2])


def main():
    dirs = tuple(a for a in sys.argv[1:] if a in ("fwd", "fwd+bwd")) or ("fwd", "fwd+bwd")
    knobs = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
    with gp.tuning.override(**knobs):
        profile_all(dirs)


def profile_all(dirs):
    device = torch.device("cuda")
    for case in L.cases(device, SHAPES, directions=dirs):
        first = case.make()
        per_set = sum(t.numel() * t.element_size() for t in first if isinstance(t, torch.Tensor))
        sets = [first] + [case.make() for _ in range(n_sets_for(per_set) - 1)]
        for name, fn in case.impls.items():
            ms = time_ms(fn, sets, device)  # warms up (and compiles) too
            table = kernel_table(fn, sets)
            ksum = sum(r[2] for r in table)
            print(f"\n## {case.direction} {case.name} | {name}: bench {ms:.4f} ms, kernel sum {ksum:.4f} ms, "
                  f"between kernels {ms - ksum:.4f} ms")
            for n, c, t in table:
                print(f"  {t:8.4f} ms  x{c:4.1f}  {n[:110]}")


if __name__ == "__main__":
    main()
