"""Reliability over every op (issue 7): hostile input and the CUDA context afterwards, the
current stream, the device guard (cuda:1), CUDA graphs, torch.compile(mode="reduce-overhead"),
run-to-run bit-identity, the deterministic backward, and tensors past 2^31 elements.

The checks run over OPS, one OpCase row per op. A new op (attention) adds one row: its
callable, an input maker, the argument names its error messages use, each argument's role,
and a float64 reference. The huge-tensor tests at the end are per op (each needs its own
slicing) and device-only.
"""
import functools
import gc
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICES, HAS_CUDA, assert_close_ref, requires_cuda
from strategies import grad_close

import gpu_puzzles as gp
from gpu_puzzles.bench.conv1d import reference as conv1d_ref
from gpu_puzzles.bench.embedding import reference as embedding_ref
from gpu_puzzles.bench.embedding import reference_grad as embedding_ref_grad

ERRORS = (RuntimeError, ValueError, TypeError)
TWO_GPUS = HAS_CUDA and torch.cuda.device_count() >= 2
requires_2_gpus = pytest.mark.skipif(not TWO_GPUS, reason="needs 2 CUDA devices")


@dataclass
class OpCase:
    name: str
    fn: Callable  # fn(*inputs) -> Tensor
    # make(gen, n) -> inputs on the CPU: float64 for "float" roles, int64 for "index", or None;
    # n >= 1 scales the leading (batch) extent, for tests that want many blocks/threads.
    make: Callable
    names: tuple  # each input's name, as the op's error messages spell it
    roles: tuple  # "float" | "index", per input
    ref: Callable  # ref(*float64 inputs) -> float64 output, differentiable
    # (label, call(inputs) -> anything, name the message must contain): wrong shapes and arguments
    bad_calls: list = field(default_factory=list)
    differentiable: bool = True
    deterministic_backward_always: bool = True  # False: bit-identical only under use_deterministic_algorithms

    def inputs(self, device, dtype=torch.float32, seed=0, n=1, requires_grad=False):
        g = torch.Generator().manual_seed(seed)
        out = []
        for t, role in zip(self.make(g, n), self.roles):
            if t is None:
                out.append(None)
            elif role == "float":
                out.append(t.to(device, dtype).requires_grad_(requires_grad and self.differentiable))
            else:
                out.append(t.to(device))
        return out

    def leaves(self, inputs):
        return [t for t, r in zip(inputs, self.roles) if t is not None and r == "float"]

    def __repr__(self):
        return self.name


def _randn(g, *shape):
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _conv1d_make(g, n):
    return [_randn(g, 2 * n, 3, 37), _randn(g, 3, 4), _randn(g, 3)]


_embedding_2d = functools.partial(gp.embedding, algorithm="2d")


def _embedding_make(g, n):
    idx = torch.randint(-1, 11, (4 * n, 9), generator=g)  # -1 and 10: out of range
    idx[0, :5] = 3  # a repeated row: the backward must sum
    return [idx, _randn(g, 10, 16)]


def _softmax_make(g, n):
    return [_randn(g, 5 * n, 33) * 4]


def _ln_make(g, n):
    return [_randn(g, 4 * n, 7, 24) + 0.5, 1 + 0.3 * _randn(g, 24), _randn(g, 24)]


def _lnl_make(g, n):
    return [_randn(g, 3 * n, 5, 24) + 0.5, 1 + 0.3 * _randn(g, 24), _randn(g, 24), _randn(g, 16, 24) / 5, _randn(g, 16)]


def _lnl_ref(x, lw, lb, W, b):
    return F.linear(F.layer_norm(x, (x.shape[-1],), lw, lb), W, b)


def _attn_make(g, n):
    # Sq != Sk and D != Dv: the SIMT kernels on CUDA (the tensor-core path has its own tests)
    return [_randn(g, 2 * n, 3, 9, 16), _randn(g, 2 * n, 3, 11, 16), _randn(g, 2 * n, 3, 11, 8)]


