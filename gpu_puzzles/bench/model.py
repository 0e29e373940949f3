"""``python -m gpu_puzzles.bench model``: Hugging Face models, stock vs ``gpu_puzzles.hf.patch``.

A training step (forward with the LM loss, backward, fused AdamW step, zero_grad) of models
built from ``transformers`` configs with random weights (never downloaded), bf16, timed as
the median of CUDA-event-bracketed steps after warm-up, with the step's peak allocated
memory. Eager, the variants of one model are all built first and take turns (``--turns``),
so that drift of the host or the GPU does not fall on one of them; compiled, each runs in a
fresh dynamo state. Variants: stock, patched with attention left to SDPA (``attention=False``), fully
patched, and fully patched with the fused LM head + loss (``fused_loss=True``); each eager and
under ``torch.compile``. ``--profile`` adds the per-op breakdown: one
profiled step's CUDA kernels, each and summed by group (``KERNEL_GROUPS``).
"""
from __future__ import annotations

import statistics
import time

import torch

MODELS = {
    # GPT-2 124M, 8 x 1024 tokens.
    "gpt2": dict(kind="gpt2", batch=8, seq=1024,
                 config=dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)),
    # Llama-style: hidden 2048, 16 layers, 32 heads / 8 kv heads, intermediate 8192, vocab 128256.
    "llama": dict(kind="llama", batch=4, seq=2048,
                  config=dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                              num_key_value_heads=8, intermediate_size=8192, vocab_size=128256,
                              max_position_embeddings=4096)),
}
VARIANTS = {
    "stock": None,
    "ours, SDPA attention": dict(attention=False),
    "ours": dict(),
    "ours, fused LM head + loss": dict(fused_loss=True),
}
# Short names for --variants (the variant names themselves hold commas).
VARIANT_ALIASES = {"stock": "stock", "sdpa": "ours, SDPA attention", "ours": "ours",
                   "fused": "ours, fused LM head + loss"}


def build(name: str, device, dtype=torch.bfloat16, seed: int = 0, small: bool = False):
    """A random-init model from its config (no download); ``small`` shrinks it for CPU tests."""
    import transformers
    spec = MODELS[name]
    cfg = dict(spec["config"])
    if small:
        cfg.update({"gpt2": dict(n_layer=2, n_embd=64, n_head=4, vocab_size=211, n_positions=64),
                    "llama": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  intermediate_size=128, vocab_size=211, max_position_embeddings=64)}[name])
    torch.manual_seed(seed)
    if spec["kind"] == "gpt2":
        config = transformers.GPT2Config(**cfg, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
                                         bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(**cfg, attention_dropout=0.0, bos_token_id=0, eos_token_id=0,
                                          pad_token_id=None)
        model = transformers.LlamaForCausalLM(config)
    # transformers' default loss, named, so the stock path does not warn (a graph break
    # under torch.compile) about an unset loss_type.
    model.loss_type = "ForCausalLM"
    config._attn_implementation = "sdpa"
    return model.to(device=device, dtype=dtype)


def batch(name: str, device, small: bool = False, seed: int = 1):
    spec = MODELS[name]
    B, S = (2, 32) if small else (spec["batch"], spec["seq"])
    V = 211 if small else spec["config"]["vocab_size"]
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, V, (B, S), generator=g).to(device)
    return ids


