"""Sweep the fused attention forward's kernels (the attention_fwd knob, gpu_puzzles.tuning).

For each configuration, in this process: first a correctness check against float64 SDPA at
small odd shapes (output, lse, and the gradients of the backward that consumes the lse), then
the forward timed with CUDA events (warm-up, median of --reps) at the four benchmark shapes or
(--shapes small) at short sequences. One table at the end; each cell names the kernel that ran.

    PYTHONPATH=$PWD python benchmarks/attention_sweep.py            # every config
    PYTHONPATH=$PWD python benchmarks/attention_sweep.py --configs mma mma_r32 --reps 50
    PYTHONPATH=$PWD python benchmarks/attention_sweep.py --shapes small --json /tmp/small.json

FLOPs: 4*B*H*Sq*Sk*D (half when causal), as in gpu_puzzles/bench/attention.py.

Configs: "auto" (the default heuristic, attention_fwd_plan in csrc/attention/attention_plan.cu)
and the attention_fwd knob's values: "mma" (attn_fwd_mma), "mma_r32" (attn_fwd_mma_r32), "wgmma" /
"wgmma3" (the sm_90a kernel of csrc/attention/attention_fwd_sm90.cu with 2 / 3 warpgroups per
CTA), "ws" / "ws2" / "ws3" (its warp-specialised, TMA-fed variants: plain, consumers' GEMMs
overlapping their softmax, and that with the consumers taking turns; "ws192": ws3 with three
consumers, D = 64 only), and "sdpa" (F.scaled_dot_product_attention, timed the
same way, for the ratios). Where a forced kernel
cannot run (no CUTLASS headers at build time, not a 9.x GPU) the heuristic's fallback runs, and
its cells say so. The names older results files use, "old" and
"r32_bn32_w4_s2", are taken for "mma" and "mma_r32".
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

import gpu_puzzles as gp
from gpu_puzzles.bench.attention import forward_kernels

CONFIGS = ["auto", "mma", "mma_r32", "wgmma", "wgmma3", "ws", "ws2", "ws3", "ws192", "sdpa"]
ALIASES = {"old": "mma", "r32_bn32_w4_s2": "mma_r32"}
# (label, B, H, S, D, causal)
SHAPES = [("4x32x4096x128", 4, 32, 4096, 128, False), ("4x32x4096x128 causal", 4, 32, 4096, 128, True),
          ("8x16x2048x64", 8, 16, 2048, 64, False), ("8x16x2048x64 causal", 8, 16, 2048, 64, True)]
# --shapes small: few CTAs per wave (the notebook's B=2, H=16 sweep and around it), where a
# 192-row CTA leaves SMs idle that a 128-row one would fill.
SMALL_SHAPES = [(f"{B}x16x{S}x{D}" + (" causal" if c else ""), B, 16, S, D, c)
                for D in (64, 128) for c in (False, True) for B in (1, 2, 4, 8) for S in (256, 512, 1024, 2048)]
# --shapes models: D = 64, the head dim of GPT-2 and of the Llama-style 1B (issue 29's configs),
# and the D = 64 row.
MODEL_SHAPES = [("gpt2 8x12x1024x64 causal", 8, 12, 1024, 64, True),
                ("llama1b 4x32x2048x64 causal", 4, 32, 2048, 64, True),
                ("8x16x2048x64", 8, 16, 2048, 64, False), ("8x16x2048x64 causal", 8, 16, 2048, 64, True),
                ("2x16x1024x64 causal", 2, 16, 1024, 64, True), ("1x32x8192x64 causal", 1, 32, 8192, 64, True)]
# (lead, Sq, Sk, D, causal): tails past every tile size, S < BN, Sq != Sk both ways under causal.
CHECK_SHAPES = [((2, 3), 1, 1, 64, False), ((2,), 17, 5, 128, True), ((2,), 31, 33, 64, True),
                ((1, 2), 129, 33, 128, True), ((1, 2), 33, 129, 64, True), ((2,), 255, 127, 128, False),
                ((1, 3), 257, 300, 64, True), ((1, 2), 300, 257, 128, True), ((1,), 1000, 1001, 128, False),
                ((1,), 1000, 1001, 64, True)]


def check(res: dict) -> None:
    """Correctness at CHECK_SHAPES (bf16 and fp16) into res["max_err"] / res["fail"]."""
    ops = torch.ops.gpu_puzzles
    g = torch.Generator(device="cpu").manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        tol = 6e-2 if dtype == torch.bfloat16 else 1e-2
        for lead, Sq, Sk, D, causal in CHECK_SHAPES:
            mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to("cuda", dtype)  # noqa: E731
            q, k, v, do = mk(*lead, Sq, D), mk(*lead, Sk, D), mk(*lead, Sk, D), mk(*lead, Sq, D)
            o, lse = ops.attention(q, k, v, None, causal)
            dq, dk, dv = ops.attention_backward(do, q, k, v, o, lse, None, causal)
            leaves = [t.double().requires_grad_() for t in (q, k, v)]
            ref = F.scaled_dot_product_attention(*leaves, is_causal=causal)
            s = leaves[0].detach() @ leaves[1].detach().transpose(-1, -2) / D**0.5
            if causal:
                s = s.masked_fill(torch.ones(Sq, Sk, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
            grads = torch.autograd.grad(ref, leaves, do.double())
            errs = {"out": (o.double() - ref).abs().max().item() / max(1.0, ref.abs().max().item()),
                    "lse": (lse.double() - torch.logsumexp(s, -1)).abs().max().item()}
            for n, a, r in zip(("dq", "dk", "dv"), (dq, dk, dv), grads):
                errs[n] = (a.double() - r).abs().max().item() / max(1.0, r.abs().max().item()) / 2
            for n, e in errs.items():
                res["max_err"] = max(res["max_err"], e) if e == e else float("nan")
                if not e <= tol:  # NaN fails too
                    res["fail"].append(f"{dtype} {lead} Sq={Sq} Sk={Sk} D={D} causal={causal} {n} err={e:.3g}")


def warm_up_gpu() -> None:
    """Busy the GPU for half a second, so that short shapes are not timed while the clocks
    still ramp up from idle."""
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t0 = torch.cuda.Event(enable_timing=True)
    t0.record()
    while True:
        for _ in range(10):
            x @ x
        t1 = torch.cuda.Event(enable_timing=True)
        t1.record()
        t1.synchronize()
        if t0.elapsed_time(t1) > 500:
            break


def run_config(cfg: str, reps: int, shapes: list) -> dict:
    """Check and time one configuration under the attention_fwd knob."""
    ops = torch.ops.gpu_puzzles
    res = {"cfg": cfg, "max_err": 0.0, "fail": [], "kernel": {}}
    sdpa = cfg == "sdpa"  # F.scaled_dot_product_attention, timed the same way (not checked)
    with gp.tuning.override(attention_fwd=None if cfg in ("auto", "sdpa") else cfg):
        if not sdpa:
            check(res)
        warm_up_gpu()
        for label, B, H, S, D, causal in shapes:
            q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            if sdpa:
                fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
                res["kernel"][label] = "sdpa"
            else:
                fn = lambda: ops.attention(q, k, v, None, causal)  # noqa: E731
                ran = forward_kernels(fn)
                res["kernel"][label] = "?" if not ran else "+".join(sorted(set(ran)))
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            # `inner` calls between the events: a call of a few microseconds would otherwise time the
            # launch gap, not the kernel.
            inner = 10
            times = []
            for _ in range(reps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(inner):
                    fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) / inner)
            times.sort()
            ms = times[len(times) // 2]
            flops = 4 * B * H * S * S * D // (2 if causal else 1)
            res[label] = flops / (ms * 1e-3) / 1e12
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="*", default=CONFIGS,
                    help="auto and attention_fwd knob values: " + ", ".join(CONFIGS[1:]))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--shapes", choices=("issue", "small", "models"), default="issue",
                    help="issue: the four benchmark shapes; small: B=1..8, H=16, S=256..2048 (few CTAs); "
                         "models: D = 64 at GPT-2's and the Llama-style 1B's shapes")
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args()
    shapes = {"issue": SHAPES, "small": SMALL_SHAPES, "models": MODEL_SHAPES}[args.shapes]
    rows = []
    for cfg in args.configs:
        cfg = ALIASES.get(cfg, cfg)
        try:
            rows.append(run_config(cfg, args.reps, shapes))
        except Exception as e:  # noqa: BLE001  (a config that fails is reported in the table)
            rows.append({"cfg": cfg, "error": f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[-1]}"})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shapes": [s[0] for s in shapes], "rows": rows}, f, indent=1)
    # One row per shape, one column per config (errors and failed checks listed below).
    good = [r for r in rows if "error" not in r]
    w = 24
    print("forward TFLOP/s (bf16, median over reps of CUDA-event time / 10 calls) and the kernel that ran")
    print(f"{'shape':<22} " + " ".join(f"{r['cfg']:>{w}}" for r in good))
    print(f"{'check (max err)':<22} " + " ".join(
        f"{('ok' if not r['fail'] else 'FAIL') + ' ' + format(r['max_err'], '.1e'):>{w}}" for r in good))
    for s in shapes:
        print(f"{s[0]:<22} " + " ".join(f"{format(r[s[0]], '.1f') + ' ' + r['kernel'][s[0]]:>{w}}" for r in good))
    for r in rows:
        if "error" in r:
            print(f"{r['cfg']}: ERROR {r['error']}")
    for r in rows:
        for f in r.get("fail", [])[:10]:
            print(f"  {r['cfg']}: {f}")


if __name__ == "__main__":
    main()