def _attn_ref(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _ce_make(g, n):
    t = torch.randint(0, 37, (4 * n, 5), generator=g)
    t[0, :2] = -100  # ignored rows
    # F's layout (N, C, d1) as a view of (N, d1, C) rows, as a language model's logits come.
    return [(_randn(g, 4 * n, 5, 37) * 3).transpose(1, 2), t]


def _ce_ref(x, t):
    return F.cross_entropy(x, t)


def _flce_make(g, n):
    x, t = _ce_make(g, n)
    return [x.transpose(1, 2)[..., :24] / 3, _randn(g, 37, 24) / 5, t, _randn(g, 37)]


def _flce_ref(h, w, t, b):
    return _ce_ref(F.linear(h, w, b).transpose(1, 2), t)



def _naive(x, lw, lb, W, b):
    return torch.ops.gpu_puzzles.fused_layernorm_linear_naive(x, lw, lb, W, b)


OPS = [
    OpCase("conv1d", lambda x, w, b: gp.conv1d(x, w, b, causal=True), _conv1d_make, ("x", "weight", "bias"),
           ("float",) * 3, lambda x, w, b: conv1d_ref(x, w, b, causal=True),
           [("weight with 4 channels", lambda x, w, b: gp.conv1d(x, w.new_zeros(4, 4), b), "weight"),
            ("bias (4,)", lambda x, w, b: gp.conv1d(x, w, b.new_zeros(4)), "bias"),
            ("x 4-D", lambda x, w, b: gp.conv1d(x[None], w, b), "x"),
            ("x 0-d", lambda x, w, b: gp.conv1d(x[0, 0, 0], w[0, :1]), "x"),
            ("algorithm", lambda x, w, b: gp.conv1d(x, w, b, algorithm="best"), "algorithm")]),
    OpCase("embedding", gp.embedding, _embedding_make, ("indices", "weight"), ("index", "float"),
           lambda i, w: embedding_ref(i, w),
           [("weight 1-D", lambda i, w: gp.embedding(i, w[0]), "weight"),
            ("weight 3-D", lambda i, w: gp.embedding(i, w[None]), "weight"),
            ("padding_idx", lambda i, w: gp.embedding(i, w, 10), "padding_idx")]),
    OpCase("embedding_2d", _embedding_2d, _embedding_make, ("indices", "weight"), ("index", "float"),
           lambda i, w: embedding_ref(i, w),
           [("weight 1-D", lambda i, w: _embedding_2d(i, w[0]), "weight"),
            ("padding_idx", lambda i, w: _embedding_2d(i, w, -11), "padding_idx")],
           deterministic_backward_always=False),
    OpCase("softmax", lambda x: gp.softmax(x, -1), _softmax_make, ("x",), ("float",),
           lambda x: torch.softmax(x, -1),
           [("dim", lambda x: gp.softmax(x, 2), "dim"),
            ("algorithm", lambda x: gp.softmax(x, algorithm="x"), "algorithm")]),
    OpCase("log_softmax", lambda x: gp.log_softmax(x, 0), _softmax_make, ("x",), ("float",),
           lambda x: torch.log_softmax(x, 0), [("dim", lambda x: gp.log_softmax(x, -3), "dim")]),
    OpCase("layer_norm", gp.layer_norm, _ln_make, ("x", "weight", "bias"), ("float",) * 3,
           lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b),
           [("weight (23,)", lambda x, w, b: gp.layer_norm(x, w[:-1], b), "weight"),
            ("bias (24, 1)", lambda x, w, b: gp.layer_norm(x, w, b[:, None]), "bias"),
            ("x 0-d", lambda x, w, b: gp.layer_norm(x[0, 0, 0], w, b), "x")]),
    OpCase("fused_layernorm_linear", gp.fused_layernorm_linear, _lnl_make,
           ("x", "ln_weight", "ln_bias", "linear_weight", "linear_bias"), ("float",) * 5, _lnl_ref,
           [("linear_weight (16, 23)", lambda x, lw, lb, W, b: gp.fused_layernorm_linear(x, lw, lb, W[:, 1:], b),
             "linear_weight"),
            ("linear_bias (15,)", lambda x, lw, lb, W, b: gp.fused_layernorm_linear(x, lw, lb, W, b[1:]),
             "linear_bias"),
            ("ln_weight (23,)", lambda x, lw, lb, W, b: gp.fused_layernorm_linear(x, lw[1:], lb, W, b), "ln_weight")]),
    OpCase("fused_layernorm_linear_naive", _naive, _lnl_make,
           ("x", "ln_weight", "ln_bias", "linear_weight", "linear_bias"), ("float",) * 5, _lnl_ref,
           [("linear_weight (16, 23)", lambda x, lw, lb, W, b: _naive(x, lw, lb, W[:, 1:], b), "linear_weight")],
           differentiable=False),
    OpCase("attention", lambda q, k, v: gp.attention(q, k, v, causal=True), _attn_make, ("q", "k", "v"),
           ("float",) * 3, _attn_ref,
           [("k head dim 15", lambda q, k, v: gp.attention(q, k[..., 1:], v), "k"),
            ("v length 10", lambda q, k, v: gp.attention(q, k, v[..., 1:, :]), "v"),
            ("k leading dims", lambda q, k, v: gp.attention(q, k[:1], v[:1]), "k"),
            ("algorithm", lambda q, k, v: gp.attention(q, k, v, algorithm="flash"), "algorithm")],
           deterministic_backward_always=False),  # the sm_90a backward sums dq out of order
    OpCase("attention_unfused", lambda q, k, v: gp.attention(q, k, v, causal=True, algorithm="unfused"),
           _attn_make, ("q", "k", "v"), ("float",) * 3, _attn_ref,
           [("k head dim 15", lambda q, k, v: gp.attention(q, k[..., 1:], v, algorithm="unfused"), "k")]),
    OpCase("cross_entropy", gp.cross_entropy, _ce_make, ("logits", "target"), ("float", "index"), _ce_ref,
           [("target (4, 4)", lambda x, t: gp.cross_entropy(x, t[:, 1:]), "target"),
            ("reduction", lambda x, t: gp.cross_entropy(x, t, reduction="avg"), "reduction")]),
    OpCase("fused_linear_cross_entropy", gp.fused_linear_cross_entropy, _flce_make,
           ("hidden", "weight", "target", "bias"), ("float", "float", "index", "float"), _flce_ref,
           [("weight (37, 23)", lambda h, w, t, b: gp.fused_linear_cross_entropy(h, w[:, 1:], t, b), "weight"),
            ("bias (36,)", lambda h, w, t, b: gp.fused_linear_cross_entropy(h, w, t, b[1:]), "bias"),
            ("reduction none", lambda h, w, t, b: gp.fused_linear_cross_entropy(h, w, t, b, reduction="none"),
             "reduction")]),
]
GRAD_OPS = [c for c in OPS if c.differentiable]


def _other_float(dtype):
    return torch.float64 if dtype != torch.float64 else torch.float32


def hostile_calls(case, device):
    """(label, inputs, name) for every input made wrong in one way: integer, complex, another
    float dtype, another device (where a second kind of device exists), float indices."""
    good = case.inputs(device)
    calls = []
    for i, (t, role, name) in enumerate(zip(good, case.roles, case.names)):
        if t is None:
            continue

        def sub(new, i=i):
            return [new if j == i else u for j, u in enumerate(good)]
        if role == "float":
            calls += [(f"{name} int64", sub(t.long()), name), (f"{name} int32", sub(t.int()), name),
                      (f"{name} complex64", sub(t.to(torch.complex64)), name),
                      (f"{name} bool", sub(t > 0), name)]
            if any(r == "float" for r in case.roles[:i]):  # must match an earlier float input
                calls.append((f"{name} {_other_float(t.dtype)}", sub(t.to(_other_float(t.dtype))), name))
        else:
            calls += [(f"{name} float32", sub(t.float()), name),
                      (f"{name} complex64", sub(t.to(torch.complex64)), name),
                      (f"{name} int16", sub(t.short()), name), (f"{name} uint8", sub(t.clamp(0).to(torch.uint8)), name)]
        if HAS_CUDA and (i > 0 or role == "index"):
            other = "cpu" if device == "cuda" else "cuda"
            calls.append((f"{name} on {other}", sub(t.to(other)), name))
            if TWO_GPUS and device == "cuda":  # two GPUs: cuda:0 and cuda:1 do not mix either
                calls.append((f"{name} on cuda:1", sub(t.to("cuda:1")), name))
    return calls


