"""Timing and reporting shared by the benchmark CLI, the tour and the notebooks.

GPU times come from CUDA events around each call, after warm-up; we report the
median. Inputs are rotated across enough sets to exceed L2 (50 MB on the H100),
so a memory-bound kernel is timed against HBM, not cache. Outputs are kept alive
in a ring for the same reason (see OutputRing).

CPU times come from the host clock around each call, after warm-up; we report the
fastest call, since on a shared machine other work only ever adds time to a call, and
the implementations of a case take turns (CPU_ROUNDS rounds) so none gets all the noise.
"""
from __future__ import annotations

import contextlib
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


def _tensors(out) -> list:
    """The tensors in ``out``: a tensor, None, or (nested) tuples/lists/dicts of them."""
    found, stack = [], [out]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            found.append(o)
        elif isinstance(o, (tuple, list)):
            stack.extend(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
    return found


def output_bytes(out) -> int:
    """Bytes of memory the tensors in ``out`` keep alive; storages shared by several
    outputs (views of one buffer) count once."""
    seen, total = set(), 0
    for t in _tensors(out):
        st = t.untyped_storage()
        key = (st.data_ptr(), str(t.device))
        if key not in seen:
            seen.add(key)
            total += st.nbytes()
    return total


class OutputRing:
    """Keeps the results of the last ``k`` calls alive, so every call writes fresh memory.

    Why: a result dropped right after its call goes back to the caching allocator, and the
    next call gets the same address. With outputs below L2 (50 MB on the H100) the
    previous call's output lines are still in L2, dirty, and the next call's writes land
    on them and never reach HBM within the timed window: the op looks faster than memory
    (layer_norm 8192x4096 bf16 at 3.8 TB/s against a 3.0 TB/s copy ceiling). A model keeps
    its activations, so outputs must rotate like the inputs: ``k`` results of together at
    least 3x L2 stay referenced; the allocator then cycles over k+1 blocks. Keeping a
    reference costs no kernel and no sync; the oldest result is released after the
    call's end event, outside the timed window. Tensors are kept detached (an output's
    autograd graph is not kept alive). ``cap`` bounds k (and so the warm-up that fills
    the ring) for tiny outputs, whose ops are launch-bound anyway."""

    def __init__(self, per_call_bytes: int, l2_bytes: Optional[int] = None, cap: int = 256):
        l2 = L2_BYTES if l2_bytes is None else l2_bytes
        self.k = 0 if per_call_bytes <= 0 else min(cap, math.ceil(3 * l2 / per_call_bytes))
        self._slots = [None] * self.k
        self._i = 0

    def keep(self, out) -> None:
        if self.k:
            self._slots[self._i] = [t.detach() for t in _tensors(out)]  # drops the result of k calls ago
            self._i = (self._i + 1) % self.k

    def live(self) -> list:
        """The kept results (lists of tensors), oldest first."""
        return [o for o in self._slots[self._i:] + self._slots[:self._i] if o is not None]

    def clear(self) -> None:
        self._slots = [None] * self.k


_SLEEP_CYCLES_PER_MS: dict = {}


def _sleep_cycles_per_ms(device: torch.device) -> float:
    """GPU clock cycles of ``torch.cuda._sleep`` per millisecond on this device (measured once)."""
    key = str(device)
    if key not in _SLEEP_CYCLES_PER_MS:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # the first call may pay a launch/JIT cost
        a.record()
        torch.cuda._sleep(10_000_000)
        b.record()
        sync(device)
        _SLEEP_CYCLES_PER_MS[key] = 10_000_000 / max(1e-3, a.elapsed_time(b))
    return _SLEEP_CYCLES_PER_MS[key]


def time_ms(fn: Callable, sets: list, device: torch.device, warmup: int = 5, rep: int = 40,
            keep_outputs: Optional[bool] = None, backlog: bool = True, host: Optional[dict] = None) -> float:
    """Milliseconds of ``fn(*s)``, cycling s over ``sets``: the median of ``rep`` calls on
    CUDA, the fastest of them on the CPU (see the module's docstring). With ``keep_outputs``
    (default: on CUDA) the results of the last calls stay alive (OutputRing), so outputs
    are written to fresh memory; CPU timings are informative only and skip the ring's
    warm-up.

    ``backlog`` (CUDA): the GPU first sleeps for longer than the host needs to enqueue
    all the timed calls, so each call's event pair brackets only device work. Without it,
    a call that finds the GPU idle also times the host's own enqueue (H100, LayerNorm+Linear
    fwd+bwd 8192x4096x4096: eager read 1.372 ms that way, 1.294 ms of device work). The
    host's time per call is reported in ``host["ms_per_call"]`` (a dict passed in), so a
    host-bound op still shows up; ``host["times"]`` gets every call's milliseconds."""
    if keep_outputs is None:
        keep_outputs = device.type == "cuda"
    first = fn(*sets[0])
    ring = OutputRing(output_bytes(first) if keep_outputs else 0)
    ring.keep(first)
    del first
    # Every set at least once (backward_only_fn caches on it), and the ring filled, so the
    # allocator holds all its blocks before the timed calls (no cudaMalloc inside them).
    n_warm = max(warmup, len(sets), ring.k + 1)
    t0 = time.perf_counter()
    for i in range(1, n_warm):
        ring.keep(fn(*sets[i % len(sets)]))
    host_warm_ms = (time.perf_counter() - t0) * 1e3 / max(1, n_warm - 1)
    sync(device)
    if device.type == "cuda":
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(rep)]
        out = None
        if backlog:
            # 2x the warm-up's host time per call (at least 2 ms, at most 2 s) of GPU sleep.
            ms = min(2000.0, max(2.0, 2.0 * rep * host_warm_ms))
            torch.cuda._sleep(int(ms * _sleep_cycles_per_ms(device)))
        t0 = time.perf_counter()
        for i, (a, b) in enumerate(ev):
            s = sets[i % len(sets)]
            a.record()
            out = fn(*s)
            b.record()
            ring.keep(out)  # the oldest result is freed here, after the end event
        host_ms = (time.perf_counter() - t0) * 1e3 / rep
        del out
        sync(device)
        times = [a.elapsed_time(b) for a, b in ev]
        if host is not None:
            host["ms_per_call"] = host_ms
            host["times"] = times
    else:
        times, out = [], None
        for i in range(rep):
            t0 = time.perf_counter()
            out = fn(*sets[i % len(sets)])
            times.append((time.perf_counter() - t0) * 1e3)
            ring.keep(out)
        del out
        ring.clear()
        return min(times)
    ring.clear()
    return statistics.median(times)


