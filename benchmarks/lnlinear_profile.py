"""Where the LayerNorm+Linear time goes, per kernel (CUDA only).

    python benchmarks/lnlinear_profile.py [fwd] [fwd+bwd]

For each of the issue's shapes and each implementation (ours fused / unfused, eager,
compile, F.linear alone): CUDA-event time per call (median over back-to-back calls,
inputs rotated past L2) and, from torch.profiler, every kernel's mean duration per
call. The difference between the event time and the kernel sum is the time the GPU
sat between kernels of one call.
"""
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from gpu_puzzles.bench import layernorm_linear as L
from gpu_puzzles.bench.common import backward_fn

SHAPES = [(8192, 4096, 4096), (16384, 1024, 4096)]
REPS = 20


def event_ms(fn, sets, reps=REPS):
    times = []
    for i in range(reps):
        a = sets[i % len(sets)]
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2_000_000)  # a backlog: the events time device work only
        s.record()
        fn(*a)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


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
        t[1] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
    return sorted(((n, c / reps, us / reps / 1000) for n, (c, us) in rows.items()), key=lambda r: -r[2])


def main():
    dirs = [a for a in sys.argv[1:] if a in ("fwd", "fwd+bwd")] or ["fwd", "fwd+bwd"]
    for (M, H, N) in SHAPES:
        for d in dirs:
            fns = L.impls(True)
            if d == "fwd":
                fns["F.linear alone"] = L.linear_only
                make = lambda: L.inputs(M, H, N, torch.bfloat16, "cuda")
            else:
                fns = {k: backward_fn(f, 5) for k, f in fns.items()}
                fns["F.linear alone"] = L._linear_only_bwd
                make = lambda: (*L.inputs(M, H, N, torch.bfloat16, "cuda", grad=True),
                                torch.randn(M, N, device="cuda", dtype=torch.bfloat16))
            sets = [make() for _ in range(3)]
            for name, fn in fns.items():
                for a in sets * 2:  # warm-up (and compile)
                    fn(*a)
                torch.cuda.synchronize()
                ms = event_ms(fn, sets)
                table = kernel_table(fn, sets)
                ksum = sum(r[2] for r in table)
                print(f"\n## {d} M={M} H={H} N={N} | {name}: event {ms:.4f} ms, kernel sum {ksum:.4f} ms, "
                      f"between kernels {ms - ksum:.4f} ms")
                for n, c, t in table:
                    print(f"  {t:8.4f} ms  x{c:4.1f}  {n[:110]}")


if __name__ == "__main__":
    main()