def _check_raises_naming(call, name, label):
    try:
        call()
    except ERRORS as e:
        msg = str(e)
        import re
        assert re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", msg), \
            f"{label}: the message does not name {name!r}: {msg[:300]}"
        return
    except Exception as e:  # noqa: BLE001  anything else is a bug too
        pytest.fail(f"{label}: raised {type(e).__name__} (want RuntimeError/ValueError/TypeError): {e}")
    pytest.fail(f"{label}: no exception")


def _ref_outputs(case, inputs, grad_out=None):
    """float64 reference forward (and grads of the float inputs for grad_out)."""
    ins64 = [None if t is None else (t.detach().double().requires_grad_() if r == "float" else t)
             for t, r in zip(inputs, case.roles)]
    y = case.ref(*ins64)
    if grad_out is None:
        return y.detach(), None
    leaves = case.leaves(ins64)
    return y.detach(), torch.autograd.grad(y, leaves, grad_out.double())


def _run(case, inputs, grad_out=None):
    y = case.fn(*inputs)
    if grad_out is None:
        return y, None
    return y, torch.autograd.grad(y, case.leaves(inputs), grad_out)


def _grad_out(case, device, dtype=torch.float32, seed=99, n=1):
    with torch.no_grad():
        y = case.fn(*case.inputs(device, dtype, seed=0, n=n))
    return torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(device, dtype)


def _check_against_ref(case, inputs, y, grads, grad_out, dtype, what):
    y_ref, g_ref = _ref_outputs(case, inputs, grad_out)
    assert y.shape == y_ref.shape and y.dtype == dtype, what
    assert_close_ref(y, y_ref, dtype, f"{case.name} {what} forward")
    for i, (a, r) in enumerate(zip(grads or (), g_ref or ())):
        grad_close(a, r, dtype, f"{case.name} {what} grad {i}", reduction=64)


# ---- hostile input -------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", OPS, ids=str)
def test_hostile_input_names_the_argument(device, case):
    """Every input made integer, complex, bool, another float dtype, another device (cpu/cuda,
    cuda:0/cuda:1 where two GPUs exist; float indices for embedding), plus the op's wrong shapes: an exception
    naming the argument.
    On CUDA the context stays usable: a correct call afterwards gives the right result."""
    for label, bad, name in hostile_calls(case, device):
        _check_raises_naming(lambda: case.fn(*bad), name, f"{case.name} {label}")
    good = case.inputs(device)
    for label, call, name in case.bad_calls:
        _check_raises_naming(lambda: call(*good), name, f"{case.name} {label}")
    # and after all that, a correct call still works (CUDA: no sticky error in the context)
    ins = case.inputs(device, seed=1, requires_grad=True)
    gy = _grad_out(case, device) if case.differentiable else None
    y, grads = _run(case, ins, gy)
    if device == "cuda":
        torch.cuda.synchronize()
    _check_against_ref(case, ins, y, grads, gy, torch.float32, "after errors")


# ---- streams, device guard, CUDA graphs, reduce-overhead --------------------------------

