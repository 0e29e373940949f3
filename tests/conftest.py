"""Shared test fixtures: the devices under test, dtype tolerances, hypothesis profiles."""
import contextlib
import os
import time

# cuBLAS is only deterministic with a fixed workspace; PyTorch refuses matmuls under
# torch.use_deterministic_algorithms(True) without it (tests/test_reliability.py). Set
# before any cuBLAS handle exists.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

import gpu_puzzles  # noqa: F401  registers the ops

HAS_CUDA = torch.cuda.is_available()

DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
CPU_DTYPES = [torch.float32, torch.float64]
CUDA_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]

# Relative-to-scale tolerance of a result against a float64 reference.
TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}

# Property tests (tests/strategies.py): "ci" is small and derandomized (the same examples
# every run, so CI is stable and fast); "device" searches far more, randomly. Pick with
# GPU_PUZZLES_HYPOTHESIS_PROFILE=device (docs/testing.md).
_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
settings.register_profile("ci", max_examples=20, deadline=None, derandomize=True, database=None,
                          suppress_health_check=_HEALTH, print_blob=True)
settings.register_profile("device", max_examples=300, deadline=None, suppress_health_check=_HEALTH,
                          print_blob=True)
settings.load_profile(os.environ.get("GPU_PUZZLES_HYPOTHESIS_PROFILE", "ci"))

requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")

# The SIMD levels the CPU kernels are compiled for (csrc/common/cpu_isa.h), lowest first: the
# cpu_simd knob caps the run-time level, so a test over these checks every copy this CPU runs.
CPU_SIMD = ["baseline", "avx2", "avx512"]


def device_dtypes():
    """(device, dtype) pairs every op supports."""
    pairs = [("cpu", d) for d in CPU_DTYPES]
    if HAS_CUDA:
        pairs += [("cuda", d) for d in CUDA_DTYPES]
    return pairs


def assert_close_ref(actual, ref, dtype, what="", slack=0.0):
    """Compare with a float64 reference: max error relative to the reference's scale, plus
    ``slack`` (e.g. twice eager PyTorch's own error where the inputs are ill-conditioned)."""
    assert not torch.isnan(actual).any(), f"{what}: NaN in result"
    if ref.numel() == 0:
        assert actual.numel() == 0, f"{what}: {actual.numel()} elements, reference has none"
        return
    scale = max(1.0, ref.abs().max().item())
    err = (actual.double() - ref.double()).abs().max().item() if ref.numel() else 0.0
    bound = TOL[dtype] * scale * 4 + slack
    assert err <= bound, f"{what}: max error {err:.3e} > {bound:.3e} ({dtype})"


# Without the caching allocator (PYTORCH_NO_CUDA_MEMORY_CACHING=1, as in the sanitizer
# runs) freed blocks go back to the driver: nothing to poison, and the fill would only
# cost instrumented time.
POOLED = os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") != "1"


def poison_allocator(nbytes):
    """Fill `nbytes` of freed allocator memory with NaN: the next allocations reuse these
    blocks, so an output element (or workspace) a kernel fails to write shows up as NaN.
    All-ones bytes are NaN in every float format (a float32 NaN would leave every other
    fp16/bf16 element at 0)."""
    if POOLED:
        torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(0xFF)  # freed at once


# Under compute-sanitizer (tools/sanitize_queue.py sets GPU_PUZZLES_SANITIZE=1) the
# cases that repeat one kernel path over many rows or tiles, only so that persistent
# grids wrap, run with fewer of them (still more than one pass over the resident
# clusters); every path and edge shape stays. Instrumented runs are 30-100x slower.
SANITIZE = os.environ.get("GPU_PUZZLES_SANITIZE") == "1"
# Peak-memory tests read the caching allocator's statistics, which stay at zero when it is
# off (as under compute-sanitizer, so that memcheck sees every allocation's bounds).
requires_caching_allocator = pytest.mark.skipif(
    os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1", reason="memory statistics need the caching allocator")


def many(full, sanitized):
    """A repeat count: `full` normally, `sanitized` under the sanitizer."""
    return sanitized if SANITIZE else full


# racecheck costs seconds per launch of a kernel with a large shared-memory footprint, whatever
# the length (H200, 8 processes: 15-50 s per fwd+bwd case of the staged/shared-memory softmax
# variants). Its hazards come from a kernel's barrier and slot-reuse protocol, which depends on
# the path and launch shape, not on the values. So under racecheck the variant tests drop
# the repeats that only change values (softmax and log_softmax alternate over the lengths
# instead of both at each; misaligned views, which take the older kernels that the all-paths
# tests cover, are left out). memcheck, synccheck and the plain runs keep every case.
RACECHECK = SANITIZE and os.environ.get("GPU_PUZZLES_SANITIZE_TOOL") == "racecheck"


def kinds_for(i, kinds=("softmax", "log_softmax")):
    """Both kinds normally; under racecheck one, alternating with the case index i."""
    return [kinds[i % len(kinds)]] if RACECHECK else list(kinds)


def current_test():
    """The running test's id (pytest's node id with its parameters)."""
    return os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]


