"""Training steps on several GPUs, stock against ``gpu_puzzles.hf.patch``: DDP and FSDP2.

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=2 benchmarks/train_distributed.py \
        --strategy ddp,fsdp2 --models gpt2,llama --json results.json

One process per GPU. Each (strategy, model, precision) builds stock and patched models from the
same seed (random init from ``transformers`` configs, never downloaded) and trains each for
``--steps`` steps on the same batches (a few fixed batches in turn, so the loss falls), timing
every step with CUDA events on rank 0 after a barrier; the median of the steps after
``--warmup`` is the row, and the per-step losses of both are kept, so the curves can be
compared. Regimes:

- ``ddp``: ``DistributedDataParallel``; ``--precision bf16`` (bf16 parameters) or ``amp``
  (float32 parameters under ``torch.autocast(bf16)``).
- ``fsdp2``: ``fully_shard`` per transformer block and on the root, float32 parameters,
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32)`` (the precision flag is
  ignored: FSDP2 casts the parameters itself).

Eager only. The per-rank batch is half of the one-GPU bench's (GPT-2 4 x 1024, Llama 2 x 2048).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from gpu_puzzles.bench import model as mb

PER_RANK_BATCH = {"gpt2": 4, "llama": 2}


def _blocks(model):
    base = getattr(model, "transformer", None) or model.model
    return base.h if hasattr(base, "h") else base.layers


def _wrap(model, strategy, device):
    if strategy == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda"
                                                         else None)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in _blocks(model):
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def _batches(name, device, small, n=4):
    spec = mb.MODELS[name]
    B, S, V = (2, 32, 211) if small else (PER_RANK_BATCH[name], spec["seq"], spec["config"]["vocab_size"])
    g = torch.Generator().manual_seed(1234 + dist.get_rank())  # each rank its own data, every variant the same
    return [torch.randint(0, V, (B, S), generator=g).to(device) for _ in range(n)]


class _Timer:
    """CUDA events around a step; wall-clock on the CPU (the --small check)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.a, self.b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.a.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.b.record()
            self.b.synchronize()
            self.ms = self.a.elapsed_time(self.b)
        else:
            self.ms = (time.perf_counter() - self.t0) * 1e3


def run_one(name, variant, strategy, precision, steps, warmup, device, small=False):
    import gpu_puzzles.hf as hf
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    param_dtype = torch.float32 if strategy == "fsdp2" or precision == "amp" else torch.bfloat16
    amp = precision == "amp" and strategy == "ddp"
    model = mb.build(name, device, dtype=param_dtype, seed=0, small=small)
    if variant == "ours":
        hf.patch(model)
    model.train()
    wrapped = _wrap(model, strategy, device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device.type == "cuda")
    batches = _batches(name, device, small)
    times, losses = [], []
    for i in range(steps + warmup):
        ids = batches[i % len(batches)]
        dist.barrier()
        with _Timer(device) as timer:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                loss = wrapped(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(timer.ms)
        losses.append(float(loss.detach()))
    t = torch.tensor([statistics.median(times)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the step is as slow as the slowest rank
    row = dict(model=name, variant=variant, strategy=strategy, precision="fsdp2-mp-bf16" if strategy == "fsdp2"
               else precision, world=dist.get_world_size(), per_rank_batch=batches[0].shape[0],
               seq=batches[0].shape[1], ms=float(t.item()), ms_rank0=statistics.median(times), steps=len(times),
               peak_GiB=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
               loss_dtype=str(loss.dtype).replace("torch.", ""), losses=losses)
    row["tokens_per_s"] = row["world"] * row["per_rank_batch"] * row["seq"] / (row["ms"] * 1e-3)
    del wrapped, model, opt
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategy", default="ddp,fsdp2")
    p.add_argument("--models", default="gpt2,llama")
    p.add_argument("--precision", default="bf16,amp", help="for ddp: bf16 parameters, or float32 under autocast")
    p.add_argument("--variants", default="stock,ours")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json")
    p.add_argument("--small", action="store_true", help="tiny models on the CPU (gloo): a check of the script")
    args = p.parse_args()
    dist.init_process_group("gloo" if args.small else "nccl")
    rank = dist.get_rank()
    if args.small:
        device = torch.device("cpu")
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = torch.device("cuda", torch.cuda.current_device())
    rows = []
    for strategy in args.strategy.split(","):
        for name in args.models.split(","):
            for precision in (args.precision.split(",") if strategy == "ddp" else ["bf16"]):
                for variant in args.variants.split(","):
                    try:
                        r = run_one(name, variant, strategy, precision, args.steps, args.warmup, device, args.small)
                    except Exception as e:  # report, don't hide
                        r = dict(model=name, variant=variant, strategy=strategy, precision=precision,
                                 error=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
                    rows.append(r)
                    if rank == 0:
                        print(f"{strategy:6s} {name:6s} {r['precision']:14s} {variant:6s} "
                              + (f"{r['ms']:8.2f} ms/step  loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}"
                                 if "ms" in r else f"ERROR {r['error']}"), flush=True)
    key = lambda r: (r["strategy"], r["model"], r.get("precision"))  # noqa: E731
    stock = {key(r): r.get("ms") for r in rows if r["variant"] == "stock"}
    for r in rows:
        s = stock.get(key(r))
        if s and r.get("ms"):
            r["speedup_vs_stock"] = s / r["ms"]
            ref = next(x for x in rows if x["variant"] == "stock" and key(x) == key(r))
            r["max_loss_diff_vs_stock"] = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"]))
    if rank == 0:
        for r in rows:
            if "speedup_vs_stock" in r and r["variant"] != "stock":
                print(f"{r['strategy']:6s} {r['model']:6s} {r['precision']:14s} {r['variant']:6s} "
                      f"{r['speedup_vs_stock']:.3f}x stock, max |loss - stock's| {r['max_loss_diff_vs_stock']:.4f}")
        if args.json:
            import transformers
            meta = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                        world=dist.get_world_size(), torch=torch.__version__,
                        transformers=transformers.__version__,
                        commit=os.environ.get("GPU_PUZZLES_COMMIT", "unknown"),
                        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                        timing="CUDA events on rank 0 around each step after a barrier; row = max over ranks of "
                               "each rank's median after warm-up", rows=rows)
            with open(args.json, "w") as f:
                json.dump(meta, f, indent=1)
    # Both ranks tear down together: rank 1 destroying gloo's group while rank 0 still wrote its
    # results aborted rank 1 now and then ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
