"""``python -m gpu_puzzles.bench model``: Hugging Face models, stock vs ``gpu_puzzles.hf.patch``.

A training step (forward with the LM loss, backward, fused AdamW step, zero_grad) of models
built from ``transformers`` configs with random weights (never downloaded), timed as the
median of CUDA-event-bracketed steps after warm-up, with the step's peak allocated memory.
``--precision`` picks how the model trains (``PRECISIONS``): bf16 parameters; float32
parameters under ``torch.autocast(bf16)`` (what ``Trainer(bf16=True)``, accelerate and
Lightning's bf16-mixed do); or under autocast(fp16) with a ``GradScaler``.
``--grad-ckpt`` turns on transformers' gradient checkpointing (reentrant or not).
``--trainer`` times ``transformers.Trainer`` itself (bf16=True or fp16=True, through
accelerate) instead of the hand-written step. Eager, the variants of one model are all built
first and take turns (``--turns``), so that drift of the host or the GPU does not fall on one
of them; compiled, each runs in a fresh dynamo state. Variants: stock, patched with attention
left to SDPA (``attention=False``), fully patched, and fully patched with the fused LM head +
loss (``fused_loss=True``); each eager and under ``torch.compile`` (``--modes``: ``compile``,
``reduce-overhead`` and ``max-autotune``, the last two replaying CUDA graphs). ``--profile`` adds the
per-op breakdown: one profiled step's CUDA kernels, each and summed by group (``KERNEL_GROUPS``).
"""
from __future__ import annotations

import gc
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
    # Qwen3-1.7B's shape (hidden 2048, 16 heads / 8 kv heads of 128, intermediate 6144, vocab
    # 151936, tied embeddings, per-head q/k norms), shortened from 28 layers to the Llama's 16.
    "qwen3": dict(kind="qwen3", batch=4, seq=2048,
                  config=dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16,
                              num_key_value_heads=8, head_dim=128, intermediate_size=6144, vocab_size=151936,
                              max_position_embeddings=4096, tie_word_embeddings=True)),
    # Gemma-2-2B's shape (hidden 2304, 8 heads / 4 kv heads of 256, intermediate 9216, vocab 256000,
    # (1 + weight) norms, sliding windows of 4096 on alternate layers, attention and final-logit
    # soft-capping), shortened from 26 layers to 13, at 2 x 2048 tokens: at 4 x 2048 stock ran out of an
    # H100's 80 GB (its eager attention keeps (B, 8, S, S) scores in bf16 and float32 per layer, its
    # capped loss several float32 copies of the B*S x 256000 logits), ours peaked at 49 GiB. Stock runs
    # transformers' eager attention (SDPA cannot soft-cap), and so does the patched model.
    "gemma2": dict(kind="gemma2", batch=2, seq=2048, attn="eager",
                   config=dict(hidden_size=2304, num_hidden_layers=13, num_attention_heads=8,
                               num_key_value_heads=4, head_dim=256, intermediate_size=9216, vocab_size=256000,
                               max_position_embeddings=8192, sliding_window=4096, query_pre_attn_scalar=256,
                               attn_logit_softcapping=50.0, final_logit_softcapping=30.0)),
}
# kind -> the transformers class name's prefix (<Prefix>Config, <Prefix>ForCausalLM).
_CLASSES = {"llama": "Llama", "qwen3": "Qwen3", "gemma2": "Gemma2"}
# head_dim 64: a head dim our tensor-core attention kernels take, so the CUDA tests run our
# attention inside the models (other head dims go to SDPA on CUDA: hf._kernels_take).
_SMALL_DECODER = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, intermediate_size=128, vocab_size=211, max_position_embeddings=64)
VARIANTS = {
    "stock": None,
    "ours, SDPA attention": dict(attention=False),
    "ours": dict(),
    "ours, fused LM head + loss": dict(fused_loss=True),
    "ours, stock RoPE": dict(rotary=False),  # not in the default set: what our rotary buys
}
DEFAULT_VARIANTS = [v for v in VARIANTS if v != "ours, stock RoPE"]
# --precision: (parameter dtype, autocast dtype or None, GradScaler).
PRECISIONS = {
    "bf16": (torch.bfloat16, None, False),
    "amp": (torch.float32, torch.bfloat16, False),
    "amp-fp16": (torch.float32, torch.float16, True),
}
# Short names for --variants (the variant names themselves hold commas).
VARIANT_ALIASES = {"stock": "stock", "sdpa": "ours, SDPA attention", "ours": "ours",
                   "fused": "ours, fused LM head + loss", "stock-rope": "ours, stock RoPE"}