# Where the instrumented time goes: with GPU_PUZZLES_SANITIZE_TIMING=<file> each timed case
# appends "<test id>\t<case>\t<seconds>" to it (one line per write, appended, so the
# sanitizer's parallel processes can share the file).
_TIMING = os.environ.get("GPU_PUZZLES_SANITIZE_TIMING")
# Which kernels each case launches: with GPU_PUZZLES_RECORD_LAUNCHES=<file> each case runs
# under torch.profiler and appends a JSON line {"test", "case", "launches": [[kernel, block,
# shared memory], ...]} (our kernels); tools/racecheck_cases.py makes RACECHECK_CASES from such a record.
_RECORD = os.environ.get("GPU_PUZZLES_RECORD_LAUNCHES")


def _trace_launches(path):
    """Our kernels' launches in a saved chrome trace: (name, block, shared memory)."""
    import json
    events = json.load(open(path))["traceEvents"]
    return sorted({(e["name"], str(e["args"].get("block")), e["args"].get("shared memory"))
                   for e in events if e.get("cat") == "kernel" and "gpu_puzzles" in e["name"]})


def _launches(prof):
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        return _trace_launches(f.name)


@contextlib.contextmanager
def sanitize_timing(case):
    """Wraps one case of a test: times it (GPU_PUZZLES_SANITIZE_TIMING) or records its kernel
    launches (GPU_PUZZLES_RECORD_LAUNCHES)."""
    if _RECORD:
        import json

        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            yield
            torch.cuda.synchronize()
        with open(_RECORD, "a") as f:
            f.write(json.dumps({"test": current_test(), "case": case, "launches": _launches(prof)}) + "\n")
        return
    if not _TIMING:
        yield
        return
    t0 = time.perf_counter()
    try:
        yield
    finally:
        torch.cuda.synchronize()
        with open(_TIMING, "a") as f:
            f.write("%s\t%s\t%.2f\n" % (current_test(), case, time.perf_counter() - t0))


# Which of our kernels each test launches, test by test: with GPU_PUZZLES_RECORD_TEST_LAUNCHES=<file>
# every test runs under torch.profiler and appends {"test", "seconds", "launches"} to the file.
# One profiler runs at a time, so a test's own profiler (the kernel-choice checks, test_hf's op
# counts) pauses ours: its launches are read from the test's profiler (with CUDA activity added)
# and ours resumes after it ("launches": null only if that fails).
# tools/sanitize_cover.py picks from such a record the tests that together make every launch the
# whole suite makes: the sanitizer's test list (tools/device_run.sh, step "record").
# GPU_PUZZLES_RECORD_SKIP=<files> (records of earlier calls, .jsonl or .jsonl.gz, space-separated)
# deselects the tests they recorded, so a record cut by a time limit is finished in a later call
# (tests recorded there as null run again).
_RECORD_TESTS = os.environ.get("GPU_PUZZLES_RECORD_TEST_LAUNCHES")
_RECORD_SKIP = os.environ.get("GPU_PUZZLES_RECORD_SKIP", "").split()


def _recorded_tests(paths):
    """The tests these records hold with their launches (tools/sanitize_cover.py reads them)."""
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
    from sanitize_cover import read_records
    return {t for t, r in read_records(paths).items() if r["launches"] is not None}


if _RECORD_SKIP:
    def pytest_collection_modifyitems(config, items):
        done = _recorded_tests(_RECORD_SKIP)
        keep = [it for it in items if it.nodeid not in done]
        if len(keep) < len(items):
            config.hook.pytest_deselected(items=[it for it in items if it.nodeid in done])
            items[:] = keep


class _TestLaunches:
    """One test's launches of our kernels: the recorder's profiler, paused while the test runs a
    profiler of its own (torch.profiler.profile is swapped for _nested_profile() meanwhile)."""

    def __init__(self):
        from torch.profiler import ProfilerActivity, profile
        self.real = profile
        # (CPU activity without a GPU: no kernels to find, the same path otherwise)
        self.activity = ProfilerActivity.CUDA if HAS_CUDA else ProfilerActivity.CPU
        self.launches, self.prof = set(), None

    def resume(self):
        self.prof = self.real(activities=[self.activity])
        self.prof.__enter__()

    def pause(self):
        if self.prof is not None:
            if torch.cuda.is_initialized():
                torch.cuda.synchronize()
            self.prof.__exit__(None, None, None)
            self.launches |= set(_launches(self.prof))
            self.prof = None

    def nested_profile(self):
        rec = self

        class Nested(self.real):
            def __init__(self, *args, activities=None, **kwargs):
                acts = list(activities) if activities is not None else [torch.profiler.ProfilerActivity.CPU]
                if rec.activity not in acts:
                    acts.append(rec.activity)  # the test's counts filter by name: kernels do not enter them
                super().__init__(*args, activities=acts, **kwargs)

            def __enter__(self):
                rec.pause()
                return super().__enter__()

            def __exit__(self, *exc):
                import tempfile
                if torch.cuda.is_initialized():
                    torch.cuda.synchronize()
                out = super().__exit__(*exc)
                # A trace saves once: kept in a file, so the test can still export it (below).
                fd, self._gp_trace = tempfile.mkstemp(suffix=".json")
                os.close(fd)
                super().export_chrome_trace(self._gp_trace)
                rec.launches |= set(_trace_launches(self._gp_trace))
                rec.resume()
                return out

            def export_chrome_trace(self, path):
                import gzip
                import shutil
                opener = gzip.open if path.endswith(".gz") else open
                with open(self._gp_trace, "rb") as src, opener(path, "wb") as dst:
                    shutil.copyfileobj(src, dst)

            def __del__(self):
                if getattr(self, "_gp_trace", None):
                    with contextlib.suppress(OSError):
                        os.remove(self._gp_trace)

        return Nested


