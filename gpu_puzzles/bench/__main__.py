"""``python -m gpu_puzzles.bench [OP ...] [--json FILE]``: ours vs PyTorch eager vs torch.compile.
``python -m gpu_puzzles.bench model [--models gpt2,llama] [--json FILE]``: training steps of
Hugging Face models, stock vs patched (gpu_puzzles/bench/model.py).

Every figure in one JSON comes from one process on one device: the copy
bandwidth ceiling, then each case's implementations. Backward rows are derived
as (forward+backward) - (forward) of the same implementation, so they count the
backward kernels plus the autograd overhead a user pays.

On the CPU (``--device cpu``) each op has its own fp32 shapes, every case runs
once per thread count of ``--threads`` (default: 1 and all of the machine's), and
a time is the fastest of ``--rep`` calls.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys

import torch

from . import OPS, op_module
from .common import CPU_TIMING, copy_bandwidth, cpu_threads, device_name, git_commit, run_case


def derive_backward(rows):
    fwd = {(r["op"], r["case"], r["impl"]): r for r in rows if r["direction"] == "fwd"}
    out = []
    for r in rows:
        if r["direction"] != "fwd+bwd" or r.get("ms") is None:
            continue
        f = fwd.get((r["op"], r["case"], r["impl"]))
        if not f or f.get("ms") is None:
            continue
        b = {k: v for k, v in r.items() if k not in ("GB/s", "pct_copy", "TFLOP/s")}
        b.update(direction="bwd", ms=r["ms"] - f["ms"])
        if r.get("bwd_bytes") and b["ms"] > 0:
            b["GB/s"] = r["bwd_bytes"] / (b["ms"] * 1e-3) / 1e9
            b["pct_copy"] = 100 * b["GB/s"] / r["copy_GBps"]
        if r.get("bwd_flops") and b["ms"] > 0:
            b["TFLOP/s"] = r["bwd_flops"] / (b["ms"] * 1e-3) / 1e12
        out.append(b)
    return out


def print_rows(rows, title):
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title, show_lines=False)
    for col in ("op", "case", "dir", "impl", "ms", "GB/s", "% copy", "TFLOP/s", "vs eager"):
        t.add_column(col, justify="right" if col not in ("op", "case", "impl") else "left")
    eager = {(r["op"], r["case"], r["direction"]): r.get("ms") for r in rows if r["impl"] == "eager"}
    for r in rows:
        ms = r.get("ms")
        e = eager.get((r["op"], r["case"], r["direction"]))
        fmt = lambda v, f: "" if v is None else format(v, f)  # noqa: E731
        t.add_row(r["op"], r["case"], r["direction"], r["impl"],
                  fmt(ms, ".4f") if ms is not None else r.get("error", "error")[:40],
                  fmt(r.get("GB/s"), ".0f"), fmt(r.get("pct_copy"), ".0f"),
                  fmt(r.get("TFLOP/s"), ".0f" if (r.get("TFLOP/s") or 0) >= 10 else ".2f"),
                  fmt(e / ms if (e and ms) else None, ".2f") + ("x" if (e and ms) else ""))
    Console(width=160).print(t)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["model"]:  # whole training steps, not op rows: its own options
        from .model import main as model_main
        return model_main(argv[1:])
    p = argparse.ArgumentParser(prog="python -m gpu_puzzles.bench", description=__doc__)
    p.add_argument("ops", nargs="*", default=OPS, help=f"ops to benchmark (default: all of {OPS})")
    p.add_argument("--json", help="write every row and the run's metadata to this file")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rep", type=int, default=None, help="timed calls per implementation (default 40 on CUDA, "
                   "12 on the CPU)")
    p.add_argument("--threads", default=None,
                   help="CPU only: comma-separated intra-op thread counts to run every case at "
                        "(default: 1 and the machine's)")
    p.add_argument("--no-backlog", action="store_true",
                   help="time each call without first queueing work ahead of it (host enqueue time counts too)")
    args = p.parse_args(argv)
    unknown = [o for o in args.ops if o not in OPS]
    if unknown:
        p.error(f"unknown op(s) {unknown}; choose from {OPS}")
    device = torch.device(args.device)
    if device.type == "cpu":
        threads = ([int(t) for t in args.threads.split(",")] if args.threads else
                   sorted({1, torch.get_num_threads()}))
    elif args.threads:
        p.error("--threads applies to --device cpu only")
    else:
        threads = [None]
    rep = args.rep or (40 if device.type == "cuda" else 12)
    copy_gbs = copy_bandwidth(device)
    print(f"device: {device_name(device)}; copy bandwidth {copy_gbs:.0f} GB/s (read + write)", flush=True)
    rows = []
    from rich.progress import Progress

    memory = []
    with Progress() as prog:
        for op in args.ops:
            mod = op_module(op)
            cases = mod.bench_cases(device)
            task = prog.add_task(f"{op}", total=len(cases) * len(threads))
            for n in threads:
                for case in cases:
                    with cpu_threads(n):
                        new = run_case(case, device, copy_gbs, rep=rep, backlog=not args.no_backlog,
                                       rounds=case.rounds, pooled=case.pooled)
                    for r in new:
                        r["copy_GBps"] = copy_gbs
                        for k in ("bwd_bytes", "bwd_flops"):
                            if k in case.params:
                                r[k] = case.params[k]
                        if n:  # one row per thread count: the case's name says which
                            r.update(threads=n, case=f"{r['case']} [{n} thr]")
                    rows += new
                    prog.advance(task)
                    torch._dynamo.reset()
            if hasattr(mod, "peak_memory"):  # peak memory above the inputs, per implementation
                try:
                    memory += mod.peak_memory(device)
                except Exception as e:  # report, don't hide
                    memory.append({"op": op, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"})
                torch._dynamo.reset()
    if device.type == "cuda":  # on the CPU a difference of two fastest calls is no backward time
        rows += derive_backward(rows)
    order = {"fwd": 0, "bwd": 1, "fwd+bwd": 2}
    rows.sort(key=lambda r: (r["op"], r["case"], order.get(r["direction"], 3)))
    print_rows(rows, f"gpu_puzzles on {device_name(device)}")
    if device.type == "cpu":
        print(f"timing: {CPU_TIMING}")
    for m in memory:
        print("peak memory:", ", ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in m.items()))
    if args.json:
        meta = {
            "device": device_name(device),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "commit": git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "copy_GBps": copy_gbs,
            "timing": (f"CPU: {CPU_TIMING}; thread counts {threads}" if device.type == "cpu" else
                       "CUDA events, median of --rep calls after warm-up, inputs rotated past L2; outputs of the "
                       "last calls kept alive (>= 3x L2) so every call writes fresh memory; "
                       + ("no backlog: a call that finds the GPU idle also times its host enqueue"
                          if args.no_backlog else
                          "the calls queued behind a GPU sleep, so each event pair brackets device work only "
                          "(host_ms: the host's enqueue time per call)")),
            "rows": rows,
            "memory": memory,
        }
        with open(args.json, "w") as f:
            json.dump(meta, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
