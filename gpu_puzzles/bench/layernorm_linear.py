"""layernorm_linear cases: layer_norm alone, and LayerNorm+Linear fused vs unfused vs
eager vs torch.compile vs F.linear alone (the GEMM floor), forward and forward+backward,
with W as (N, H) rows or as a transposed view (GPT-2's Conv1D weight.t()); plus the peak
extra memory of each implementation's forward+backward.

``python -m gpu_puzzles.bench.layernorm_linear --sweep --json FILE``: the plan sweep (M x H x N
grid, both W layouts, bf16, fwd and fwd+bwd: the fused op's auto plan, each plan forced, our
unfused path, eager), printing the worst ratios auto / min(eager, unfused) and auto / best plan.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys

import torch
import torch.nn.functional as F

import gpu_puzzles as gp

from .common import Case, backward_fn, copy_bandwidth, device_name, git_commit, norm_linear_memory_rows, run_case

OP = "layernorm_linear"


def reference(x, ln_weight, ln_bias, linear_weight, linear_bias=None):
    """PyTorch eager: F.linear(F.layer_norm(x)), in x's dtype (F.layer_norm's default eps)."""
    return F.linear(F.layer_norm(x, (x.shape[-1],), ln_weight, ln_bias), linear_weight, linear_bias)


def linear_only(x, ln_weight, ln_bias, linear_weight, linear_bias=None):
    """The GEMM floor: F.linear on x, no normalisation."""
    return F.linear(x, linear_weight, linear_bias)


def _linear_only_bwd(x, lw, lb, W, b, g):
    return torch.autograd.grad(F.linear(x, W, b), (x, W, b), g)


def inputs(M, H, N, dtype, device, grad=False, w_t=False):
    """x, ln_weight, ln_bias, W, b; with ``w_t`` W is the transposed view of (H, N) memory."""
    x = torch.randn(M, H, device=device, dtype=dtype, requires_grad=grad)
    lw = (1 + 0.1 * torch.randn(H, device=device, dtype=dtype)).requires_grad_(grad)
    lb = (0.1 * torch.randn(H, device=device, dtype=dtype)).requires_grad_(grad)
    if w_t:
        W = (torch.randn(H, N, device=device, dtype=dtype) / H ** 0.5).t().requires_grad_(grad)
    else:
        W = (torch.randn(N, H, device=device, dtype=dtype) / H ** 0.5).requires_grad_(grad)
    b = (0.1 * torch.randn(N, device=device, dtype=dtype)).requires_grad_(grad)
    return x, lw, lb, W, b


_unfused = functools.partial(gp.fused_layernorm_linear, algorithm="unfused")


def impls(compile_=True):
    out = {"ours fused": gp.fused_layernorm_linear, "ours unfused": _unfused, "eager": reference}
    if compile_:
        out["compile"] = torch.compile(reference, dynamic=False)
    return out


def cases(device, shapes, dtype=torch.bfloat16, directions=("fwd", "fwd+bwd"), compile_=True, ln_alone=(),
          ln_backward=False, w_t=False):
    """LayerNorm+Linear cases for each (M, H, N) of ``shapes``, after layer_norm alone for each (M, H) of
    ``ln_alone`` (forward; forward+backward too with ``ln_backward``). ``w_t``: W transposed."""
    esize = torch.tensor([], dtype=dtype).element_size()
    dname = str(dtype).replace("torch.", "")
    out = []
    for (M, H) in ln_alone:
        f = {"ours": gp.layer_norm, "eager": lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b)}
        if compile_:
            f["compile"] = torch.compile(lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b), dynamic=False)
        # M, H bound now: the loop below rebinds them (a late-bound lambda timed the last
        # shape's 16384x4096 rows against 8192x4096's bytes: 0.10 ms, "1.3 TB/s").
        out.append(Case("layer_norm", f"({M},{H})", "fwd", lambda M=M, H=H: inputs(M, H, 1, dtype, device)[:3], f,
                        bytes=2 * M * H * esize, params=dict(M=M, H=H, dtype=dname)))
        if ln_backward:
            def make_ln(M=M, H=H):
                return (*inputs(M, H, 1, dtype, device, grad=True)[:3], torch.randn(M, H, device=device, dtype=dtype))
            out.append(Case("layer_norm", f"({M},{H})", "fwd+bwd", make_ln,
                            {k: backward_fn(g, 3) for k, g in f.items()}, bytes=5 * M * H * esize,
                            params=dict(M=M, H=H, dtype=dname)))
    for (M, H, N) in shapes:
        params = dict(M=M, H=H, N=N, dtype=dname, W="t" if w_t else "rows")
        name = f"M={M} H={H} N={N}" + (" W.t()" if w_t else "")
        fwd = impls(compile_)
        fwd["F.linear alone"] = linear_only
        flops = 2 * M * H * N
        if "fwd" in directions:
            out.append(Case(OP, name, "fwd", lambda M=M, H=H, N=N: inputs(M, H, N, dtype, device, w_t=w_t), fwd,
                            flops=flops, params=params))
        if "fwd+bwd" in directions:
            def make(M=M, H=H, N=N):
                return (*inputs(M, H, N, dtype, device, grad=True, w_t=w_t),
                        torch.randn(M, N, device=device, dtype=dtype))
            bwd = {k: backward_fn(f, 5) for k, f in impls(compile_).items()}
            bwd["F.linear alone"] = _linear_only_bwd
            out.append(Case(OP, name, "fwd+bwd", make, bwd, flops=3 * flops, params=params))
    return out


# Two transformer projections (square, and 4x wide from a narrow H), and a narrow
# projection of wide rows (N << H), where the folded form moves fewer bytes than
# eager's normalise-first (2NH + 2MN < MH).
BENCH_SHAPES = [(8192, 4096, 4096), (16384, 1024, 4096), (16384, 4096, 512)]
# W transposed (as GPT-2's Conv1D hands it): GPT-2's qkv projection at batch 8 x 1024, and
# Llama-style projections at few rows (where the fold's pass over W costs more than xn).
BENCH_SHAPES_WT = [(8192, 768, 2304), (1024, 4096, 4096), (2048, 4096, 4096), (4096, 4096, 14336)]


# The CPU shapes: GPT-2's fused qkv projection, and the tour's small square one.
CPU_SHAPES = [(512, 768, 2304), (512, 256, 256)]


def bench_cases(device):
    if device.type == "cpu":
        return cases(device, CPU_SHAPES, dtype=torch.float32, compile_=False, ln_alone=[(512, 768), (512, 256)],
                     ln_backward=True)
    return (cases(device, BENCH_SHAPES, ln_alone=[(8192, 4096)])
            + cases(device, BENCH_SHAPES_WT, w_t=True))


def tour_cases(device):
    if device.type == "cuda":
        return cases(device, [(8192, 4096, 4096)], ln_alone=[(8192, 4096)])
    return cases(device, [(512, 768, 2304)], dtype=torch.float32, compile_=False, ln_alone=[(512, 768)],
                 ln_backward=True)


def peak_memory(device, shapes=BENCH_SHAPES, dtype=torch.bfloat16, compile_=True):
    """Peak memory above the live inputs (MiB) of one forward+backward per implementation."""
    if device.type != "cuda":
        return []

    def fns():
        return {**{k: backward_fn(f, 5) for k, f in impls(compile_).items()}, "F.linear alone": _linear_only_bwd}

    return norm_linear_memory_rows(OP, shapes, fns, inputs, dtype, device)


def tour_check(device):
    """Max error of ours vs a float64 reference, forward and the five gradients, fresh inputs."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    errs = {}
    x, lw, lb, W, b = inputs(300, 384, 200, dtype, device, grad=True)
    g = torch.randn(300, 200, device=device, dtype=dtype)
    leaves = [t.detach().double().requires_grad_() for t in (x, lw, lb, W, b)]
    y64 = reference(*leaves)
    refs = torch.autograd.grad(y64, leaves, g.double())
    for label, f in (("fused", gp.fused_layernorm_linear), ("unfused", _unfused)):
        y = f(x, lw, lb, W, b)
        grads = torch.autograd.grad(y, (x, lw, lb, W, b), g)
        errs[f"fwd {label}"] = (y.double() - y64).abs().max().item()
        errs[f"bwd {label}"] = max((a.double() - r).abs().max().item() / max(1.0, r.abs().max().item())
                                   for a, r in zip(grads, refs))
    xl = (x.detach() + 1000).to(dtype)  # large mean: the guard's normalise-first rows
    y64l = reference(xl.double(), *leaves[1:])
    errs["fwd fused, mean 1000"] = (gp.fused_layernorm_linear(xl, lw, lb, W, b).double() - y64l).abs().max().item()
    errs["fwd eager, mean 1000"] = (reference(xl, lw, lb, W, b).double() - y64l).abs().max().item()
    return errs