if _RECORD_TESTS:
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(item):
        import json

        import torch.profiler
        rec = _TestLaunches()
        torch.profiler.profile = rec.nested_profile()
        rec.resume()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            torch.profiler.profile = rec.real
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        try:
            rec.pause()
            launches = sorted(rec.launches)
        except RuntimeError:  # a profiler the recorder could not pause or read
            launches = None
        line = json.dumps({"test": item.nodeid, "seconds": round(seconds, 3), "launches": launches}) + "\n"
        fd = os.open(_RECORD_TESTS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())  # one write per line: xdist workers share the file
        finally:
            os.close(fd)


# Under racecheck a test listed in tests/racecheck_cases.json runs only its listed cases
# (maybe none): cases of the listed tests' racecheck profile that together launch every
# (kernel, block size, shared memory) all of them launch (recorded on an H100;
# tools/racecheck_cases.py).
# racecheck's cost is per launch of a large-shared-memory kernel, and a hazard depends on
# the kernel and its launch shape, so the other cases would repeat launches already checked.
_RC_FILE = os.path.join(os.path.dirname(__file__), "racecheck_cases.json")
RACECHECK_CASES = {}
if RACECHECK and os.path.exists(_RC_FILE):
    import json
    RACECHECK_CASES = json.load(open(_RC_FILE))["cases"]


def racecheck_skips(case):
    """Whether racecheck leaves out this case of the running test (see RACECHECK_CASES)."""
    chosen = RACECHECK_CASES.get(current_test())
    return chosen is not None and case not in chosen


# Kernels that only move data: what an op launches when it copies a strided input
# (aten's copy/contiguous/clone kernels and cudaMemcpy device-to-device).
_COPY_PATTERNS = ("copy", "Memcpy", "CatArrayBatched", "clone")


def copy_kernels(fn, *args, **kwargs):
    """Runs fn(*args, **kwargs) once under the CUDA profiler (after a warm-up call) and returns
    (result, names of the copy kernels it launched)."""
    from torch.profiler import ProfilerActivity, profile
    fn(*args, **kwargs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = fn(*args, **kwargs)
        torch.cuda.synchronize()
    import json
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    names = [e["name"] for e in events if e.get("cat") in ("kernel", "gpu_memcpy")
             and any(p in e["name"] for p in _COPY_PATTERNS)]
    return out, names


_FILL_OPS = ("aten::zeros", "aten::zeros_like", "aten::zero_", "aten::fill_")


def fill_ops(fn):
    """How many zero/fill operators fn() calls (host-side profiler; any device). The
    autograd of an op with non-differentiable outputs (statistics, lse) must add none to
    what its backward op calls: autograd would otherwise fill a zero gradient for each."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name in _FILL_OPS)


def assert_backward_fills_as_op(out, grad, backward_op):
    """out.backward(grad) calls as many zero/fill ops as ``backward_op()`` (the op's own
    backward, called directly): autograd adds none for the non-differentiable outputs."""
    with torch.no_grad():
        direct = fill_ops(backward_op)
    assert fill_ops(lambda: out.backward(grad)) == direct


def assert_compiled_matches_eager(f, cases, backend="inductor"):
    """``torch.compile(f, fullgraph=True, dynamic=True)`` against eager ``f``: for each
    ``(args, leaves)`` of ``cases`` (several sizes, which one dynamic graph must serve),
    the outputs, and the gradients of ``sum(out**2)`` with respect to ``leaves``."""
    torch._dynamo.reset()
    fc = torch.compile(f, fullgraph=True, dynamic=True, backend=backend)
    for args, leaves in cases:
        y_c, y_e = fc(*args), f(*args)
        torch.testing.assert_close(y_c, y_e)
        gc = torch.autograd.grad(y_c.square().sum(), leaves)
        ge = torch.autograd.grad(y_e.square().sum(), leaves)
        for a, b in zip(gc, ge):
            torch.testing.assert_close(a, b)
