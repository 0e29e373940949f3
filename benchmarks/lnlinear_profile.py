"""Where the LayerNorm+Linear time goes, per kernel (CUDA only).

    python benchmarks/lnlinear_profile.py [fwd] [fwd+bwd] [MxHxN[t] ...] [knob=value ...]

knob=value pairs (e.g. layernorm_linear_pdl=plain, layernorm_linear_evt=cublas) run the
whole profile under gpu_puzzles.tuning.override, to compare a kernel choice with the default.

MxHxN arguments (e.g. 512x1024x1024t, the t for W as a transposed view) replace the default
shapes. For each shape (default: 8192x4096x4096, 16384x1024x4096) and each
implementation (ours fused / unfused, eager, F.linear alone), the bench's own cases (gpu_puzzles.bench.layernorm_linear):
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


def parse_shape(a):
    """'512x1024x1024t' -> ((512, 1024, 1024), True)."""
    t = a.endswith("t")
    return tuple(int(v) for v in a.rstrip("t").split("x")), t


def main():
    args = sys.argv[1:]
    dirs = tuple(a for a in args if a in ("fwd", "fwd+bwd")) or ("fwd", "fwd+bwd")
    knobs = dict(a.split("=", 1) for a in args if "=" in a)
    shapes = [parse_shape(a) for a in args if a[:1].isdigit() and "=" not in a] or [(s, False) for s in SHAPES]
    with gp.tuning.override(**knobs):
        profile_all(dirs, shapes)


def profile_all(dirs, shapes):
    device = torch.device("cuda")
    cases = [c for shape, w_t in shapes for c in L.cases(device, [shape], directions=dirs, w_t=w_t, compile_=False)]
    for case in cases:
        first = case.make()
        per_set = sum(t.numel() * t.element_size() for t in first if isinstance(t, torch.Tensor))
        sets = [first] + [case.make() for _ in range(n_sets_for(per_set) - 1)]
        for name, fn in case.impls.items():
            ms = time_ms(fn, sets, device)  # warms up too
            table = kernel_table(fn, sets)
            ksum = sum(r[2] for r in table)
            print(f"\n## {case.direction} {case.name} | {name}: bench {ms:.4f} ms, kernel sum {ksum:.4f} ms, "
                  f"between kernels {ms - ksum:.4f} ms")
            for n, c, t in table:
                print(f"  {t:8.4f} ms  x{c:4.1f}  {n[:110]}")


if __name__ == "__main__":
    main()