# ---- the plan sweep ----------------------------------------------------------------------

SWEEP_M = (512, 1024, 2048, 4096, 8192, 16384)
SWEEP_K = (768, 1024, 2048, 4096)
SWEEP_MEM_LIMIT = 40 * 2**30


def _forced(plan):
    def f(*args):
        with gp.tuning.override(layernorm_linear_plan=plan):
            return gp.fused_layernorm_linear(*args)
    return f


# Five implementations of one shape differ by a few percent, about as much as the clock of
# a GPU under a long sweep drifts: they take turns in rounds (bench.common.run_case), and
# each gets the median of all its calls (the best round's median put the same kernels,
# auto and its forced plan, several percent apart).
SWEEP_ROUNDS = 5


def sweep_shapes(ms=SWEEP_M, ks=SWEEP_K):
    return [(M, K, N) for M in ms for K in ks for N in sorted({K, 3 * K, 4 * K, 14336})]


def _sweep_bytes(M, K, N, esize=2):
    """A generous bound on one fwd+bwd's memory (inputs, outputs, grads, eager's saved xn, 8 input sets)."""
    return esize * (8 * (M * K + N * K + M * N) + 4 * M * K + 3 * M * N + 2 * N * K)


def sweep(device, shapes, rep=25, warmup=3, dtype=torch.bfloat16, layouts=(False, True), progress=True,
          rounds=SWEEP_ROUNDS):
    """Rows of the sweep: per shape, W layout and direction, the fused op's auto plan, each plan
    forced, our unfused path and eager."""
    copy_gbs = copy_bandwidth(device)
    fns = {"auto": gp.fused_layernorm_linear, "fold": _forced("fold"), "normalize": _forced("normalize"),
           "unfused": _unfused, "eager": reference}
    rows = []
    todo = [(s, w) for s in shapes for w in layouts]
    for i, ((M, K, N), w_t) in enumerate(todo):
        if _sweep_bytes(M, K, N) > SWEEP_MEM_LIMIT:
            continue
        for case in cases(device, [(M, K, N)], dtype=dtype, compile_=False, w_t=w_t):
            bwd = case.direction == "fwd+bwd"
            case.impls = {k: backward_fn(f, 5) if bwd else f for k, f in fns.items()}
            rows += run_case(case, device, copy_gbs, rep=rep, warmup=warmup, rounds=rounds, pooled=True)
        if progress:
            print(f"\r{i + 1}/{len(todo)} M={M} K={K} N={N} W={'t' if w_t else 'rows'}    ", end="",
                  file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    return rows, copy_gbs


def summarize(rows, worst=15, slack=1.02):
    """Per (shape, layout, direction): auto / min(eager, unfused) and auto / best forced plan,
    sorted worst first."""
    by = {}
    for r in rows:
        by.setdefault((r["M"], r["H"], r["N"], r["W"], r["direction"]), {})[r["impl"]] = r.get("ms")
    out = []
    for (M, K, N, w, d), t in by.items():
        if any(t.get(k) is None for k in ("auto", "fold", "normalize", "unfused", "eager")):
            out.append(dict(M=M, K=K, N=N, W=w, direction=d, error="a timing failed", **t))
            continue
        base = min(t["eager"], t["unfused"])
        best = min(t["fold"], t["normalize"])
        out.append(dict(M=M, K=K, N=N, W=w, direction=d, vs_baseline=t["auto"] / base, vs_best_plan=t["auto"] / best,
                        best_plan="fold" if t["fold"] < t["normalize"] else "normalize", **t))
    ok = [o for o in out if "error" not in o]
    fails = [o for o in ok if o["vs_baseline"] > slack]

    def table(title, key):
        print(title)
        print(f"{'M':>6} {'K':>5} {'N':>6} {'W':>4} {'dir':>7} {'ratio':>6}  {'auto':>7} {'fold':>7} {'norm':>7} "
              f"{'unfused':>7} {'eager':>7}  best")
        for o in sorted(ok, key=lambda o: -o[key])[:worst]:
            print(f"{o['M']:>6} {o['K']:>5} {o['N']:>6} {o['W']:>4} {o['direction']:>7} {o[key]:>6.3f}  "
                  f"{o['auto']:>7.4f} {o['fold']:>7.4f} {o['normalize']:>7.4f} {o['unfused']:>7.4f} "
                  f"{o['eager']:>7.4f}  {o['best_plan']}")

    table(f"worst auto / min(eager, unfused) ({len(fails)} of {len(ok)} above {slack}):", "vs_baseline")
    table("worst auto / best forced plan (the threshold's misses):", "vs_best_plan")
    for o in out:
        if "error" in o:
            print("error:", o)
    return out, len(fails)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m gpu_puzzles.bench.layernorm_linear", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep", action="store_true", help="run the plan sweep (the only mode here)")
    p.add_argument("--json", help="write the rows and the summary to this file")
    p.add_argument("--rep", type=int, default=25,
                   help="timed calls per implementation, over the rounds (default 25)")
    p.add_argument("--rounds", type=int, default=SWEEP_ROUNDS,
                   help=f"turns per implementation (default {SWEEP_ROUNDS})")
    p.add_argument("--M", type=int, nargs="*", default=list(SWEEP_M))
    p.add_argument("--K", type=int, nargs="*", default=list(SWEEP_K))
    args = p.parse_args(argv)
    if not args.sweep:
        p.error("only --sweep is implemented here; the standard cases: python -m gpu_puzzles.bench layernorm_linear")
    device = torch.device("cuda")
    rows, copy_gbs = sweep(device, sweep_shapes(args.M, args.K), rep=args.rep, rounds=args.rounds)
    summary, n_fail = summarize(rows)
    if args.json:
        import datetime
        meta = {"device": device_name(device), "torch": torch.__version__, "cuda": torch.version.cuda,
                "commit": git_commit(),
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "copy_GBps": copy_gbs, "rep": args.rep,
                "timing": f"CUDA events, inputs rotated past L2; the implementations take turns in {args.rounds} "
                          f"rounds of --rep/{args.rounds} calls after warm-up; each row is the median of "
                          f"all its calls",
                "summary": summary, "rows": rows}
        with open(args.json, "w") as f:
            json.dump(meta, f, indent=1)
        print(f"wrote {args.json}")
    return 0 if n_fail == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