def _step_fn(model, opt, ids, compiled):
    fwd = torch.compile(model) if compiled else model

    def step():
        loss = fwd(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def _prepare(name, variant, compiled, device, warmup=3):
    """One variant built, patched and warmed up (compiled on its first steps); its memory state
    (parameters, optimizer state, inputs) is what it added to the allocated bytes."""
    import gpu_puzzles.hf as hf
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    model = build(name, device)
    report = hf.patch(model, **VARIANTS[variant]) if VARIANTS[variant] is not None else None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = batch(name, device)
    step = _step_fn(model, opt, ids, compiled)
    t0 = time.time()
    losses = [float(step()) for _ in range(warmup)]
    warm_s = time.time() - t0
    torch.cuda.synchronize()
    return dict(step=step, tokens=ids.numel(), losses=losses, warm_s=warm_s,
                state=torch.cuda.memory_allocated() - before, report=report, times=[], peak_above=0)


def _timed_steps(v, n):
    """n CUDA-event-timed steps of a prepared variant; its peak above what was allocated before them."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        v["step"]()
        b.record()
        b.synchronize()
        v["times"].append(a.elapsed_time(b))
    v["peak_above"] = max(v["peak_above"], torch.cuda.max_memory_allocated() - base)


def run_model_mode(name, variants, compiled, device, steps=10, turns=5, warmup=3, profile=False):
    """Every variant of one model and mode. Eager, all alive at once and taking turns: ``turns``
    rounds of steps/turns timed steps each, so that the host's and the GPU's drift falls on all
    of them. Compiled, one after another, each in a fresh dynamo state as in a process of its
    own: compiled side by side in one session, a call may also check the other variants' cache
    entries, which is not what a user's single model pays."""
    if compiled:
        return [r for v in variants for r in _run_together(name, [v], True, device, steps, 1, warmup, profile)]
    return _run_together(name, variants, False, device, steps, turns, warmup, profile)


def _run_together(name, variants, compiled, device, steps, turns, warmup, profile):
    """The variants built and warmed up, then taking turns. peak_GiB is what a variant alone
    would hold: its own state plus its steps' peak above everything allocated before them."""
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    mode = "compile" if compiled else "eager"
    prepared, rows = {}, {}
    for variant in variants:
        try:
            prepared[variant] = _prepare(name, variant, compiled, device, warmup)
        except Exception as e:  # report, don't hide
            rows[variant] = _error_row(name, variant, mode, e)
    per_turn = max(1, steps // max(1, turns))
    for _ in range(max(1, turns)):
        for variant, v in list(prepared.items()):
            try:
                _timed_steps(v, per_turn)
            except Exception as e:
                rows[variant] = _error_row(name, variant, mode, e)
                del prepared[variant]
    for variant, v in prepared.items():
        t = v["times"]
        peak_above = v["peak_above"]
        row = dict(model=name, variant=variant, mode=mode,
                   ms=statistics.median(t), ms_min=min(t), steps=len(t), turns=turns,
                   tokens_per_s=v["tokens"] / (statistics.median(t) * 1e-3),
                   peak_GiB=(v["state"] + peak_above) / 2**30, peak_above_state_GiB=peak_above / 2**30,
                   warmup_s=v["warm_s"], first_losses=v["losses"],
                   swapped=len(v["report"].swapped) if v["report"] else 0)
        if profile:
            row["profile"] = _profile_step(v["step"])
        rows[variant] = row
    del prepared
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return [rows[v] for v in variants if v in rows]


def _error_row(name, variant, mode, e):
    return dict(model=name, variant=variant, mode=mode,
                error=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")


# Kernel name -> the op it belongs to, first match wins (the per-op breakdown of --profile).
KERNEL_GROUPS = [
    ("ours: attention", r"gpu_puzzles.*::attn_"),
    ("ours: norm(+linear)", r"gpu_puzzles.*::(ln_|layernorm_linear|fold_weight)"),
    ("ours: cross_entropy", r"gpu_puzzles.*::ce_"),
    ("ours: embedding", r"gpu_puzzles.*::emb_"),
    ("ours: other", r"gpu_puzzles"),
    ("SDPA (cuDNN / flash)", r"sdpa|flash|fmha|cudnn"),
    ("GEMM (cuBLAS / CUTLASS)", r"nvjet|cutlass|gemm|xmma|cublas"),
    ("inductor: norm", r"^triton_.*(layer_norm|rsqrt|mean_pow|pow_mean)"),
    ("inductor: loss", r"^triton_.*(log_softmax|nll_loss|cross_entropy)"),
    ("inductor: other", r"^triton_"),
    ("optimizer", r"multi_tensor_apply|fused_adam"),
    ("eager: norm", r"layer_norm|LayerNorm|RowwiseMoments|GammaBeta|rms"),
    ("eager: loss", r"log_softmax|softmax|nll_loss"),
    ("eager: embedding", r"embedding|index_select|indexSelect|indexing_backward|sort|radix"),
    ("copies and fills", r"copy|Memcpy|Memset|Fill|elementwise_kernel.*(direct_copy|CopyKernel)"),
    ("elementwise", r"elementwise|vectorized|unrolled"),
    ("reductions", r"reduce"),
]


def kernel_group(name: str) -> str:
    import re
    for label, pattern in KERNEL_GROUPS:
        if re.search(pattern, name):
            return label
    return "other"


def _profile_step(step):
    """One profiled step: every kernel's time (ms, summed over its launches) and the sums per group."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    by, count = {}, {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by[e.name] = by.get(e.name, 0.0) + e.device_time_total / 1000.0
            count[e.name] = count.get(e.name, 0) + 1
    groups = {}
    for n, ms in by.items():
        g = kernel_group(n)
        groups[g] = groups.get(g, 0.0) + ms
    kernels = [dict(kernel=n[:160], ms=ms, launches=count[n], group=kernel_group(n))
               for n, ms in sorted(by.items(), key=lambda kv: -kv[1])]
    return dict(kernel_ms=sum(by.values()), launches=sum(count.values()),
                groups=dict(sorted(groups.items(), key=lambda kv: -kv[1])), kernels=kernels)


def run(models, device, variants=None, modes=("eager", "compile"), steps=10, profile=False, log=print, turns=5):
    rows = []
    for name in models:
        for mode in modes:
            for r in run_model_mode(name, list(variants or VARIANTS), mode == "compile", device, steps=steps,
                                    turns=turns, profile=profile):
                rows.append(r)
                log(_fmt(r))
    stock = {(r["model"], r["mode"]): r.get("ms") for r in rows if r["variant"] == "stock"}
    for r in rows:
        s = stock.get((r["model"], r["mode"]))
        if s and r.get("ms"):
            r["speedup_vs_stock"] = s / r["ms"]
    return rows


def _fmt(r):
    if "error" in r:
        return f"{r['model']:6s} {r['mode']:7s} {r['variant']:22s} ERROR {r['error']}"
    return (f"{r['model']:6s} {r['mode']:7s} {r['variant']:22s} {r['ms']:8.2f} ms/step  "
            f"{r['tokens_per_s']:10.0f} tok/s  peak {r['peak_GiB']:.2f} GiB  (warm-up {r['warmup_s']:.0f} s)")


def print_breakdown(rows):
    """Per model and mode: each variant's kernel time by group (ms), from --profile."""
    from rich.console import Console
    from rich.table import Table
    for (model, mode) in dict.fromkeys((r["model"], r["mode"]) for r in rows if "profile" in r):
        rs = [r for r in rows if r["model"] == model and r["mode"] == mode and "profile" in r]
        groups = list(dict.fromkeys(g for r in rs for g in r["profile"]["groups"]))
        t = Table(title=f"{model} {mode}: kernel ms per step, by op (one profiled step)")
        t.add_column("group")
        for r in rs:
            t.add_column(r["variant"], justify="right")
        # The timed step minus its kernels: time the GPU waits on the host (launch latency,
        # syncs) once the step's kernels are summed.
        derived = {"all kernels": lambda p, r: p["kernel_ms"], "step (timed median)": lambda p, r: r["ms"],
                   "GPU idle (step - kernels)": lambda p, r: r["ms"] - p["kernel_ms"],
                   "launches": lambda p, r: p["launches"]}
        for g in groups + list(derived):
            def cell(r):
                p = r["profile"]
                v = derived[g](p, r) if g in derived else p["groups"].get(g)
                return "" if v is None else (f"{v}" if g == "launches" else f"{v:.3f}")
            t.add_row(g, *[cell(r) for r in rs])
        Console(width=140).print(t)


def print_rows(rows):
    from rich.console import Console
    from rich.table import Table
    t = Table(title="training step, bf16 (forward + loss + backward + AdamW)")
    for col in ("model", "mode", "variant", "ms/step", "tokens/s", "vs stock", "peak GiB"):
        t.add_column(col, justify="left" if col in ("model", "mode", "variant") else "right")
    for r in rows:
        if "error" in r:
            t.add_row(r["model"], r["mode"], r["variant"], r["error"][:60], "", "", "")
            continue
        sp = r.get("speedup_vs_stock")
        t.add_row(r["model"], r["mode"], r["variant"], f"{r['ms']:.2f}", f"{r['tokens_per_s']:.0f}",
                  f"{sp:.3f}x" if sp else "", f"{r['peak_GiB']:.2f}")
    Console(width=140).print(t)


def main(argv=None):
    import argparse
    import datetime
    import json

    from .common import device_name, git_commit
    p = argparse.ArgumentParser(prog="python -m gpu_puzzles.bench model", description=__doc__)
    p.add_argument("--models", default="gpt2,llama", help=f"comma-separated, of {list(MODELS)}")
    p.add_argument("--variants", default=None,
                   help=f"comma-separated, of {list(VARIANT_ALIASES)} ({VARIANT_ALIASES}; default all)")
    p.add_argument("--modes", default="eager,compile")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant, over the turns")
    p.add_argument("--turns", type=int, default=5,
                   help="eager: rounds in which the variants (all built first) take turns, steps/turns steps each")
    p.add_argument("--profile", action="store_true", help="add the per-op breakdown (one profiled step's kernels)")
    p.add_argument("--json", help="write the rows and the run's metadata here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("the model bench needs a CUDA device")
    device = torch.device("cuda")
    variants = None
    if args.variants:
        unknown = [v for v in args.variants.split(",") if v not in VARIANT_ALIASES]
        if unknown:
            p.error(f"--variants: unknown {unknown}; known: {list(VARIANT_ALIASES)}")
        variants = [VARIANT_ALIASES[v] for v in args.variants.split(",")]
    rows = run(args.models.split(","), device, variants, tuple(args.modes.split(",")), args.steps, args.profile,
               turns=args.turns)
    print_rows(rows)
    print_breakdown(rows)
    if args.json:
        import transformers
        meta = dict(device=device_name(device), torch=torch.__version__, cuda=torch.version.cuda,
                    transformers=transformers.__version__, commit=git_commit(),
                    date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    timing=f"eager: all variants of a model built and warmed up (3 steps) first, then taking "
                           f"turns in {args.turns} rounds of --steps/{args.turns} steps; compiled: one variant after "
                           f"another, each in a fresh dynamo state, 3 warm-up steps; median of a variant's steps, "
                           f"CUDA events around each; peak = the variant's own state + its steps' "
                           f"max_memory_allocated above what was allocated before them",
                    rows=rows)
        with open(args.json, "w") as f:
            json.dump(meta, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