@requires_cuda
@pytest.mark.parametrize("case", OPS, ids=str)
def test_cuda_runs_on_current_stream(case):
    """Inputs are written on a side stream after a long sleep kernel, then the op (and its
    backward) runs there: a kernel launched on any other stream reads the poison first."""
    real = case.inputs("cuda", seed=2)
    gy = _grad_out(case, "cuda") if case.differentiable else None
    staged = [None if t is None else (torch.full_like(t, float("nan")) if r == "float" else torch.full_like(t, -1))
              for t, r in zip(real, case.roles)]
    gy_staged = None if gy is None else torch.full_like(gy, float("nan"))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.cuda._sleep(100_000_000)  # ~50 ms of GPU time before the data arrives
        for st_, t in zip(staged, real):
            if st_ is not None:
                st_.copy_(t)
        if gy is not None:
            gy_staged.copy_(gy)
        for st_, r in zip(staged, case.roles):
            if st_ is not None and r == "float" and case.differentiable:
                st_.requires_grad_()
        y, grads = _run(case, staged, gy_staged)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    leaves = [t.requires_grad_(case.differentiable) if r == "float" and t is not None else t
              for t, r in zip(real, case.roles)]
    y_e, grads_e = _run(case, leaves, gy)
    torch.testing.assert_close(y, y_e, rtol=1e-5, atol=1e-6, equal_nan=False)
    for a, b in zip(grads or (), grads_e or ()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@requires_2_gpus
@pytest.mark.parametrize("case", OPS, ids=str)
def test_cuda_device_guard_on_second_gpu(case):
    """Tensors on cuda:1 while cuda:0 is current: results (and grads) on cuda:1, correct."""
    with torch.cuda.device(0):
        ins = case.inputs("cuda:1", seed=3, requires_grad=True)
        gy = _grad_out(case, "cuda:1") if case.differentiable else None
        y, grads = _run(case, ins, gy)
        torch.cuda.synchronize(1)
        assert torch.cuda.current_device() == 0
    assert y.device == torch.device("cuda:1")
    assert all(g.device == torch.device("cuda:1") for g in grads or ())
    _check_against_ref(case, ins, y, grads, gy, torch.float32, "cuda:1")
    # and a side stream of cuda:1 taken from cuda:0's context
    s = torch.cuda.Stream(device=1)
    with torch.cuda.device(0), torch.cuda.stream(s):
        y2 = case.fn(*[None if t is None else t.detach() for t in ins])
    s.synchronize()
    torch.testing.assert_close(y2, y.detach())


@requires_cuda
@pytest.mark.parametrize("case", OPS, ids=str)
def test_cuda_graph_capture_and_replay(case):
    """Forward and backward captured in a CUDA graph, replayed on new data copied into the
    static inputs: same as eager on that data."""
    static = case.inputs("cuda", seed=4, requires_grad=True)
    gy = _grad_out(case, "cuda") if case.differentiable else None
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up off the capture, as torch.cuda.graph asks
        for _ in range(2):
            _run(case, static, gy)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, grads = _run(case, static, gy)
    for seed in (5, 6):
        new = case.inputs("cuda", seed=seed, requires_grad=True)
        new_gy = None if gy is None else torch.randn_like(gy)
        with torch.no_grad():
            for st_, t in zip(static, new):
                if st_ is not None:
                    st_.copy_(t)
            if gy is not None:
                gy.copy_(new_gy)
        graph.replay()
        y_e, grads_e = _run(case, new, new_gy)
        torch.cuda.synchronize()
        torch.testing.assert_close(y, y_e, rtol=1e-5, atol=1e-6)
        for a, b in zip(grads or (), grads_e or ()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@requires_cuda
@pytest.mark.parametrize("case", OPS, ids=str)
def test_compile_reduce_overhead(case):
    """torch.compile(mode="reduce-overhead") (CUDA graph trees) forward and backward equal
    eager, over several calls (recording, then replays), and no CUDA graph is skipped."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    f = torch.compile(case.fn, mode="reduce-overhead", fullgraph=True)
    gy = _grad_out(case, "cuda") if case.differentiable else None
    for seed in (7, 8, 9, 10):
        ins = case.inputs("cuda", seed=seed, requires_grad=True)
        y, grads = f(*ins), None
        if gy is not None:
            grads = torch.autograd.grad(y, case.leaves(ins), gy)
        y, grads = y.clone(), [g.clone() for g in grads or ()]  # graph outputs are reused by the next replay
        y_e, grads_e = _run(case, ins, gy)
        torch.testing.assert_close(y, y_e, rtol=1e-5, atol=1e-6)
        for a, b in zip(grads, grads_e or ()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert counters["inductor"]["cudagraph_skips"] == 0, "a CUDA graph was skipped (see the log for why)"


# ---- determinism ------------------------------------------------------------------------

@pytest.fixture
def deterministic():
    prev = torch.are_deterministic_algorithms_enabled()
    prev_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev, warn_only=prev_warn)


def _dtypes(device):
    return [torch.float32] if device == "cpu" else [torch.float32, torch.bfloat16]


def _size(device):
    return 4 if device == "cpu" else 512  # many blocks / threads: where an order could vary


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", OPS, ids=str)
def test_forward_bit_identical(device, case):
    for dtype in _dtypes(device):
        ins = case.inputs(device, dtype, seed=11, n=_size(device))
        first = case.fn(*ins)
        for _ in range(3):
            assert torch.equal(case.fn(*ins), first), f"{case.name} {dtype}: forward differs run to run"


def _backward_runs_equal(case, device, dtype):
    ins = case.inputs(device, dtype, seed=12, n=_size(device), requires_grad=True)
    gy = _grad_out(case, device, dtype, n=_size(device))
    _, first = _run(case, ins, gy)
    for _ in range(3):
        _, again = _run(case, ins, gy)
        for i, (a, b) in enumerate(zip(first, again)):
            assert torch.equal(a, b), f"{case.name} {dtype}: grad {i} differs run to run"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", GRAD_OPS, ids=str)
def test_backward_bit_identical_when_deterministic(device, case, deterministic):
    for dtype in _dtypes(device):
        _backward_runs_equal(case, device, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", [c for c in GRAD_OPS if c.deterministic_backward_always], ids=str)
def test_backward_bit_identical_by_default(device, case):
    """The ops that promise a deterministic backward without being asked (docstrings)."""
    for dtype in _dtypes(device):
        _backward_runs_equal(case, device, dtype)


# ---- tensors past 2^31 elements (device only) ---------------------------------------------
# bf16 keeps each tensor at ~4.3 GB. Outputs land on memory poisoned with NaN first (the
# caching allocator hands the freed block back), and the whole output is checked for NaN:
# an element a kernel forgets shows up wherever it is. Values are compared on slices
# (first rows, rows across flat index 2^31, last rows) against float64 references
# computed on those slices only; full reductions (weight grads) against float64 sums in chunks.

BIG = 2**31
HUGE_DTYPE = torch.bfloat16


def _need(nbytes):
    if not HAS_CUDA:
        pytest.skip("needs a CUDA device")
    # Blocks cached by earlier tests count as used in mem_get_info: hand them back first
    # (the full suite otherwise skipped a huge test on an 80 GB card).
    gc.collect()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    if free < nbytes * 1.15:
        pytest.skip(f"needs {nbytes / 2**30:.0f} GiB free on the GPU, has {free / 2**30:.0f} GiB")


def _poison_next(numel, dtype, device):
    """Fill a block of this size with NaN and free it: the next allocation of that size gets it."""
    if device == "cuda":
        torch.empty(numel, dtype=dtype, device=device).fill_(float("nan"))
        torch.cuda.synchronize()


def _no_nan(t, what):
    assert not torch.isnan(t).any().item(), f"{what}: NaN in the output (an element never written)"


def _huge_randn(shape, seed, device):
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=g, device=device, dtype=HUGE_DTYPE)


# Each check takes `big`, the flat index it must cross (2^31 on the GPU), so that the same
# code runs at toy size on the CPU in CI: that tests the checking logic itself.

def _huge_conv1d(device, big, causal):
    C, K = 2, 4
    L = 3 * big // 4 + 7  # C * L = 1.5 big; flat index `big` falls mid-channel 1
    n = min(4096, L // 8)
    x = _huge_randn((1, C, L), 0, device).requires_grad_()
    w = torch.randn(C, K, device=device, dtype=HUGE_DTYPE).requires_grad_()
    b = torch.randn(C, device=device, dtype=HUGE_DTYPE).requires_grad_()
    _poison_next(x.numel(), HUGE_DTYPE, device)
    y = gp.conv1d(x, w, b, causal=causal)
    _no_nan(y, "conv1d forward")
    w64, b64 = w.detach().double(), b.detach().double()
    halo = K - 1
    starts = (0, big - L - n // 2, L - n)  # start, across flat index `big`, end (of each channel)
    for lo in starts:
        # a window with a halo: inside it the zero padding only matters at the real edges
        win_lo, win_hi = max(0, lo - halo), min(L, lo + n + halo)
        ref = conv1d_ref(x.detach()[..., win_lo:win_hi].double(), w64, b64, causal)[..., lo - win_lo:lo - win_lo + n]
        assert_close_ref(y.detach()[..., lo:lo + n], ref, HUGE_DTYPE, f"conv1d forward at {lo}")
    del y
    g = _huge_randn((1, C, L), 1, device)
    _poison_next(x.numel(), HUGE_DTYPE, device)
    dx, dw, db = torch.autograd.grad(gp.conv1d(x, w, b, causal=causal), (x, w, b), g)
    _no_nan(dx, "conv1d dx")
    for lo in starts:
        win_lo, win_hi = max(0, lo - halo), min(L, lo + n + halo)
        xw = x.detach()[..., win_lo:win_hi].double().requires_grad_()
        (dxw,) = torch.autograd.grad(conv1d_ref(xw, w64, b64, causal), (xw,), g[..., win_lo:win_hi].double())
        assert_close_ref(dx[..., lo:lo + n], dxw[..., lo - win_lo:lo - win_lo + n], HUGE_DTYPE, f"conv1d dx at {lo}")
    # dw[c, j] = sum_i g[c, i] x[c, i + j - s] (s = K - 1 causal, else 0): float64, in chunks
    s = K - 1 if causal else 0
    dw_ref = torch.zeros(C, K, dtype=torch.float64, device=device)
    chunk = max(1, big // 32)
    for c0 in range(0, L, chunk):
        c1 = min(L, c0 + chunk)
        gc = g[0, :, c0:c1].double()
        for j in range(K):
            a, e = c0 + j - s, c1 + j - s  # the x positions paired with g[c0:c1]
            xs = F.pad(x.detach()[0, :, max(0, a):min(L, e)].double(), (max(0, -a), max(0, e - L)))
            dw_ref[:, j] += (gc * xs).sum(-1)
    grad_close(dw, dw_ref, HUGE_DTYPE, "conv1d dw", L)
    grad_close(db, g.sum((0, 2), dtype=torch.float64), HUGE_DTYPE, "conv1d dbias", L)


def _huge_embedding(device, big, kernel):
    fn = functools.partial(gp.embedding, algorithm=kernel)
    E = 1024 if big > 2**20 else 16
    V = 4099 if big > 2**20 else 37
    T = big // E + 3  # the output has T * E > big elements
    idx = torch.randint(0, V, (T,), device=device, generator=torch.Generator(device=device).manual_seed(2))
    idx[-1], idx[-2], idx[-3] = V + 7, -1, V - 1  # out of range (zero rows), the last row
    w = torch.randn(V, E, device=device, dtype=HUGE_DTYPE).requires_grad_()
    _poison_next(T * E, HUGE_DTYPE, device)
    y = fn(idx, w)
    _no_nan(y, f"{kernel} forward")
    mid = big // E  # row `mid` starts at flat index `big`
    for sl in (slice(0, 64), slice(mid - 3, mid + 3), slice(T - 64, T)):
        assert torch.equal(y.detach()[sl], embedding_ref(idx[sl], w.detach())), f"{kernel} rows {sl}"
    del y
    g = _huge_randn((T, E), 3, device)
    (gw,) = torch.autograd.grad(fn(idx, w), (w,), g)
    gw_ref = torch.zeros(V, E, dtype=torch.float64, device=device)
    chunk = max(1, T // 8)
    for t0 in range(0, T, chunk):
        gw_ref += embedding_ref_grad(g[t0:t0 + chunk], idx[t0:t0 + chunk], V)
    counts = torch.bincount(idx[(idx >= 0) & (idx < V)], minlength=V)
    grad_close(gw, gw_ref, HUGE_DTYPE, f"{kernel} dweight", counts.max().item())


def _huge_softmax(device, big, kind, dim):
    f, f_ref = (gp.softmax, torch.softmax) if kind == "softmax" else (gp.log_softmax, torch.log_softmax)
    N = 1024 if big > 2**20 else 16
    M = big // N + 3
    shape = (M, N) if dim == -1 else (N, M)  # dim 0: the strided (column) path
    x = (_huge_randn(shape, 4, device) * 3).requires_grad_()
    _poison_next(M * N, HUGE_DTYPE, device)
    y = f(x, dim)
    _no_nan(y, f"{kind} forward")
    g = _huge_randn(shape, 5, device)
    _poison_next(M * N, HUGE_DTYPE, device)
    (dx,) = torch.autograd.grad(y, (x,), g)
    _no_nan(dx, f"{kind} dx")
    mid = big // N
    # dim -1: row `mid` starts at flat index `big`; dim 0: the last columns of the last row lie past it
    for sl in (slice(0, 8), slice(mid - 2, mid + 2), slice(M - 8, M)):
        at = (sl, slice(None)) if dim == -1 else (slice(None), sl)
        xs = x.detach()[at].double().requires_grad_()
        ys = f_ref(xs, dim)
        (dxs,) = torch.autograd.grad(ys, (xs,), g[at].double())
        assert_close_ref(y.detach()[at], ys, HUGE_DTYPE, f"{kind} dim={dim} forward at {sl}")
        assert_close_ref(dx[at], dxs, HUGE_DTYPE, f"{kind} dim={dim} dx at {sl}")


def _huge_layer_norm(device, big):
    H = 1024 if big > 2**20 else 16
    M = big // H + 3
    x = (_huge_randn((M, H), 6, device) + 0.5).requires_grad_()
    w = (1 + 0.3 * torch.randn(H, device=device, dtype=HUGE_DTYPE)).requires_grad_()
    b = torch.randn(H, device=device, dtype=HUGE_DTYPE).requires_grad_()
    _poison_next(M * H, HUGE_DTYPE, device)
    y = gp.layer_norm(x, w, b)
    _no_nan(y, "layer_norm forward")
    g = _huge_randn((M, H), 7, device)
    _poison_next(M * H, HUGE_DTYPE, device)
    dx, dw, db = torch.autograd.grad(y, (x, w, b), g)
    _no_nan(dx, "layer_norm dx")
    w64, b64 = w.detach().double(), b.detach().double()
    mid = big // H
    for sl in (slice(0, 8), slice(mid - 2, mid + 2), slice(M - 8, M)):
        xs = x.detach()[sl].double().requires_grad_()
        ys = F.layer_norm(xs, (H,), w64, b64)
        (dxs,) = torch.autograd.grad(ys, (xs,), g[sl].double())
        assert_close_ref(y.detach()[sl], ys, HUGE_DTYPE, f"layer_norm forward at {sl}")
        # dx carries rstd (about 1 here) and sums H terms
        grad_close(dx[sl], dxs, HUGE_DTYPE, f"layer_norm dx at {sl}", H)
    dw_ref = torch.zeros(H, dtype=torch.float64, device=device)
    db_ref = torch.zeros(H, dtype=torch.float64, device=device)
    chunk = max(1, M // 8)
    for r0 in range(0, M, chunk):
        xc = x.detach()[r0:r0 + chunk].double()
        xhat = (xc - xc.mean(-1, keepdim=True)) * (xc.var(-1, unbiased=False, keepdim=True) + 1e-5).rsqrt()
        gc = g[r0:r0 + chunk].double()
        dw_ref += (gc * xhat).sum(0)
        db_ref += gc.sum(0)
    grad_close(dw, dw_ref, HUGE_DTYPE, "layer_norm dweight", M)
    grad_close(db, db_ref, HUGE_DTYPE, "layer_norm dbias", M)


# (id, check(device, big), GPU bytes it needs: about five tensors of the huge size, bf16)
HUGE = [("conv1d", lambda d, big: _huge_conv1d(d, big, False), 5 * (3 * BIG // 2) * 2),
        ("conv1d_causal", lambda d, big: _huge_conv1d(d, big, True), 5 * (3 * BIG // 2) * 2),
        ("embedding", lambda d, big: _huge_embedding(d, big, "coalesced"), 4 * BIG * 2),
        ("embedding_2d", lambda d, big: _huge_embedding(d, big, "2d"), 4 * BIG * 2),
        ("softmax_rows", lambda d, big: _huge_softmax(d, big, "softmax", -1), 5 * BIG * 2),
        ("log_softmax_rows", lambda d, big: _huge_softmax(d, big, "log_softmax", -1), 5 * BIG * 2),
        ("softmax_columns", lambda d, big: _huge_softmax(d, big, "softmax", 0), 5 * BIG * 2),
        ("layer_norm", _huge_layer_norm, 5 * BIG * 2)]


@pytest.mark.slow
@pytest.mark.parametrize("name,check,nbytes", HUGE, ids=[h[0] for h in HUGE])
def test_huge_past_2_31_elements(name, check, nbytes):
    """Device only: every output past flat index 2^31 written, values right across it."""
    _need(nbytes)
    check("cuda", BIG)
    torch.cuda.synchronize()


@pytest.mark.parametrize("name,check,nbytes", HUGE, ids=[h[0] for h in HUGE])
def test_huge_checks_at_toy_size(name, check, nbytes):
    """The same checks on the CPU with `big` = 2^12: the checking code itself is right."""
    check("cpu", 2**12)


def _registered_calls():
    """One valid CPU call of every registered op (forward and backward), as (op name, args)."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    ops = torch.ops.gpu_puzzles
    x, w, b, W, bl = r(3, 8), r(8), r(8), r(5, 8), r(5)
    y, mean, rstd = ops.layer_norm(x, w, b)
    yf, mf, rf = ops.fused_layernorm_linear(x, w, b, W, bl)
    yr, rr = ops.rms_norm(x, w)
    yfr, rfr = ops.fused_rmsnorm_linear(x, w, W, bl)
    q, k, v = r(2, 4, 8), r(2, 5, 8), r(2, 5, 8)
    o, lse = ops.attention(q, k, v)
    cx, cw = r(2, 4, 9), r(4, 3)
    idx = torch.tensor([[1, 0, 3]])
    logits, target = r(4, 7), torch.tensor([1, 0, 6, -100])
    loss, clse = ops.cross_entropy(logits, target)
    sm = ops.softmax(x)
    lsm = ops.log_softmax(x)
    return [
        ("conv1d", (cx, cw, r(4))), ("conv1d_backward", (r(2, 4, 9), cx, cw, False)),
        ("embedding", (idx, W)), ("embedding_backward", (r(1, 3, 8), idx, 5, None, True)),
        ("softmax", (x,)), ("log_softmax", (x,)),
        ("softmax_backward", (r(3, 8), sm, -1)), ("log_softmax_backward", (r(3, 8), lsm, -1)),
        ("layer_norm", (x, w, b)), ("layer_norm_backward", (r(3, 8), x, w, mean, rstd)),
        ("fused_layernorm_linear", (x, w, b, W, bl)),
        ("fused_layernorm_linear_backward", (r(3, 5), x, w, b, W, mf, rf)),
        ("fused_layernorm_linear_naive", (x, w, b, W, bl)),
        ("rms_norm", (x, w)), ("rms_norm_backward", (r(3, 8), x, w, rstd)),
        ("fused_rmsnorm_linear", (x, w, W, bl)), ("fused_rmsnorm_linear_backward", (r(3, 5), x, w, W, rfr, True)),
        ("attention", (q, k, v)), ("attention_backward", (r(2, 4, 8), q, k, v, o, lse, None, False)),
        ("transpose_last2", (q,)), ("matmul", (q, k.transpose(-1, -2).contiguous())),
        ("cross_entropy", (logits, target)), ("cross_entropy_backward", (loss.detach(), logits, target, clse, -100,
                                                                          "mean")),
        ("fused_linear_cross_entropy", (x, W, torch.tensor([1, 0, 4]), bl)),
        ("gated_act", (x, r(3, 8))), ("gated_act_backward", (r(3, 8), x, r(3, 8), "silu")),
        ("rotary", (x, r(3, 8), r(3, 8), r(3, 8))), ("rotary_backward", (r(3, 8), x, r(3, 8), r(3, 8), torch.float32)),
    ]


def test_registered_calls_cover_every_op():
    names = {n for n, _ in _registered_calls()}
    registered = {s.name.split("::")[1] for s in torch._C._jit_get_all_schemas() if s.name.startswith("gpu_puzzles::")
                  and not s.name.split("::")[1].startswith("_")}
    assert names == registered, registered ^ names


@pytest.mark.parametrize("op,args", _registered_calls(), ids=lambda v: v if isinstance(v, str) else "")
def test_meta_argument_is_named(op, args):
    """Any one tensor argument on meta (an empty-weight init left behind) is an error naming an
    argument on the other device, never a tensor of uninitialised memory; all of them on meta
    is shape inference and gives meta outputs."""
    fn = getattr(torch.ops.gpu_puzzles, op).default
    names = [a.name for a in fn._schema.arguments]
    tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    for i in tensors:
        moved = [a.to("meta") if j == i else a for j, a in enumerate(args)]
        other = names[tensors[0] if i != tensors[0] else tensors[1]] if len(tensors) > 1 else None
        if other is None:
            continue
        with pytest.raises(RuntimeError, match=r"is on (meta|cpu) but \w+ is on (cpu|meta); they must be on the same "
                                               r"device") as e:
            fn(*moved)
        assert names[i] in str(e.value) and other in str(e.value), str(e.value)
    out = fn(*[a.to("meta") if isinstance(a, torch.Tensor) else a for a in args])
    for t in out if isinstance(out, (tuple, list)) else (out,):
        assert t.device.type == "meta"


# ---- double backward ----------------------------------------------------------------------
# Where PyTorch's counterpart has a second derivative (softmax, log_softmax, layer_norm,
# rms_norm, cross_entropy), ours is right (gradgradcheck; first derivatives under
# create_graph=True equal the kernels'); elsewhere differentiating a gradient raises, naming
# the op. Never the silent wrong numbers of autograd's fallback (pyproject turns its warning
# into an error for the whole suite).

def _dd(*shape, device, g):
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(device).requires_grad_()


_TARGET = [1, 6, -100, 3]
DOUBLE_BACKWARD = {
    "softmax": lambda d, g: ((lambda x: gp.softmax(x, dim=-1)), (_dd(4, 7, device=d, g=g),)),
    "softmax dim 0": lambda d, g: ((lambda x: gp.softmax(x, dim=0)), (_dd(4, 7, device=d, g=g),)),
    "log_softmax": lambda d, g: ((lambda x: gp.log_softmax(x, dim=-1)), (_dd(4, 7, device=d, g=g),)),
    "layer_norm": lambda d, g: ((lambda x, w, b: gp.layer_norm(x, w, b)),
                                (_dd(2, 3, 8, device=d, g=g), _dd(8, device=d, g=g), _dd(8, device=d, g=g))),
    "rms_norm": lambda d, g: ((lambda x, w: gp.rms_norm(x, w)), (_dd(3, 8, device=d, g=g), _dd(8, device=d, g=g))),
    **{f"cross_entropy {red}": (lambda red: lambda d, g: (
        (lambda x: gp.cross_entropy(x, torch.tensor(_TARGET, device=d), reduction=red)),
        (_dd(4, 7, device=d, g=g),)))(red) for red in ("mean", "sum", "none")},
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(DOUBLE_BACKWARD))
def test_double_backward(device, name):
    fn, inputs = DOUBLE_BACKWARD[name](device, torch.Generator().manual_seed(3))
    assert torch.autograd.gradgradcheck(fn, inputs)
    out = fn(*inputs)
    up = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(4)).to(device)
    plain = torch.autograd.grad(out, inputs, up, retain_graph=True)
    graphed = torch.autograd.grad(out, inputs, up, create_graph=True)
    assert any(a.requires_grad for a in graphed)  # the composite ran (a bias gradient may not depend on x)
    for a, b in zip(graphed, plain):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


NO_DOUBLE_BACKWARD = {
    "conv1d_backward": lambda d, g: (lambda a, b, c: gp.conv1d(a, b, c, causal=True),
                                     (_dd(2, 3, 9, device=d, g=g), _dd(3, 4, device=d, g=g), _dd(3, device=d, g=g))),
    "attention_backward": lambda d, g: (lambda q, k, v: gp.attention(q, k, v, causal=True),
                                        tuple(_dd(2, 5, 8, device=d, g=g) for _ in range(3))),
    "fused_layernorm_linear_backward": lambda d, g: (gp.fused_layernorm_linear,
                                                     (_dd(3, 8, device=d, g=g), _dd(8, device=d, g=g),
                                                      _dd(8, device=d, g=g), _dd(5, 8, device=d, g=g),
                                                      _dd(5, device=d, g=g))),
    "fused_rmsnorm_linear_backward": lambda d, g: (gp.fused_rmsnorm_linear,
                                                   (_dd(3, 8, device=d, g=g), _dd(8, device=d, g=g),
                                                    _dd(5, 8, device=d, g=g), _dd(5, device=d, g=g))),
    "fused_linear_cross_entropy": lambda d, g: (
        lambda h, w: gp.fused_linear_cross_entropy(h, w, torch.tensor([1, 2, 4], device=d)),
        (_dd(3, 8, device=d, g=g), _dd(5, 8, device=d, g=g))),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", list(NO_DOUBLE_BACKWARD))
def test_double_backward_refused_by_name(device, op):
    """The first derivatives under create_graph=True are the usual ones; differentiating them raises."""
    fn, inputs = NO_DOUBLE_BACKWARD[op](device, torch.Generator().manual_seed(5))
    out = fn(*inputs)
    plain = torch.autograd.grad(out.sum(), inputs, retain_graph=True)
    up = torch.ones_like(out).requires_grad_()  # so that every gradient depends on something differentiable
    graphed = torch.autograd.grad(out, inputs, up, create_graph=True)
    for a, b in zip(graphed, plain):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    penalty = sum(g.pow(2).sum() for g in graphed)
    with pytest.raises(RuntimeError, match=f"gpu_puzzles::{op}: double backward"):
        penalty.backward()


# Every op's C++ Autograd kernel calls the kernel directly when nothing is differentiated
# (no_grad, eval, frozen inputs), skipping Function::apply's node and saved data; with an
# input that requires grad it builds the node. fn(device, g) -> (call, float inputs).


def _rotary_call(d, g):
    cos, sin = (torch.randn(2, 5, 8, generator=g, dtype=torch.float64).to(d) for _ in range(2))
    return (lambda q, k: torch.cat(gp.rotary(q, k, cos, sin), 0),
            (_dd(2, 5, 8, device=d, g=g), _dd(2, 5, 8, device=d, g=g)))


AUTOGRAD_CALLS = {
    "softmax": lambda d, g: (lambda x: gp.softmax(x, -1), (_dd(4, 7, device=d, g=g),)),
    "log_softmax": lambda d, g: (lambda x: gp.log_softmax(x, 0), (_dd(4, 7, device=d, g=g),)),
    "layer_norm": lambda d, g: (gp.layer_norm, (_dd(3, 8, device=d, g=g), _dd(8, device=d, g=g),
                                                _dd(8, device=d, g=g))),
    "rms_norm": lambda d, g: (gp.rms_norm, (_dd(3, 8, device=d, g=g), _dd(8, device=d, g=g))),
    "fused_layernorm_linear": lambda d, g: (gp.fused_layernorm_linear,
                                            (_dd(3, 8, device=d, g=g), _dd(8, device=d, g=g), _dd(8, device=d, g=g),
                                             _dd(5, 8, device=d, g=g), _dd(5, device=d, g=g))),
    "fused_rmsnorm_linear": lambda d, g: (gp.fused_rmsnorm_linear,
                                          (_dd(3, 8, device=d, g=g), _dd(8, device=d, g=g), _dd(5, 8, device=d, g=g),
                                           _dd(5, device=d, g=g))),
    "attention": lambda d, g: (lambda q, k, v: gp.attention(q, k, v, causal=True),
                               tuple(_dd(2, 5, 8, device=d, g=g) for _ in range(3))),
    "cross_entropy": lambda d, g: (lambda x: gp.cross_entropy(x, torch.tensor(_TARGET, device=d)),
                                   (_dd(4, 7, device=d, g=g),)),
    "fused_linear_cross_entropy": lambda d, g: (
        lambda h, w: gp.fused_linear_cross_entropy(h, w, torch.tensor(_TARGET, device=d)),
        (_dd(4, 8, device=d, g=g), _dd(7, 8, device=d, g=g))),
    "conv1d": lambda d, g: (lambda x, w, b: gp.conv1d(x, w, b, causal=True),
                            (_dd(2, 3, 9, device=d, g=g), _dd(3, 4, device=d, g=g), _dd(3, device=d, g=g))),
    "embedding": lambda d, g: (lambda w: gp.embedding(torch.tensor([[1, 4], [0, 4]], device=d), w),
                               (_dd(6, 8, device=d, g=g),)),
    "gated_act": lambda d, g: (gp.gated_act, (_dd(3, 8, device=d, g=g), _dd(3, 8, device=d, g=g))),
    "rotary": _rotary_call,
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(AUTOGRAD_CALLS))
def test_undifferentiated_call_equals_the_differentiated_one(device, name):
    fn, inputs = AUTOGRAD_CALLS[name](device, torch.Generator().manual_seed(6))
    graphed = fn(*inputs)
    assert graphed.requires_grad and graphed.grad_fn is not None
    with torch.no_grad():
        plain = fn(*inputs)
    frozen = fn(*[t.detach() for t in inputs])  # grad mode on, nothing requires grad
    with torch.inference_mode():  # generate() and serving stacks run here: inference tensors in and out
        inference = fn(*[t.detach().clone() for t in inputs])
    assert inference.is_inference()
    for out in (plain, frozen, inference):
        assert not out.requires_grad and out.grad_fn is None
        assert torch.equal(out, graphed.detach()), name
    torch.autograd.grad(graphed.sum(), inputs, allow_unused=True)  # the node still differentiates


@pytest.mark.parametrize("name", list(AUTOGRAD_CALLS))
def test_forward_mode_ad_is_refused_not_dropped(name):
    """A tangent on an input (torch.func.jvp, forward-mode AD) raises: the ops have no forward
    derivative, and returning the primal without its tangent would be silently wrong."""
    import torch.autograd.forward_ad as fwAD

    fn, inputs = AUTOGRAD_CALLS[name]("cpu", torch.Generator().manual_seed(7))
    inputs = [t.detach() for t in inputs]
    with fwAD.dual_level():
        dual = [fwAD.make_dual(t, torch.ones_like(t)) for t in inputs]
        with pytest.raises(RuntimeError, match="jvp"):
            fn(*dual)


def test_naive_kernel_is_forward_only_through_the_op():
    args = [torch.randn(3, 8, dtype=torch.float64, requires_grad=True) if i == 0 else
            torch.randn(*s, dtype=torch.float64) for i, s in enumerate([(3, 8), (8,), (8,), (5, 8), (5,)])]
    y = torch.ops.gpu_puzzles.fused_layernorm_linear_naive(*args)
    with pytest.raises(RuntimeError, match="fused_layernorm_linear_naive: the curriculum's kernel is forward only"):
        y.sum().backward()