def build(name: str, device, dtype=torch.bfloat16, seed: int = 0, small: bool = False):
    """A random-init model from its config (no download); ``small`` shrinks it for CPU tests."""
    import transformers
    spec = MODELS[name]
    cfg = dict(spec["config"])
    if small:
        cfg.update({"gpt2": dict(n_layer=2, n_embd=128, n_head=2, vocab_size=211, n_positions=64),
                    "llama": _SMALL_DECODER, "qwen3": _SMALL_DECODER,
                    "gemma2": dict(_SMALL_DECODER, sliding_window=16)}[name])
    torch.manual_seed(seed)
    if spec["kind"] == "gpt2":
        config = transformers.GPT2Config(**cfg, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
                                         bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(config)
    else:
        prefix = _CLASSES[spec["kind"]]
        config = getattr(transformers, prefix + "Config")(**cfg, attention_dropout=0.0, bos_token_id=0,
                                                          eos_token_id=0, pad_token_id=None)
        model = getattr(transformers, prefix + "ForCausalLM")(config)
    # transformers' default loss, named, so the stock path does not warn (a graph break
    # under torch.compile) about an unset loss_type.
    model.loss_type = "ForCausalLM"
    config._attn_implementation = spec.get("attn", "sdpa")
    return model.to(device=device, dtype=dtype)


def batch(name: str, device, small: bool = False, seed: int = 1):
    spec = MODELS[name]
    B, S = (2, 32) if small else (spec["batch"], spec["seq"])
    V = 211 if small else spec["config"]["vocab_size"]
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, V, (B, S), generator=g).to(device)
    return ids


def grad_ckpt(model, how):
    """transformers' gradient checkpointing: ``how`` None (off), "reentrant" or "nonreentrant"."""
    if how:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": how == "reentrant"})
        model.train()


# --modes: eager, or torch.compile's mode of that name ("compile": its default).
MODES = {"eager": None, "compile": "default", "reduce-overhead": "reduce-overhead", "max-autotune": "max-autotune"}
# The compile modes that replay the forward and backward as CUDA graphs.
_GRAPHED = ("reduce-overhead", "max-autotune")


def _step_fn(model, opt, ids, mode, precision="bf16"):
    """One training step as a user writes it for the regime: autocast around the forward and
    the loss, the backward outside it, a GradScaler for fp16. Under CUDA graphs each step is
    marked as a new iteration and the loss copied out of the graph's memory, which the next
    replay overwrites (torch.compile's documented training-loop use)."""
    fwd = model if mode == "eager" else torch.compile(model, mode=MODES[mode])
    graphed = mode in _GRAPHED
    _, amp, scaled = PRECISIONS[precision]
    scaler = torch.amp.GradScaler("cuda") if scaled else None

    def step():
        if graphed:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", dtype=amp, enabled=amp is not None):
            loss = fwd(input_ids=ids, labels=ids).loss
        if graphed:
            loss = loss.clone()
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    step.scaler = scaler
    return step


def _prepare(name, variant, mode, device, warmup=3, precision="bf16", ckpt=None):
    """One variant built, patched and warmed up (compiled on its first steps); its memory state
    (parameters, optimizer state, inputs) is what it added to the allocated bytes."""
    import gpu_puzzles.hf as hf
    torch.cuda.synchronize()
    before, reserved_before = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    model = build(name, device, dtype=PRECISIONS[precision][0])
    grad_ckpt(model, ckpt)
    report = hf.patch(model, **VARIANTS[variant]) if VARIANTS[variant] is not None else None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = batch(name, device)
    step = _step_fn(model, opt, ids, mode, precision)
    t0 = time.time()
    outs = [step() for _ in range(warmup)]
    warm_s = time.time() - t0
    torch.cuda.synchronize()
    return dict(step=step, tokens=ids.numel(), losses=[float(o) for o in outs], warm_s=warm_s,
                state=torch.cuda.memory_allocated() - before, reserved_before=reserved_before, report=report,
                times=[], peak_above=0,
                loss_dtype=str(outs[-1].dtype).replace("torch.", ""))


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


