"""Timing and reporting shared by the benchmark CLI, the tour and the notebooks.

GPU times come from CUDA events around each call, after warm-up; we report the
median. Inputs are rotated across enough sets to exceed L2 (50 MB on the H100),
so a memory-bound kernel is timed against HBM, not cache.
"""
from __future__ import annotations

import math
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

L2_BYTES = 50 * 2**20


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def n_sets_for(bytes_per_set: int, cap: int = 8) -> int:
    """Input sets to rotate so the working set is at least 3x L2."""
    return max(1, min(cap, math.ceil(3 * L2_BYTES / max(1, bytes_per_set))))


def time_ms(fn: Callable, sets: list, device: torch.device, warmup: int = 5, rep: int = 40) -> float:
    """Median milliseconds of ``fn(*s)``, cycling s over ``sets``."""
    for i in range(max(warmup, len(sets))):  # every set at least once (backward_only_fn caches on it)
        fn(*sets[i % len(sets)])
    sync(device)
    if device.type == "cuda":
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(rep)]
        for i, (a, b) in enumerate(ev):
            s = sets[i % len(sets)]
            a.record()
            fn(*s)
            b.record()
        sync(device)
        times = [a.elapsed_time(b) for a, b in ev]
    else:
        times = []
        for i in range(rep):
            t0 = time.perf_counter()
            fn(*sets[i % len(sets)])
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_graph_ms(fn: Callable, sets: list, device: torch.device, calls: int = 20, rep: int = 20) -> float:
    """Median milliseconds per call of ``fn`` with the host out of the loop: ``calls`` calls
    (cycling over ``sets``) captured once into a CUDA graph, the graph replayed ``rep`` times.
    For small ops, where per-call timing measures the host's dispatch as much as the kernel."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up outside capture (lazy init, workspaces)
        for i in range(3):
            fn(*sets[i % len(sets)])
    torch.cuda.current_stream(device).wait_stream(side)
    sync(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(*sets[i % len(sets)])
    graph.replay()
    sync(device)
    times = []
    for _ in range(rep):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        sync(device)
        times.append(a.elapsed_time(b) / calls)
    return statistics.median(times)


def peak_extra_mib(fn: Callable, args: tuple, device: torch.device) -> float:
    """Peak CUDA memory (MiB) that one ``fn(*args)`` allocates above what is live before it;
    a first call warms up (compilation, library workspaces) and is not counted."""
    fn(*args)
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    res = fn(*args)
    sync(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del res
    return peak / 2**20


def copy_bandwidth(device: torch.device, nbytes: int = 2**30) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + bytes written)."""
    if device.type != "cuda":
        nbytes = min(nbytes, 2**26)
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), [()], device, warmup=3, rep=20)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def backward_fn(fwd: Callable, n_inputs: int) -> Callable:
    """fn(*inputs, grad_out) running forward then backward to the inputs that need grad."""

    def run(*args):
        inputs, g = args[:n_inputs], args[n_inputs]
        out = fwd(*inputs)
        leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
        return torch.autograd.grad(out, leaves, g)

    return run


def backward_only_fn(fwd: Callable, n_inputs: int) -> Callable:
    """fn(*inputs, grad_out) running only the backward: the forward runs once per input set
    (on its first call, i.e. during warm-up) and its graph is kept and replayed.

    Timing the backward directly beats (forward+backward) minus forward, whose difference of
    two medians moved by ~20% between runs."""
    graphs = {}

    def run(*args):
        inputs, g = args[:n_inputs], args[n_inputs]
        key = id(args[0])
        if key not in graphs:
            leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
            graphs[key] = (fwd(*inputs), leaves)
        out, leaves = graphs[key]
        return torch.autograd.grad(out, leaves, g, retain_graph=True)

    return run


@dataclass
class Case:
    """One benchmark case: a shape/dtype, the implementations to compare, and its traffic."""

    op: str
    name: str
    direction: str  # "fwd" or "fwd+bwd" or "bwd"
    make: Callable[[], tuple]  # fresh random inputs; for backward the last item is grad_out
    impls: dict  # label -> callable(*inputs)
    bytes: Optional[int] = None  # minimal DRAM traffic of the timed work
    flops: Optional[int] = None
    params: dict = field(default_factory=dict)


def git_commit() -> str:
    import os
    if os.environ.get("GPU_PUZZLES_COMMIT"):
        return os.environ["GPU_PUZZLES_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def run_case(case: Case, device: torch.device, copy_gbs: float, rep: int = 40, warmup: int = 5,
             skip: tuple = ()) -> list[dict]:
    """Time every implementation of a case; returns one row per implementation."""
    first = case.make()
    set_bytes = sum(t.numel() * t.element_size() for t in first if isinstance(t, torch.Tensor))
    sets = [first] + [case.make() for _ in range(n_sets_for(set_bytes) - 1)]
    rows = []
    for label, fn in case.impls.items():
        if label in skip:
            continue
        row = {"op": case.op, "case": case.name, "direction": case.direction, "impl": label, **case.params}
        try:
            ms = time_ms(fn, sets, device, warmup=warmup, rep=rep)
        except Exception as e:  # report, don't hide: a failing baseline is a finding
            row.update(ms=None, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
            rows.append(row)
            continue
        row["ms"] = ms
        if case.bytes:
            row["GB/s"] = case.bytes / (ms * 1e-3) / 1e9
            row["pct_copy"] = 100.0 * row["GB/s"] / copy_gbs if copy_gbs else None
        if case.flops:
            row["TFLOP/s"] = case.flops / (ms * 1e-3) / 1e12
        rows.append(row)
        # Forward of eager implementations only: a capture that fails part-way (autograd,
        # torch.compile) leaves the CUDA RNG in capture state for the rest of the process.
        if case.params.get("graph_timing") and device.type == "cuda" and case.direction == "fwd" \
                and label != "compile":
            # The same calls replayed from a CUDA graph: device time without host dispatch.
            g = dict(row, impl=f"{label} [graph]")
            g.pop("error", None)
            try:
                g["ms"] = time_graph_ms(fn, sets, device)
                if case.bytes:
                    g["GB/s"] = case.bytes / (g["ms"] * 1e-3) / 1e9
                    g["pct_copy"] = 100.0 * g["GB/s"] / copy_gbs if copy_gbs else None
            except Exception as e:  # e.g. an op that cannot be captured: report it
                g.update(ms=None, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
            rows.append(g)
    del sets
    return rows