CPU_ROUNDS = 3
CPU_TIMING = (f"host clock around each call, fastest of --rep calls after warm-up, the implementations "
              f"taking turns in {CPU_ROUNDS} rounds")


@contextlib.contextmanager
def cpu_threads(n: Optional[int]):
    """Runs the block with ``n`` intra-op CPU threads (None: leave as is), then restores."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def time_graph_ms(fn: Callable, sets: list, device: torch.device, calls: int = 20, rep: int = 20) -> float:
    """Median milliseconds per call of ``fn`` with the host out of the loop: ``calls`` calls
    (cycling over ``sets``) captured once into a CUDA graph, the graph replayed ``rep`` times.
    For small ops, where per-call timing measures the host's dispatch as much as the kernel.

    Captured results are kept in an OutputRing during capture, so the graph's pool gives
    the calls k+1 distinct output blocks in turn (a result freed at once would make every
    captured call write the same address); ``calls`` is rounded up to a multiple of k+1
    so that across replays too each block is rewritten only every k+1 calls."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up outside capture (lazy init, workspaces)
        per_call = 0
        for i in range(3):
            per_call = max(per_call, output_bytes(fn(*sets[i % len(sets)])))
    torch.cuda.current_stream(device).wait_stream(side)
    sync(device)
    ring = OutputRing(per_call)
    if ring.k:
        calls = math.ceil(calls / (ring.k + 1)) * (ring.k + 1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            ring.keep(fn(*sets[i % len(sets)]))
    ring.clear()  # the graph's private pool keeps the blocks for its replays
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


def peak_memory_rows(fns: dict, make_args: Callable[[], tuple], device: torch.device, **row) -> list:
    """One row per implementation in ``fns`` (label -> fn): ``row``'s fields, the label as
    ``impl`` and ``peak_extra_MiB`` (``peak_extra_mib``), each fn on fresh ``make_args()``
    that are freed before the next."""
    rows = []
    for label, fn in fns.items():
        args = make_args()
        try:
            peak = peak_extra_mib(fn, args, device)
        finally:
            del args
        rows.append({**row, "impl": label, "peak_extra_MiB": peak})
    return rows


def norm_linear_memory_rows(op: str, shapes, make_fns: Callable[[], dict], inputs: Callable, dtype: torch.dtype,
                            device: torch.device) -> list:
    """peak_memory_rows of one forward+backward of a Norm+Linear op per (M, H, N) in ``shapes``:
    the fns of ``make_fns()`` (asked per shape) on fresh ``inputs(M, H, N, dtype, device,
    grad=True)`` and a gradient of the (M, N) output."""
    rows = []
    for (M, H, N) in shapes:
        fns = make_fns()

        def make(M=M, H=H, N=N):
            return (*inputs(M, H, N, dtype, device, grad=True), torch.randn(M, N, device=device, dtype=dtype))

        rows += peak_memory_rows(fns, make, device, op=op, case=f"M={M} H={H} N={N}", direction="fwd+bwd",
                                 M=M, H=H, N=N, dtype=str(dtype).replace("torch.", ""))
    return rows


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
    # The CLI's run_case arguments for this case (None: run_case's defaults): the attention rows
    # take turns and pool their calls, as the LayerNorm+Linear sweep does.
    rounds: Optional[int] = None
    pooled: bool = False


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


def in_turn(items: list, r: int) -> list:
    """The order of round r when implementations take turns: each round starts one item later,
    so none always runs right after the same other one (a GPU's clock after a heavy kernel is not
    what it is after a light one)."""
    k = r % len(items) if items else 0
    return items[k:] + items[:k]


def run_case(case: Case, device: torch.device, copy_gbs: float, rep: int = 40, warmup: int = 5,
             skip: tuple = (), backlog: bool = True, rounds: Optional[int] = None,
             pooled: bool = False) -> list[dict]:
    """Time every implementation of a case; returns one row per implementation. With
    ``rounds`` (default: CPU_ROUNDS on the CPU, 1 on CUDA) the implementations take turns,
    rep/rounds calls each per round, and each keeps its fastest round; with ``pooled``
    (CUDA) each gets the median of all its calls over the rounds instead."""
    first = case.make()
    set_bytes = sum(t.numel() * t.element_size() for t in first if isinstance(t, torch.Tensor))
    sets = [first] + [case.make() for _ in range(n_sets_for(set_bytes) - 1)]
    impls = [(label, fn) for label, fn in case.impls.items() if label not in skip]
    # Taking turns, a burst of other work on a shared CPU, a cold allocator or a GPU's clock
    # drifting under a long sweep does not fall on one implementation only.
    if rounds is None:
        rounds = CPU_ROUNDS if device.type == "cpu" else 1
    best, hosts, errors, samples = {}, {}, {}, {}
    for r in range(rounds):
        for label, fn in in_turn(impls, r):
            if label in errors:
                continue
            try:
                host = {}
                ms = time_ms(fn, sets, device, warmup=warmup, rep=max(1, rep // rounds), host=host,
                             backlog=backlog)
            except Exception as e:  # report, don't hide: a failing baseline is a finding
                errors[label] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                continue
            best[label] = min(ms, best.get(label, ms))
            samples.setdefault(label, []).extend(host.get("times", [ms]))
            if "ms_per_call" in host:
                hosts[label] = host["ms_per_call"]
    rows = []
    for label, fn in impls:
        row = {"op": case.op, "case": case.name, "direction": case.direction, "impl": label, **case.params}
        if label in errors:
            row.update(ms=None, error=errors[label])
            rows.append(row)
            continue
        ms = statistics.median(samples[label]) if pooled and device.type == "cuda" else best[label]
        if label in hosts:
            row["host_ms"] = hosts[label]
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