def run_model_mode(name, variants, mode, device, steps=10, turns=5, warmup=3, profile=False, precision="bf16",
                   ckpt=None):
    """Every variant of one model and mode. Eager, all alive at once and taking turns: ``turns``
    rounds of steps/turns timed steps each, so that the host's and the GPU's drift falls on all
    of them. Compiled, one after another, each in a fresh dynamo state as in a process of its
    own: compiled side by side in one session, a call may also check the other variants' cache
    entries, which is not what a user's single model pays."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
    if mode != "eager":
        return [r for v in variants
                for r in _run_together(name, [v], mode, device, steps, 1, warmup, profile, precision, ckpt)]
    return _run_together(name, variants, mode, device, steps, turns, warmup, profile, precision, ckpt)


def _run_together(name, variants, mode, device, steps, turns, warmup, profile, precision="bf16", ckpt=None):
    """The variants built and warmed up, then taking turns. peak_GiB is what a variant alone
    would hold: its own state plus its steps' peak above everything allocated before them."""
    torch._dynamo.reset()
    _free_memory()
    prepared, rows = {}, {}
    for variant in variants:
        try:
            prepared[variant] = _prepare(name, variant, mode, device, warmup, precision, ckpt)
        except Exception as e:  # report, don't hide
            rows[variant] = _error_row(name, variant, mode, e, precision, ckpt)
    per_turn = max(1, steps // max(1, turns))
    for _ in range(max(1, turns)):
        for variant, v in list(prepared.items()):
            try:
                _timed_steps(v, per_turn)
            except Exception as e:
                rows[variant] = _error_row(name, variant, mode, e, precision, ckpt)
                del prepared[variant]
    for variant, v in prepared.items():
        t = v["times"]
        if mode in _GRAPHED:
            # A replayed graph allocates nothing: its activations live in the graph's private pool,
            # taken at capture, so max_memory_allocated saw only the gradients (H100: stock and ours
            # alike, 2.45 GiB for GPT-2 under amp). What the variant holds is the memory reserved
            # since before it was built (the caching allocator was emptied then).
            memory = dict(peak_GiB=(torch.cuda.memory_reserved() - v["reserved_before"]) / 2**30,
                          peak_above_state_GiB=None, peak_kind="reserved")
        else:
            memory = dict(peak_GiB=(v["state"] + v["peak_above"]) / 2**30, peak_above_state_GiB=v["peak_above"] / 2**30,
                          peak_kind="allocated")
        row = dict(model=name, variant=variant, mode=mode, precision=precision, grad_ckpt=ckpt or "off",
                   ms=statistics.median(t), ms_min=min(t), steps=len(t), turns=turns,
                   tokens_per_s=v["tokens"] / (statistics.median(t) * 1e-3), **memory,
                   warmup_s=v["warm_s"], first_losses=v["losses"], loss_dtype=v["loss_dtype"],
                   swapped=len(v["report"].swapped) if v["report"] else 0)
        if profile:
            row["profile"] = _profile_step(v["step"])
        rows[variant] = row
    del prepared
    torch._dynamo.reset()
    _free_memory()
    return [rows[v] for v in variants if v in rows]


def _free_memory():
    """The models of the previous case freed before the next is built: the first model a process
    builds (stock or patched) sits in a reference cycle, so ``del`` alone left its parameters and
    optimizer state on the GPU until Python's collector ran (likely why an H100 run's stock amp
    row ran out of memory after the bf16 case)."""
    gc.collect()
    torch.cuda.empty_cache()


def _error_row(name, variant, mode, e, precision="bf16", ckpt=None):
    return dict(model=name, variant=variant, mode=mode, precision=precision, grad_ckpt=ckpt or "off",
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


def run(models, device, variants=None, modes=("eager", "compile"), steps=10, profile=False, log=print, turns=5,
        precisions=("bf16",), ckpts=(None,), on_row=None):
    """Every (model, precision, checkpointing, mode) case; ``on_row(rows)`` after each row, so a
    run cut short by a time limit still leaves what it measured."""
    rows = []
    for name in models:
        for precision in precisions:
            for ckpt in ckpts:
                for mode in modes:
                    for r in run_model_mode(name, list(variants or DEFAULT_VARIANTS), mode, device,
                                            steps=steps, turns=turns, profile=profile, precision=precision, ckpt=ckpt):
                        rows.append(r)
                        log(_fmt(r))
                        if on_row:
                            add_speedups(rows)
                            on_row(rows)
    add_speedups(rows)
    return rows


def _regime(r):
    return (r["model"], r["mode"], r.get("precision", "bf16"), r.get("grad_ckpt", "off"), r.get("trainer", False))


def add_speedups(rows):
    """speedup_vs_stock: stock's time over the row's, in the same model, mode and regime."""
    stock = {_regime(r): r.get("ms") for r in rows if r["variant"] == "stock"}
    for r in rows:
        s = stock.get(_regime(r))
        if s and r.get("ms"):
            r["speedup_vs_stock"] = s / r["ms"]


def _fmt(r):
    what = f"{r['model']:6s} {r['mode']:15s} {r.get('precision', 'bf16'):8s} ckpt={r.get('grad_ckpt', 'off'):12s}"
    if r.get("trainer"):
        what += " Trainer"
    if "error" in r:
        return f"{what} {r['variant']:22s} ERROR {r['error']}"
    return (f"{what} {r['variant']:22s} {r['ms']:8.2f} ms/step  "
            f"{r['tokens_per_s']:10.0f} tok/s  peak {_peak(r)} GiB  (warm-up {r['warmup_s']:.0f} s)")


def _peak(r):
    return f"{r['peak_GiB']:.2f}" + (" reserved" if r.get("peak_kind") == "reserved" else "")


# ---- transformers.Trainer ---------------------------------------------------------------

def run_trainer(name, variants, device, precision="amp", ckpt=None, steps=10, warmup=3, log=print):
    """``transformers.Trainer`` as a user runs it: float32 parameters, ``bf16=True`` (or
    ``fp16=True`` for amp-fp16), its own fused AdamW, one batch of the bench's shape per step.
    Each step's time is taken at its end (``on_step_end``, after a device sync); the median of
    the steps after ``warmup``. One variant after another, each in a fresh model."""
    import tempfile

    import transformers

    import gpu_puzzles.hf as hf
    spec = MODELS[name]
    param_dtype, amp, _ = PRECISIONS[precision]
    rows = []

    class _Clock(transformers.TrainerCallback):
        def __init__(self):
            self.t = []

        def on_step_end(self, args, state, control, **kw):
            torch.cuda.synchronize()
            self.t.append(time.perf_counter())

    for variant in variants:
        _free_memory()  # the previous variant's model too: its peak is read absolute below
        try:
            model = build(name, device, dtype=param_dtype)
            grad_ckpt(model, ckpt)
            report = hf.patch(model, **VARIANTS[variant]) if VARIANTS[variant] is not None else None
            ids = batch(name, "cpu")
            data = [dict(input_ids=ids[i % len(ids)], labels=ids[i % len(ids)])
                    for i in range((steps + warmup) * spec["batch"])]
            with tempfile.TemporaryDirectory() as out:
                args = transformers.TrainingArguments(
                    output_dir=out, per_device_train_batch_size=spec["batch"], max_steps=steps + warmup,
                    bf16=amp == torch.bfloat16, fp16=amp == torch.float16, optim="adamw_torch_fused",
                    learning_rate=1e-4, logging_strategy="no", save_strategy="no", report_to=[],
                    dataloader_num_workers=0, disable_tqdm=True, gradient_checkpointing=False)
                clock = _Clock()
                trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[clock])
                torch.cuda.reset_peak_memory_stats()
                out_metrics = trainer.train()
            dt = [(b - a) * 1e3 for a, b in zip(clock.t[warmup - 1:], clock.t[warmup:])]
            rows.append(dict(model=name, variant=variant, mode="eager", precision=precision, grad_ckpt=ckpt or "off",
                             trainer=True, ms=statistics.median(dt), ms_min=min(dt), steps=len(dt),
                             tokens_per_s=ids.numel() / (statistics.median(dt) * 1e-3),
                             samples_per_s=spec["batch"] / (statistics.median(dt) * 1e-3),
                             peak_GiB=torch.cuda.max_memory_allocated() / 2**30, warmup_s=0.0,
                             train_loss=out_metrics.training_loss, swapped=len(report.swapped) if report else 0))
            del trainer, model
        except Exception as e:  # report, don't hide
            rows.append(dict(_error_row(name, variant, "eager", e, precision, ckpt), trainer=True))
        log(_fmt(rows[-1]))
    return rows


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
    t = Table(title="training step (forward + loss + backward + AdamW)")
    left = ("model", "mode", "regime", "variant")
    for col in left + ("ms/step", "tokens/s", "vs stock", "peak GiB"):
        t.add_column(col, justify="left" if col in left else "right")
    for r in rows:
        regime = r.get("precision", "bf16") + ("" if r.get("grad_ckpt", "off") == "off" else f", ckpt {r['grad_ckpt']}")
        regime += ", Trainer" if r.get("trainer") else ""
        if "error" in r:
            t.add_row(r["model"], r["mode"], regime, r["variant"], r["error"][:60], "", "", "")
            continue
        sp = r.get("speedup_vs_stock")
        t.add_row(r["model"], r["mode"], regime, r["variant"], f"{r['ms']:.2f}", f"{r['tokens_per_s']:.0f}",
                  f"{sp:.3f}x" if sp else "", _peak(r))
    Console(width=140).print(t)


def main(argv=None):
    import argparse
    import datetime
    import json

    from .common import device_name, git_commit
    p = argparse.ArgumentParser(prog="python -m gpu_puzzles.bench model", description=__doc__)
    p.add_argument("--models", default="gpt2,llama", help=f"comma-separated, of {list(MODELS)}")
    p.add_argument("--variants", default=None,
                   help=f"comma-separated, of {list(VARIANT_ALIASES)} ({VARIANT_ALIASES}; default all but stock-rope)")
    p.add_argument("--modes", default="eager,compile",
                   help=f"comma-separated, of {list(MODES)}: eager, or torch.compile's mode of that name "
                        f"(compile: its default)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant, over the turns")
    p.add_argument("--turns", type=int, default=5,
                   help="eager: rounds in which the variants (all built first) take turns, steps/turns steps each")
    p.add_argument("--profile", action="store_true", help="add the per-op breakdown (one profiled step's kernels)")
    p.add_argument("--precision", default="bf16",
                   help=f"comma-separated, of {list(PRECISIONS)}: bf16 parameters, or float32 parameters under "
                        f"autocast bf16 (amp) / fp16 with a GradScaler (amp-fp16)")
    p.add_argument("--grad-ckpt", default="off",
                   help="comma-separated, of off, reentrant, nonreentrant: transformers' gradient checkpointing")
    p.add_argument("--trainer", action="store_true",
                   help="time transformers.Trainer (bf16=True / fp16=True per --precision; eager) instead of the "
                        "hand-written step")
    p.add_argument("--json", help="write the rows and the run's metadata here")
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    if any(m not in MODES for m in modes):
        p.error(f"--modes: unknown {[m for m in modes if m not in MODES]}; known: {list(MODES)}")
    if not torch.cuda.is_available():
        p.error("the model bench needs a CUDA device")
    device = torch.device("cuda")
    variants = None
    if args.variants:
        unknown = [v for v in args.variants.split(",") if v not in VARIANT_ALIASES]
        if unknown:
            p.error(f"--variants: unknown {unknown}; known: {list(VARIANT_ALIASES)}")
        variants = [VARIANT_ALIASES[v] for v in args.variants.split(",")]
    precisions = args.precision.split(",")
    ckpts = [None if c == "off" else c for c in args.grad_ckpt.split(",")]
    bad = [p for p in precisions if p not in PRECISIONS] + [c for c in ckpts if c not in (None, "reentrant",
                                                                                          "nonreentrant")]
    if bad:
        p.error(f"unknown --precision / --grad-ckpt values {bad}")
    import transformers
    meta = dict(device=device_name(device), torch=torch.__version__, cuda=torch.version.cuda,
                transformers=transformers.__version__, commit=git_commit(),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                timing=f"eager: all variants of a model built and warmed up (3 steps) first, then taking "
                       f"turns in {args.turns} rounds of --steps/{args.turns} steps; compiled: one variant after "
                       f"another, each in a fresh dynamo state, 3 warm-up steps; median of a variant's steps, "
                       f"CUDA events around each; peak = the variant's own state + its steps' "
                       f"max_memory_allocated above what was allocated before them (CUDA-graph modes: the "
                       f"memory reserved since before the variant was built, peak_kind 'reserved')")

    def save(rows):  # after every row: a run stopped by a time limit keeps what it measured
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(meta, rows=rows), f, indent=1)

    if args.trainer:
        rows = [r for name in args.models.split(",") for prec in precisions for c in ckpts
                for r in run_trainer(name, list(variants or ["stock", "ours"]), device, prec, c, args.steps)]
        add_speedups(rows)
    else:
        rows = run(args.models.split(","), device, variants, tuple(modes), args.steps, args.profile,
                   turns=args.turns, precisions=precisions, ckpts=ckpts, on_row=save)
    print_rows(rows)
    print_breakdown(rows)
    if args.json:
        save(rows)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
