"""``python -m gpu_puzzles``: a correctness and speed tour of every op.

For each op: the max error against a float64 PyTorch reference on fresh random
inputs, then ours vs PyTorch eager vs torch.compile. Runs on CUDA when present,
else on the CPU (that is what CI runs) at fp32 sizes of a few milliseconds, where a
time says more than the call's overhead, against eager only.
"""
import argparse
import sys

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from .bench import OPS, op_module
from .bench.__main__ import derive_backward
from .bench.common import CPU_TIMING, copy_bandwidth, device_name, run_case


def speed_rows(rows, skip=("fwd+bwd",)):
    """One table row per (op, case, direction) but those in ``skip``: ours against eager and compile.
    "ours" is the op's main implementation: the impl named "ours", else "ours fused" (the
    LayerNorm+Linear benchmarks name both of theirs, fused and unfused); the case then says fused."""
    keyed = {}
    for r in rows:
        keyed.setdefault((r["op"], r["case"], r["direction"]), {})[r["impl"]] = r
    out = []
    for (op, case, d), impls in keyed.items():
        if d in skip:
            continue
        main_impl = "ours" if "ours" in impls else "ours fused" if "ours fused" in impls else None
        if main_impl == "ours fused":
            case = f"{case} fused"
        ms = {k: v.get("ms") for k, v in impls.items()}
        ours = ms.get(main_impl)
        f = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
        ratio = lambda a, b: "-" if not (a and b) else f"{b / a:.2f}x"  # noqa: E731
        gbs = impls.get(main_impl, {}).get("GB/s")
        out.append((op, case, d, f(ours), f(ms.get("eager")), f(ms.get("compile")),
                    ratio(ours, ms.get("eager")), ratio(ours, ms.get("compile")), "-" if gbs is None else f"{gbs:.0f}"))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m gpu_puzzles", description=__doc__)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--ops", nargs="*", default=OPS)
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    console = Console(width=150)
    console.print(f"[bold]gpu_puzzles tour[/bold] on {device_name(device)}")
    copy_gbs = copy_bandwidth(device)
    errors, rows = [], []
    rep = 20 if device.type == "cuda" else 12
    with Progress(console=console) as prog:
        for op in args.ops:
            mod = op_module(op)
            cases = mod.tour_cases(device)
            task = prog.add_task(op, total=1 + len(cases))
            for what, err in mod.tour_check(device).items():
                errors.append((op, what, err))
            prog.advance(task)
            for case in cases:
                skip = ("compile",) if args.no_compile else ()
                new = run_case(case, device, copy_gbs, rep=rep, warmup=2, skip=skip)
                for r in new:
                    r["copy_GBps"] = copy_gbs
                    r.update({k: case.params[k] for k in ("bwd_bytes", "bwd_flops") if k in case.params})
                rows += new
                prog.advance(task)
            torch._dynamo.reset()
    # On the CPU the fwd+bwd rows themselves: a difference of two fastest calls is no backward time.
    on_cpu = device.type == "cpu"
    if not on_cpu:
        rows += derive_backward(rows)

    t = Table(title="max error vs float64 reference (relative to the reference's scale)")
    for c in ("op", "check", "max error"):
        t.add_column(c)
    for op, what, err in errors:
        t.add_row(op, what, f"{err:.2e}")
    console.print(t)

    timing = "median" if device.type == "cuda" else CPU_TIMING
    t = Table(title=f"time in ms ({timing}), copy bandwidth {copy_gbs:.0f} GB/s")
    for c in ("op", "case", "dir", "ours", "eager", "compile", "ours vs eager", "ours vs compile", "ours GB/s"):
        t.add_column(c)
    for row in speed_rows(rows, skip=("bwd",) if on_cpu else ("fwd+bwd",)):
        t.add_row(*row)
    console.print(t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
