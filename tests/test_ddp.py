"""DistributedDataParallel over 2 (or more) GPUs with the package's modules (issue 7).

A small model, Embedding -> Conv1d -> LayerNormLinear -> LogSoftmax (NLL) + Softmax term,
takes one step under DDP with NCCL, each rank holding 1/world of the batch; its averaged
gradients must equal those of one GPU on the full batch from the same weights. Runs on
every GPU the machine has (2, 4, 8); skipped below 2.
"""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import gpu_puzzles as gp

WORLD = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(WORLD < 2, reason="needs 2 or more CUDA devices")

V, E, L, K = 37, 16, 29, 4  # odd sizes on purpose
PER_RANK = 3  # sequences per rank


class TinyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = gp.nn.Embedding(V, E, padding_idx=0)
        self.conv = gp.nn.Conv1d(channels=E, kernel_size=K, causal=True)
        self.head = gp.nn.LayerNormLinear(E, V)
        self.log_softmax = gp.nn.LogSoftmax(-1)
        self.softmax = gp.nn.Softmax(-1)

    def forward(self, tokens, targets):
        h = self.embed(tokens)  # (B, L, E)
        h = h + self.conv(h.transpose(1, 2)).transpose(1, 2)  # depthwise over time, residual
        logits = self.head(h)  # (B, L, V)
        nll = F.nll_loss(self.log_softmax(logits).reshape(-1, V), targets.reshape(-1))
        # a second term through Softmax, so its backward is in the step too
        return nll + 0.1 * self.softmax(logits).square().sum(-1).mean()


def _data(world):
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, V, (world * PER_RANK, L), generator=g)
    targets = torch.randint(0, V, (world * PER_RANK, L), generator=g)
    torch.manual_seed(0)
    return TinyModel().state_dict(), tokens, targets


def _worker(rank, world, init_file, out_dir, device_type="cuda"):
    # device_type="cpu" (gloo) only exists to check this file's logic on a machine without GPUs
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world, device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        state, tokens, targets = _data(world)
        model = TinyModel().to(dev)
        model.load_state_dict(state)
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[rank] if device_type == "cuda" else None)
        shard = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        loss = ddp(tokens[shard].to(dev), targets[shard].to(dev))
        loss.backward()
        if device_type == "cuda":
            torch.cuda.synchronize()
        grads = {n: p.grad.detach().cpu() for n, p in model.named_parameters()}
        torch.save({"grads": grads, "loss": loss.detach().cpu()}, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_ddp_gradients_match_one_gpu(tmp_path):
    check_ddp(tmp_path, WORLD, "cuda")


def check_ddp(tmp_path, world, device_type):
    mp.spawn(_worker, args=(world, str(tmp_path / "store"), str(tmp_path), device_type), nprocs=world, join=True)

    # one device, the full batch, the same weights
    state, tokens, targets = _data(world)
    model = TinyModel().to(device_type)
    model.load_state_dict(state)
    loss = model(tokens.to(device_type), targets.to(device_type))
    loss.backward()
    ref = {n: p.grad.detach().cpu() for n, p in model.named_parameters()}

    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    # each rank's loss is its shard's mean: their average is the full-batch loss
    mean_loss = torch.stack([r["loss"] for r in results]).mean()
    torch.testing.assert_close(mean_loss, loss.detach().cpu(), rtol=1e-5, atol=1e-6)
    assert set(ref) == set(results[0]["grads"]) and len(ref) == 7
    for r, res in enumerate(results):
        for name, g_ref in ref.items():
            g = res["grads"][name]
            assert torch.isfinite(g).all(), f"rank {r} {name}: non-finite gradient"
            # the all-reduce sums in another order than one GPU does: float32 rounding only
            torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-5, msg=lambda m: f"rank {r} {name}: {m}")
            if r:  # every replica holds the same averaged gradient, bit for bit
                assert torch.equal(g, results[0]["grads"][name]), f"rank {r} {name} differs from rank 0"
