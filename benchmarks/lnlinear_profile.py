"""Where the LayerNorm+Linear time goes, per kernel (CUDA only).

    python benchmarks/lnlinear_profile.py [fwd] [fwd+bwd] [MxHxN[t] ...] [knob=value ...] [--json FILE]

knob=value pairs (e.g. layernorm_linear_pdl=plain, layernorm_linear_evt=cublas) run the
whole profile under gpu_puzzles.tuning.override, to compare a kernel choice with the default.

MxHxN arguments (e.g. 512x1024x1024t, the t for W as a transposed view) replace the default
shapes (8192x4096x4096, 16384x1024x4096). For each shape, the bench's own cases
(gpu_puzzles.bench.layernorm_linear) run their implementations (ours fused / unfused, eager,
F.linear alone) in one torch.profiler timeline: they take turns in rounds of a few calls, each
round starting one implementation later, the GPU queued ahead of the host (a long sleep kernel
first) and a short sleep kernel before each call to mark where it starts. Per implementation:
the median call (first kernel's start to last kernel's end), the median sum of its kernels (the
difference is the time the GPU sat between kernels of one call) and each kernel's median.
Profiling one implementation after another instead compared GEMMs run at different clocks.
"""
import collections
import json
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import gpu_puzzles as gp
from gpu_puzzles.bench import layernorm_linear as L
from gpu_puzzles.bench.common import _sleep_cycles_per_ms, in_turn, n_sets_for

SHAPES = [(8192, 4096, 4096), (16384, 1024, 4096)]
ROUNDS, PER_ROUND = 8, 3


def timeline(impls, sets, device):
    """{label: [[(kernel name, start us, end us), ...] per call]} from one profiled sequence."""
    labels = list(impls)
    seq = [label for r in range(ROUNDS) for label in in_turn(labels, r) for _ in range(PER_ROUND)]
    for fn in impls.values():  # warm-up: every set once
        for s in sets:
            fn(*s)
    torch.cuda.synchronize()
    cycles = _sleep_cycles_per_ms(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda._sleep(int(400 * cycles))
        for j, label in enumerate(seq):
            torch.cuda._sleep(1000)  # marks the call's start
            impls[label](*sets[j % len(sets)])
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    calls, cur = [], None
    for e in events:
        if "spin" in e.name or "sleep" in e.name:
            cur = []
            calls.append(cur)
        elif cur is not None:
            cur.append((e.name, e.time_range.start, e.time_range.end))
    calls = calls[-len(seq):]  # the marker groups (the long sleep before them is a spin kernel too)
    out = collections.defaultdict(list)
    for label, call in zip(seq, calls):
        out[label].append(call)
    return out


def summarize(calls):
    walls = [c[-1][2] - c[0][1] for c in calls if c]
    sums = [sum(e - s for _, s, e in c) for c in calls]
    per = collections.defaultdict(list)
    for c in calls:
        for name, s, e in c:
            per[name].append(e - s)
    kernels = sorted(((n, len(v) / len(calls), statistics.median(v)) for n, v in per.items()),
                     key=lambda r: -r[1] * r[2])
    return dict(wall_us=statistics.median(walls), kernel_sum_us=statistics.median(sums),
                kernels=[dict(name=n, per_call=c, median_us=m) for n, c, m in kernels])


def parse_shape(a):
    """'512x1024x1024t' -> ((512, 1024, 1024), True)."""
    t = a.endswith("t")
    return tuple(int(v) for v in a.rstrip("t").split("x")), t


def main():
    args = sys.argv[1:]
    out_json = None
    if "--json" in args:
        i = args.index("--json")
        out_json = args[i + 1]
        del args[i:i + 2]
    dirs = tuple(a for a in args if a in ("fwd", "fwd+bwd")) or ("fwd", "fwd+bwd")
    knobs = dict(a.split("=", 1) for a in args if "=" in a)
    shapes = [parse_shape(a) for a in args if a[:1].isdigit() and "=" not in a] or [(s, False) for s in SHAPES]
    with gp.tuning.override(**knobs):
        result = profile_all(dirs, shapes)
    if out_json:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "knobs": knobs,
                "method": "one profiler timeline, implementations taking turns (this script's docstring)",
                "rounds": ROUNDS, "calls_per_round": PER_ROUND, "cases": result}
        with open(out_json, "w") as f:
            json.dump(meta, f, indent=1)


def profile_all(dirs, shapes):
    device = torch.device("cuda")
    cases = [c for shape, w_t in shapes for c in L.cases(device, [shape], directions=dirs, w_t=w_t, compile_=False)]
    result = {}
    for case in cases:
        first = case.make()
        per_set = sum(t.numel() * t.element_size() for t in first if isinstance(t, torch.Tensor))
        sets = [first] + [case.make() for _ in range(n_sets_for(per_set) - 1)]
        rows = {label: summarize(calls) for label, calls in timeline(case.impls, sets, device).items()}
        result[f"{case.direction} {case.name}"] = rows
        for label, r in rows.items():
            print(f"\n## {case.direction} {case.name} | {label}: call {r['wall_us']:.1f} us, kernel sum "
                  f"{r['kernel_sum_us']:.1f} us, between kernels {r['wall_us'] - r['kernel_sum_us']:.1f} us")
            for k in r["kernels"]:
                print(f"  {k['median_us']:8.1f} us  x{k['per_call']:4.1f}  {k['name'][:110]}")
        del sets, first
    return result


if __name__ == "__main__":
    main()
