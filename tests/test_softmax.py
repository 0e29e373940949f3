"""softmax / log_softmax: seed example, float64 references, extremes, gradients, opcheck, compile, bad input."""
import math

import pytest
import torch
from conftest import (
    CPU_SIMD,
    DEVICES,
    HAS_CUDA,
    RACECHECK,
    SANITIZE,
    assert_close_ref,
    assert_compiled_matches_eager,
    copy_kernels,
    device_dtypes,
    kinds_for,
    many,
    poison_allocator,
    racecheck_skips,
    requires_cuda,
    sanitize_timing,
)
from hypothesis import given
from hypothesis import strategies as st
from strategies import OFFSET, dtypes, grad_close, layouts, make_tensor, seeds, shapes

import gpu_puzzles as gp

ALGORITHMS = ["auto", "tree", "shuffle", "online"]
FUNCS = {"softmax": (gp.softmax, torch.softmax), "log_softmax": (gp.log_softmax, torch.log_softmax)}
INF = float("inf")


def cuda_every_dtype_and_kind(test):
    """A CUDA test run for each float dtype, softmax and log_softmax (parameters dtype, kind)."""
    test = pytest.mark.parametrize("kind", ["softmax", "log_softmax"])(test)
    test = pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])(test)
    return requires_cuda(test)


def _ref64(x, dim, kind):
    return FUNCS[kind][1](x.double(), dim)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_seed_example(device, algorithm):
    y = gp.softmax(torch.tensor([1.0, 2.0, 3.0, 4.0], device=device), algorithm=algorithm)
    torch.testing.assert_close(y.cpu(), torch.tensor([0.0320586, 0.08714432, 0.2368828, 0.6439143]),
                               rtol=1e-6, atol=1e-7)
    # The seed's run: 128 random values, a probability distribution.
    x = torch.randn(128, device=device)
    y = gp.softmax(x, algorithm=algorithm)
    assert abs(y.sum().item() - 1.0) < 1e-5
    assert_close_ref(y, _ref64(x, -1, "softmax"), torch.float32, "seed 128")


# (shape, dim): short, medium and long rows, non-last dims, 1-element dims.
SHAPES = [((1,), 0), ((7,), -1), ((3, 1), -1), ((5, 33), -1), ((4, 300), 1), ((2, 3, 17), 1),
          ((2, 3, 17), 0), ((6, 1, 4), 1), ((2, 2500), -1), ((3, 4, 5, 6), -2)]


@pytest.mark.parametrize("device,dtype", device_dtypes())
@pytest.mark.parametrize("shape,dim", SHAPES)
@pytest.mark.parametrize("kind", ["softmax", "log_softmax"])
def test_forward_matches_reference(device, dtype, shape, dim, kind):
    torch.manual_seed(hash((shape, dim)) % 2**31)
    x = torch.randn(shape, device=device, dtype=dtype) * 3
    y = FUNCS[kind][0](x, dim)
    assert y.shape == x.shape and y.dtype == dtype and y.device == x.device
    assert_close_ref(y, _ref64(x, dim, kind), dtype, f"{kind} {shape} dim={dim}")


@pytest.mark.parametrize("device,dtype", device_dtypes())
@pytest.mark.parametrize("shape,dim", [((5, 33), -1), ((2, 3, 17), 1), ((2, 2500), -1), ((7,), 0)])
@pytest.mark.parametrize("kind", ["softmax", "log_softmax"])
def test_backward_matches_reference(device, dtype, shape, dim, kind):
    torch.manual_seed(11)
    x = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(shape, device=device, dtype=dtype)
    (dx,) = torch.autograd.grad(FUNCS[kind][0](x, dim), (x,), g)
    x64 = x.detach().double().requires_grad_()
    (ref,) = torch.autograd.grad(_ref64(x64, dim, kind), (x64,), g.double())
    assert dx.shape == x.shape and dx.dtype == dtype
    assert_close_ref(dx, ref, dtype, f"{kind} backward")


def test_long_row_cpu():
    x = torch.randn(2, 300_000) * 4
    assert_close_ref(gp.softmax(x), _ref64(x, -1, "softmax"), torch.float32, "long row")
    assert_close_ref(gp.log_softmax(x), _ref64(x, -1, "log_softmax"), torch.float32, "long row log")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("kind", ["softmax", "log_softmax"])
def test_extreme_values_match_torch(device, algorithm, kind):
    # Large magnitudes (stability), -inf entries, and torch's NaN cases: a row of
    # all -inf, a row holding +inf, a row holding NaN.
    rows = [[1e4, -1e4, 0.0, 1e4 - 1], [-1e30, 1e30, 5.0, -5.0], [1.0, -INF, 2.0, -INF],
            [-INF, -INF, -INF, -INF], [INF, 1.0, 2.0, 3.0], [INF, INF, 0.0, 0.0],
            [float("nan"), 1.0, 2.0, 3.0], [88.0, 89.0, -200.0, 0.0]]
    x = torch.tensor(rows, device=device)
    f, ref = FUNCS[kind]
    y, r = f(x, -1, algorithm=algorithm).cpu(), ref(x.cpu().double(), -1)
    assert torch.equal(torch.isnan(y), torch.isnan(r)), (y, r)
    torch.testing.assert_close(y.double(), r, rtol=1e-5, atol=1e-6, equal_nan=True)
    # the same over a non-last dim
    xt = x.t().contiguous()
    y, r = f(xt, 0, algorithm=algorithm).cpu(), ref(xt.cpu().double(), 0)
    torch.testing.assert_close(y.double(), r, rtol=1e-5, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["softmax", "log_softmax"])
def test_gradcheck(device, kind):
    torch.manual_seed(0)
    f = FUNCS[kind][0]
    for shape, dim in (((3, 9), -1), ((2, 5, 3), 1), ((4,), 0)):
        x = torch.randn(shape, device=device, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(lambda t: f(t, dim), (x,))


@pytest.mark.parametrize("device", DEVICES)
def test_zero_dim_and_empty(device):
    x = torch.tensor(3.5, device=device, requires_grad=True)
    for f, want in ((gp.softmax, 1.0), (gp.log_softmax, 0.0)):
        for dim in (0, -1):
            y = f(x, dim)
            assert y.shape == () and y.item() == want
    (dx,) = torch.autograd.grad(gp.softmax(x), (x,))
    assert dx.item() == 0.0
    for shape, dim in (((2, 0, 3), 1), ((0, 5), -1), ((4, 0), 0)):
        e = torch.randn(shape, device=device, requires_grad=True)
        y = gp.softmax(e, dim)
        assert y.shape == e.shape
        (de,) = torch.autograd.grad(y.sum(), (e,))
        assert de.shape == e.shape
        for algorithm in ("tree", "online"):
            assert gp.log_softmax(e.detach(), dim, algorithm=algorithm).shape == e.shape


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_input(device):
    base = torch.randn(6, 40, 5, device=device)
    for x, dim in ((base.transpose(1, 2), -1), (base.transpose(1, 2), 1), (base[:, ::3, :], 1), (base[..., 1], -1)):
        assert not x.is_contiguous()
        assert_close_ref(gp.softmax(x, dim), _ref64(x, dim, "softmax"), torch.float32, "strided")
        assert_close_ref(gp.log_softmax(x, dim), _ref64(x, dim, "log_softmax"), torch.float32, "strided log")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck(device, requires_grad):
    x = torch.randn(3, 10, 4, device=device, requires_grad=requires_grad)
    for op in (torch.ops.gpu_puzzles.softmax.default, torch.ops.gpu_puzzles.log_softmax.default):
        torch.library.opcheck(op, (x, -1, "auto"))
        torch.library.opcheck(op, (x, 1, "auto"))
    y = torch.softmax(x.detach(), 1)
    g = torch.randn_like(y)
    torch.library.opcheck(torch.ops.gpu_puzzles.softmax_backward.default, (g, y, 1, "auto"))
    torch.library.opcheck(torch.ops.gpu_puzzles.log_softmax_backward.default, (g, y.log(), 1, "auto"))


def test_compile_forward_backward():
    device = "cuda" if HAS_CUDA else "cpu"
    mod = gp.nn.Softmax(dim=-1)

    def f(x):
        return mod(x) * 2 + gp.log_softmax(x, 0)

    xs = [torch.randn(4, n, device=device, requires_grad=True) for n in (16, 23)]
    assert_compiled_matches_eager(f, [((x,), (x,)) for x in xs])


def test_modules():
    m = gp.nn.Softmax(1)
    x = torch.randn(3, 4, 5)
    torch.testing.assert_close(m(x), torch.softmax(x, 1))
    torch.testing.assert_close(gp.nn.LogSoftmax()(x), torch.log_softmax(x, -1))
    assert "dim=1" in repr(m)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input(device):
    cases = [
        (lambda: gp.softmax(torch.arange(6, device=device).view(2, 3)), "softmax: x must be a float"),
        (lambda: gp.log_softmax(torch.randn(2, 3, dtype=torch.complex64, device=device)),
         "log_softmax: x must be a float"),
        (lambda: gp.softmax(torch.randn(2, 3, device=device), 2), "dim 2 is out of range"),
        (lambda: gp.softmax(torch.randn(2, 3, device=device), -3), "dim -3 is out of range"),
        (lambda: gp.softmax(torch.tensor(1.0, device=device), 1), "dim 1 is out of range"),
        (lambda: gp.softmax(torch.randn(2, 3, device=device), algorithm="fastest"), "algorithm"),
        (lambda: torch.ops.gpu_puzzles.softmax_backward(torch.randn(2, 3, device=device),
                                                        torch.randn(2, 4, device=device), -1), "grad_out has shape"),
        (lambda: torch.ops.gpu_puzzles.softmax_backward(torch.randn(2, 3, device=device, dtype=torch.float64),
                                                        torch.randn(2, 3, device=device), -1), "grad_out has dtype"),
    ]
    for call, msg in cases:
        with pytest.raises((RuntimeError, ValueError), match=msg):
            call()


# ---- CUDA: every kernel path, every dtype, misaligned views, poisoned memory -----

# Last-dim rows: warp path (N <= 128 V), block path (<= 2048 V), split path
# (longer, or few long rows); odd lengths exercise the scalar fallback and tails.
CUDA_ROWS = [(1, 1), (64, 1), (33, 2), (9, 3), (17, 31), (8, 32), (5, 33), (40, 100), (3, 255), (6, 256), (6, 257),
             (4, 511), (2, 512), (3, 513), (7, 1000), (3, 1024), (2, 1025), (5, 2047), (3, 2048), (2, 4096),
             (3, 4097), (2, 8191), (2, 8192), (2, 16384), (2, 16385), (1, 65536), (3, 70001), (2, 131072),
             (1, 1_000_003), (many(300, 100), 40000)]
# Non-last dims (outer, N, inner): cached and uncached tiles, inner not a multiple of the tile.
CUDA_COLS = [(1, 1, 2), (2, 5, 3), (3, 7, 16), (2, 33, 17), (1, 4096, 256), (2, 5000, 9), (1, 20000, 8),
             (3, 3, 1000), (1, 100, 129)]


def _poison_cache():
    poison_allocator(64 << 20)


def _cuda_check(x, dim, kind, algorithm, dtype, what):
    if racecheck_skips(what):
        return
    with sanitize_timing(what):
        _cuda_check_(x, dim, kind, algorithm, dtype, what)


def _cuda_check_(x, dim, kind, algorithm, dtype, what):
    _poison_cache()
    y = FUNCS[kind][0](x, dim, algorithm=algorithm)
    ref = _ref64(x, dim, kind)
    assert_close_ref(y, ref, dtype, what)
    g = torch.randn_like(x)
    _poison_cache()
    op = torch.ops.gpu_puzzles.softmax_backward if kind == "softmax" else torch.ops.gpu_puzzles.log_softmax_backward
    dx = op(g, y, dim, algorithm)
    # Reference backward from our own output y, in float64.
    y64, g64 = y.double(), g.double()
    if kind == "softmax":
        ref_dx = y64 * (g64 - (g64 * y64).sum(dim, keepdim=True))
    else:
        ref_dx = g64 - y64.exp() * g64.sum(dim, keepdim=True)
    n = x.shape[dim] if x.dim() else 1
    scale = math.sqrt(max(1, n)) if kind == "log_softmax" else 1.0  # sum(dy) grows like sqrt(N)
    assert_close_ref(dx / scale, ref_dx / scale, dtype, what + " backward")


# One test per shape: the sanitizer's launch cover (tools/sanitize_cover.py) then picks only the
# shapes that make a launch no other test makes, and its queue spreads them over processes.
@cuda_every_dtype_and_kind
@pytest.mark.parametrize("rows, n", CUDA_ROWS, ids=[f"{r}x{n}" for r, n in CUDA_ROWS])
def test_cuda_rows_all_paths(dtype, kind, rows, n):
    torch.manual_seed(5)
    x = torch.randn(rows, n, device="cuda", dtype=dtype) * 2
    _cuda_check(x, -1, kind, "auto", dtype, f"{kind} rows ({rows},{n}) {dtype}")
    if rows * n < 5_000_000:  # misaligned view: the scalar path
        xm = make_tensor((rows, n), dtype, "cuda", OFFSET, seed=n)
        _cuda_check(xm, -1, kind, "auto", dtype, f"{kind} misaligned ({rows},{n})")


@cuda_every_dtype_and_kind
@pytest.mark.parametrize("shape", CUDA_COLS, ids=["x".join(map(str, s)) for s in CUDA_COLS])
def test_cuda_columns_all_paths(dtype, kind, shape):
    torch.manual_seed(6)
    _check_columns([shape], kind, dtype, scale=2, dim0=True)


def _check_columns(shapes, kind, dtype, scale, dim0=False, misaligned_below=0):
    """Each (outer, n, inner) of ``shapes`` over dim 1; over dim 0 too with ``dim0``, and as a
    misaligned view where it has fewer than ``misaligned_below`` elements."""
    for o, n, i in shapes:
        x = torch.randn(o, n, i, device="cuda", dtype=dtype) * scale
        _cuda_check(x, 1, kind, "auto", dtype, f"{kind} cols ({o},{n},{i}) {dtype}")
        if dim0:
            _cuda_check(x, 0, kind, "auto", dtype, f"{kind} dim0 ({o},{n},{i}) {dtype}")
        if o * n * i < misaligned_below:
            xm = make_tensor((o, n, i), dtype, "cuda", OFFSET, seed=n)
            _cuda_check(xm, 1, kind, "auto", dtype, f"{kind} cols misaligned ({o},{n},{i})")


@requires_cuda
@pytest.mark.parametrize("algorithm", ["tree", "shuffle", "online"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_cuda_teaching_algorithms(algorithm, dtype):
    torch.manual_seed(7)
    for shape, dim in (((3, 1), -1), ((5, 100), -1), ((2, 4097), -1), ((1, 300_000), -1), ((4, 50, 6), 1)):
        x = torch.randn(shape, device="cuda", dtype=dtype) * 2
        for kind in ("softmax", "log_softmax"):
            _cuda_check(x, dim, kind, algorithm, dtype, f"{algorithm} {kind} {shape}")


@requires_cuda
def test_cuda_fp32_accuracy_tight():
    # fp32 against float64 at ~1e-6 relative: exp must be the accurate expf, not __expf.
    torch.manual_seed(8)
    for shape in ((64, 512), (16, 4096), (2, 200_000)):
        x = torch.randn(shape, device="cuda") * 5
        y = gp.softmax(x).double()
        r = torch.softmax(x.double(), -1)
        # Rounding x - max to float32 alone costs ~2e-6 relative for the smallest entries
        # (torch.softmax itself reaches 3e-6 to 2e-5 here).
        rel = ((y - r).abs() / r.abs().clamp_min(1e-30)).max().item()
        assert rel < 5e-6, (shape, rel)
        assert (y - r).abs().max().item() / r.max().item() < 1e-6


@requires_cuda
def test_cuda_matches_cpu_and_large_magnitudes():
    torch.manual_seed(9)
    for shape, dim in (((8, 3000), -1), ((4, 700, 3), 1)):
        x = torch.randn(shape, device="cuda") * 1e3
        torch.testing.assert_close(gp.softmax(x, dim).cpu(), gp.softmax(x.cpu(), dim), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gp.log_softmax(x, dim).cpu(), gp.log_softmax(x.cpu(), dim), rtol=1e-5, atol=1e-3)


@requires_cuda
def test_cuda_backward_deterministic():
    y = torch.softmax(torch.randn(8, 200_000, device="cuda"), -1)
    g = torch.randn_like(y)
    first = torch.ops.gpu_puzzles.softmax_backward(g, y, -1)
    for _ in range(3):
        assert torch.equal(first, torch.ops.gpu_puzzles.softmax_backward(g, y, -1))


@requires_cuda
def test_mixed_devices():
    with pytest.raises(RuntimeError, match="on the same device"):
        torch.ops.gpu_puzzles.softmax_backward(torch.randn(2, 3), torch.randn(2, 3, device="cuda"), -1)
    assert gp.softmax(torch.zeros(2, 4, device="cuda")).sum().item() == 2.0



@requires_cuda
@pytest.mark.parametrize("kind", ["softmax", "log_softmax"])
def test_cuda_extremes_on_every_row_path(kind):
    # -inf entries, an all -inf row, a +inf row and a NaN row on the warp, block,
    # cluster and split paths and the column path: NaN exactly where torch has it.
    torch.manual_seed(10)
    f, ref = FUNCS[kind]
    for n in (5, 300, 3000, 20000, 140000):
        x = torch.randn(6, n, device="cuda") * 10
        x[0, ::3] = -INF
        x[1] = -INF
        x[2, n // 2] = INF
        x[3, n - 1] = float("nan")
        x[4, :-1] = -INF  # a single finite entry: probability 1
        for xx, dim in ((x, -1), (x.t().contiguous(), 0)):
            y, r = f(xx, dim).cpu().double(), ref(xx.cpu().double(), dim)
            assert torch.equal(torch.isnan(y), torch.isnan(r)), (n, dim)
            torch.testing.assert_close(y, r, rtol=1e-5, atol=1e-6, equal_nan=True)


# ---- CUDA: the fast forward kernels (warp per row, cluster per row, cluster per column tile) ----
# Auto forward thresholds (V = elements per 16 bytes: 8 for 2-byte types, 4 for float32):
#   warp per row, packed : 128 V < N <= 512 V (CH = 8 up to 256 V, else 16), 2- and 4-byte types;
#   cluster per row      : 2048 V < N <= 131072, 2 to 8 blocks of 128-512 threads, 2- and 4-byte types;
#   cluster per column   : dim not last, 512 < N <= 4096, inner % V == 0, inner * size >= 64, aligned.
# The backward of these shapes keeps the older kernels (checked by _cuda_check too).


def _fast_row_lengths(v):
    return [128 * v - 1, 128 * v + 1, 200 * v + 3, 256 * v, 256 * v + 1, 333 * v + 5, 512 * v - 1, 512 * v,
            512 * v + 1]


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["softmax", "log_softmax"])
def test_cuda_fast_row_warp_thresholds(dtype, kind):
    torch.manual_seed(21)
    v = 16 // torch.empty((), dtype=dtype).element_size()
    for n in _fast_row_lengths(v):
        for rows in (1, 5, 131):  # 131: blocks of 4 warps with a ragged last block
            x = torch.randn(rows, n, device="cuda", dtype=dtype) * 3
            _cuda_check(x, -1, kind, "auto", dtype, f"{kind} row-warp ({rows},{n}) {dtype}")
        xm = make_tensor((3, n), dtype, "cuda", OFFSET, seed=n)
        _cuda_check(xm, -1, kind, "auto", dtype, f"{kind} row-warp misaligned (3,{n})")


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["softmax", "log_softmax"])
def test_cuda_fast_cluster_rows(dtype, kind):
    torch.manual_seed(22)
    v = 16 // torch.empty((), dtype=dtype).element_size()
    # Around the block/cluster edge, each cluster size (16384 elements per block of 512) and the
    # cluster/split edge at 131072.
    lengths = [2048 * v + 1, 2048 * v + v, 16383, 16385, 24577, 32768, 32769, 65535, 65537, 100003, 131071, 131072,
               131073]
    for n in sorted(set(x for x in lengths if x > 2048 * v)):
        rows = 3 if n > 60000 else 7
        x = torch.randn(rows, n, device="cuda", dtype=dtype) * 3
        _cuda_check(x, -1, kind, "auto", dtype, f"{kind} cluster ({rows},{n}) {dtype}")
        xm = make_tensor((2, n), dtype, "cuda", OFFSET, seed=n)
        _cuda_check(xm, -1, kind, "auto", dtype, f"{kind} cluster misaligned (2,{n})")
    # Many rows: clusters retire and start while others still read their partials.
    x = torch.randn(many(300, 100), 40000, device="cuda", dtype=dtype)
    _cuda_check(x, -1, kind, "auto", dtype, f"{kind} cluster ({x.shape[0]},40000) {dtype}")


# (outer, N, inner): cluster sizes 2 / 4 / 8, N odd, inner a multiple of the tile or not, inner just
# wide enough, and shapes next to the path that must take the older column kernel (N = 512, 4097,
# inner too narrow or not a multiple of V). The benchmark shape's 64 outer rows only add tiles of the
# same path (the variant tests' many-tiles case wraps the grid): 8 under the sanitizer.
FAST_COLS = [(many(64, 8), 4096, 256), (2, 513, 64), (3, 1000, 40), (2, 1025, 256), (1, 2047, 264), (2, 2049, 96),
             (1, 3001, 520), (2, 4096, 32), (1, 4096, 8), (2, 512, 64), (1, 4097, 64), (2, 1500, 33)]


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["softmax", "log_softmax"])
def test_cuda_fast_cluster_columns(dtype, kind):
    torch.manual_seed(23)
    _check_columns(FAST_COLS, kind, dtype, scale=3, misaligned_below=2_000_000)  # misaligned: the older kernel
    # A 4-d tensor over a middle dim (outer and inner both products of sizes).
    x = torch.randn(2, 3, 1100, 8, 16, device="cuda", dtype=dtype)
    _cuda_check(x, 2, kind, "auto", dtype, f"{kind} 5-d dim=2 {dtype}")


def _extreme_rows(rows, n):
    """float32 (rows, n) on the GPU, randn * 10 with: row 0 every third entry -inf, row 1 all -inf,
    row 2 one +inf, row 3 one NaN, row 4 one finite entry, rows 5 / 6 the leading two thirds / the
    trailing two thirds -inf (whole warps, blocks and cluster ranks empty), row 7 (if asked for)
    huge magnitudes (exp(-max) overflows float)."""
    x = torch.randn(rows, n, device="cuda", dtype=torch.float32) * 10
    x[0, ::3] = -INF
    x[1] = -INF
    x[2, n // 2] = INF
    x[3, n - 1] = float("nan")
    x[4, :-1] = -INF
    x[5, : (2 * n) // 3] = -INF
    x[6, n // 3:] = -INF
    if rows > 7:
        x[7] = x[7] * 1e4 - 1e6
    return x


@requires_cuda
@pytest.mark.parametrize("kind", ["softmax", "log_softmax"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_fast_kernels_extremes(kind, dtype):
    # -inf, whole warps / blocks / cluster ranks of -inf (empty partial pairs), an all -inf line,
    # +inf, NaN and a single finite entry, on each fast path: NaN exactly where torch has it.
    torch.manual_seed(24)
    f, ref = FUNCS[kind]
    v = 16 // torch.empty((), dtype=dtype).element_size()
    for n in (300 * v, 50000, 131072, 3000):
        x = _extreme_rows(7, n).to(dtype)
        lines = [(x, -1)]
        if n <= 4096:  # the column path: (1, n, 7 * 64) over dim 1, every column one of the rows above
            lines.append((x.t().contiguous().repeat_interleave(64, dim=1).unsqueeze(0), 1))
        for xx, dim in lines:
            y, r = f(xx, dim).cpu().double(), ref(xx.cpu().double(), dim)
            assert torch.equal(torch.isnan(y), torch.isnan(r)), (n, dim, dtype)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(y, r, rtol=tol, atol=tol, equal_nan=True)
        # Every entry far below 0 (exp(-max) overflows float) with padding and -inf warps about.
        x = (torch.randn(3, n, device="cuda") - 300).to(dtype)
        x[1, : n // 2] = -INF
        y, r = f(x, -1).cpu().double(), ref(x.cpu().double(), -1)
        assert not torch.isnan(y).any(), (n, dtype)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(y, r, rtol=tol, atol=tol)


@requires_cuda
def test_cuda_fast_kernels_deterministic():
    # Cluster merges run in a fixed order: the same input gives the same bits.
    torch.manual_seed(25)
    for shape, dim in (((4, 100000), -1), ((3, 3000, 256), 1), ((64, 4000), -1)):
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        first = gp.softmax(x, dim)
        for _ in range(3):
            assert torch.equal(first, gp.softmax(x, dim))


# ---- kernel variants (gpu_puzzles.tuning.override, the sweep's knobs) ---------------------------
# Every variant must be right on every shape it can be dispatched for; shapes outside a variant's
# range (N not a multiple of the vector, misaligned views, too long) must fall back correctly.
def _knobs(**kw):
    return {f"softmax_{k}": v for k, v in kw.items()}


ROW_VARIANTS = [_knobs(rows="staged", cluster=8, stages=2), _knobs(rows="staged", cluster=16, stages=2),
                _knobs(rows="staged", cluster=8, stages=3), _knobs(rows="staged", cluster=16, stages=3),
                _knobs(rows="cluster"),
                _knobs(rows="smem", cluster=8), _knobs(rows="smem", cluster=16), _knobs(rows="bulk", cluster=4),
                _knobs(rows="bulk", cluster=8), _knobs(rows="smem", smem_align="same"),
                _knobs(rows="smem", smem_align="shifted")]
COL_VARIANTS = [_knobs(cols="staged", col_rows_fwd=8, col_rows_bwd=8, stages=2),
                _knobs(cols="staged", col_rows_fwd=8, col_rows_bwd=8, stages=1),
                _knobs(cols="staged", col_rows_fwd=16, col_rows_bwd=16, stages=1),
                _knobs(cols="staged", col_rows_fwd=16, col_rows_bwd=16, stages=2),
                _knobs(cols="staged", col_rows_fwd=4, col_rows_bwd=4, stages=3),
                _knobs(cols="staged", col_rows_fwd=8, col_rows_bwd=8, stages=3), _knobs(cols="inner")]
# The built-in defaults spelled out: the same kernels as no override.
DEFAULT_KNOBS = _knobs(rows="smem", cluster=8, stages=1, cols="staged", col_rows_fwd=16, col_rows_bwd=8, grid=1)


def _variant_id(v):
    return ",".join(f"{k[len('softmax_'):]}={x}" for k, x in v.items())


@pytest.fixture
def variant(request):
    """The test runs under the knobs of its parameter; the fixture's value is their label."""
    with gp.tuning.override(**request.param):
        yield _variant_id(request.param)


def test_variant_knobs_cpu():
    x = torch.randn(3, 50)
    ref = torch.ops.gpu_puzzles.softmax(x, -1, "auto")
    for v in ROW_VARIANTS + COL_VARIANTS + [_knobs(grid=1), _knobs(grid=4, stages=1), DEFAULT_KNOBS]:
        with gp.tuning.override(**v):
            assert {k: gp.tuning.knobs()[k][1] for k in v} == {k: str(x) for k, x in v.items()}
            assert torch.equal(torch.ops.gpu_puzzles.softmax(x, -1, "auto"), ref)
        assert all(gp.tuning.knobs()[k][1] is None for k in v)  # restored on exit
    # An unknown value or knob names the knob; the algorithm string carries no tuning.
    for bad, word in ((_knobs(rows="bogus"), "softmax_rows"), (_knobs(cluster=3), "softmax_cluster"),
                      (_knobs(nope=1), "softmax_nope"), (_knobs(grid=2), "softmax_grid"),
                      (_knobs(col_rows_fwd=2), "softmax_col_rows_fwd"),
                      (_knobs(smem_align="odd"), "softmax_smem_align")):
        with pytest.raises(RuntimeError, match=word):
            with gp.tuning.override(**bad):
                pass
    with pytest.raises(RuntimeError, match="algorithm"):
        torch.ops.gpu_puzzles.softmax(x, -1, "auto:rows=staged")


def _variant_row_lengths(v):
    # Block/cluster edge (2048 V), N % V != 0 (older kernels), each cluster size's capacity
    # (512 threads x 8 or 4 vectors x V per block), the staged limit (16 blocks x 512 x 8 V)
    # and one past it (split path), the shared-memory slices' limit (16 blocks x 220 KB) and one past.
    top = 16 * 512 * 8 * v
    smem_top = 16 * 220 * 1024 // (16 // v)
    return sorted({2048 * v, 2048 * v + 1, 2048 * v + v, 4096 * v + v, 16384 + v, 32768 - v, 32768 + v, 65536 + 3 * v,
                   100000 - 100000 % v, 131072, 131072 + v, 200000 - 200000 % v, top, top + v, smem_top,
                   smem_top + v})


@requires_cuda
@pytest.mark.parametrize("variant", ROW_VARIANTS, ids=_variant_id, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_variants_rows(variant, dtype):
    if RACECHECK and "smem_align" in variant:
        pytest.skip("racecheck: test_cuda_smem_row_variants runs each shared-memory row kernel variant")
    torch.manual_seed(31)
    v = 16 // torch.empty((), dtype=dtype).element_size()
    for j, n in enumerate(_variant_row_lengths(v)):
        kinds = kinds_for(j) if n < 150000 else ["softmax"]
        for kind in kinds:
            x = torch.randn(2 if n > 150000 else 3, n, device="cuda", dtype=dtype) * 3
            _cuda_check(x, -1, kind, "auto", dtype, f"{variant} {kind} ({x.shape[0]},{n}) {dtype}")
        if n < 150000 and not RACECHECK:
            base = torch.randn(2 * n + v, device="cuda", dtype=dtype)  # misaligned: the older kernels
            _cuda_check(base[1:2 * n + 1].view(2, n), -1, "softmax", "auto", dtype, f"{variant} misaligned {n}")
    # Many rows per resident cluster: every stage slot is reused many times, rows wrap.
    for rows, n in ((many(1000, 150), 40000 - 40000 % v), (many(300, 120), 131072)):
        x = torch.randn(rows, n, device="cuda", dtype=dtype)
        _cuda_check(x, -1, "softmax", "auto", dtype, f"{variant} ({rows},{n}) {dtype}")


@requires_cuda
@pytest.mark.parametrize("variant", COL_VARIANTS, ids=_variant_id, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_variants_columns(variant, dtype):
    torch.manual_seed(32)
    # The staged kernel's reach is set by shared memory (rows per thread grow once the cluster has
    # 16 blocks): the backward's edge near N = 6656 and the forward's near 13824 (2 stages).
    shapes = FAST_COLS + [(3, 8192, 64), (2, 8193, 64), (5, 6000, 72), (1, 600, 4104),
                          (2, 6656, 64), (2, 6657, 64), (1, 13824, 64), (1, 13825, 64)]
    for j, (o, n, i) in enumerate(shapes):
        for kind in kinds_for(j):
            x = torch.randn(o, n, i, device="cuda", dtype=dtype) * 3
            _cuda_check(x, 1, kind, "auto", dtype, f"{variant} {kind} cols ({o},{n},{i}) {dtype}")
        if o * n * i < 2_000_000 and not RACECHECK:
            xm = make_tensor((o, n, i), dtype, "cuda", OFFSET, seed=n)
            _cuda_check(xm, 1, "softmax", "auto", dtype, f"{variant} misaligned ({o},{n},{i})")
    # Many tiles per resident cluster (stage slots reused, tiles wrap) and a 5-d middle dim.
    x = torch.randn(many(300, 60), 1500, 128, device="cuda", dtype=dtype)
    _cuda_check(x, 1, "softmax", "auto", dtype, f"{variant} cols ({x.shape[0]},1500,128)")
    x = torch.randn(2, 3, 1100, 8, 16, device="cuda", dtype=dtype)
    _cuda_check(x, 2, "log_softmax", "auto", dtype, f"{variant} 5-d dim=2")


@requires_cuda
@pytest.mark.parametrize("variant", ROW_VARIANTS + COL_VARIANTS, ids=_variant_id, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_variants_extremes(variant, dtype):
    # -inf, all -inf lines, whole warps / blocks / cluster ranks of -inf, +inf, NaN, huge negative
    # values, under each variant: NaN exactly where torch has it, and values close elsewhere.
    torch.manual_seed(33)
    v = 16 // torch.empty((), dtype=dtype).element_size()
    for j, n in enumerate((50000 - 50000 % v, 131072, 3000, 4096)):
        x = _extreme_rows(8, n).to(dtype)
        lines = [(x, -1)] if n > 4096 else [(x.t().contiguous().repeat_interleave(64, dim=1).unsqueeze(0), 1)]
        for kind in kinds_for(j):
            f, ref = FUNCS[kind]
            op = torch.ops.gpu_puzzles.softmax if kind == "softmax" else torch.ops.gpu_puzzles.log_softmax
            for xx, dim in lines:
                if racecheck_skips(f"extremes {kind} n={n}"):
                    continue
                _poison_cache()
                with sanitize_timing(f"extremes {kind} n={n}"):
                    y = op(xx, dim, "auto").cpu().double()
                r = ref(xx.cpu().double(), dim)
                assert torch.equal(torch.isnan(y), torch.isnan(r)), (variant, n, dim, dtype, kind)
                tol = 1e-5 if dtype == torch.float32 else 2e-2
                torch.testing.assert_close(y, r, rtol=tol, atol=tol, equal_nan=True)


@requires_cuda
@pytest.mark.parametrize("variant", ROW_VARIANTS + COL_VARIANTS, ids=_variant_id, indirect=True)
def test_cuda_variants_deterministic(variant):
    # Fixed merge orders: the same input gives the same bits, forward and backward.
    torch.manual_seed(34)
    fwd, bwd = torch.ops.gpu_puzzles.softmax, torch.ops.gpu_puzzles.softmax_backward
    for shape, dim in (((many(40, 12), 100000), -1), ((many(16, 4), 4096, 256), 1)):
        if racecheck_skips(f"deterministic {shape}"):
            continue
        with sanitize_timing(f"deterministic {shape}"):
            x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
            g = torch.randn_like(x)
            y = fwd(x, dim, "auto")
            dx = bwd(g, y, dim, "auto")
            for _ in range(1 if RACECHECK else 2):  # racecheck: one repeat is the comparison
                assert torch.equal(y, fwd(x, dim, "auto"))
                assert torch.equal(dx, bwd(g, y, dim, "auto"))


@requires_cuda
def test_cuda_variant_override():
    # An override holds for every call inside the block and is undone after it: the defaults
    # spelled out as knobs give the bits of no override, and after each variant's block (nested
    # inside another override, too) the plain call gives them again.
    torch.manual_seed(0)
    fwd, bwd = torch.ops.gpu_puzzles.softmax, torch.ops.gpu_puzzles.softmax_backward
    x = torch.randn(many(64, 4), 131072, device="cuda")
    c = torch.randn(many(8, 2), 4096, 256, device="cuda", dtype=torch.bfloat16)
    g = torch.randn_like(c)

    def run():
        y = fwd(c, 1, "auto")
        return fwd(x, -1, "auto"), y, bwd(g, y, 1, "auto")

    base = run()
    with gp.tuning.override(**DEFAULT_KNOBS):
        assert all(torch.equal(a, b) for a, b in zip(base, run()))
    for v in (_knobs(rows="cluster", cols="inner"),
              _knobs(rows="staged", cluster=16, stages=3, cols="staged", col_rows_fwd=8, col_rows_bwd=4),
              _knobs(rows="bulk", cluster=4)):
        with gp.tuning.override(softmax_grid=1):
            with gp.tuning.override(**v):
                first = run()
                assert all(torch.equal(a, b) for a, b in zip(first, run())), v
            assert gp.tuning.knobs()["softmax_grid"][1] == "1"
        assert all(torch.equal(a, b) for a, b in zip(base, run())), v


# ---- property tests (hypothesis; profile from GPU_PUZZLES_HYPOTHESIS_PROFILE, see conftest) ----



@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["softmax", "log_softmax"])
@given(data=st.data())
def test_property_forward_backward(device, kind, data):
    """Random rank (0-d to 4-d), extents (0, 1, primes, warp/vector edges), dim (negative
    too), algorithm, dtype, value scale and strides (stride 0 along the reduced dim too)
    against float64, forward and backward."""
    dtype = data.draw(dtypes(device), "dtype")
    cap = 3000 if device == "cpu" else 20000
    shape = data.draw(shapes(min_dims=0, max_dims=4, max_side=1100, allow_empty=True, max_numel=cap), "shape")
    nd = max(1, len(shape))
    dim = data.draw(st.integers(-nd, nd - 1), "dim")
    algorithm = data.draw(st.sampled_from(ALGORITHMS), "algorithm")
    scale = data.draw(st.sampled_from([1.0, 8.0, 60.0]), "scale")
    seed = data.draw(seeds(), "seed")
    x = make_tensor(shape, dtype, device, data.draw(layouts(len(shape)), "layout"), seed, scale=scale,
                    requires_grad=True)
    f = FUNCS[kind][0]
    y = f(x, dim, algorithm=algorithm)
    assert y.shape == x.shape and y.dtype == dtype
    x64 = x.detach().double().requires_grad_()
    y_ref = _ref64(x64, dim, kind)
    assert_close_ref(y, y_ref, dtype, "forward")
    g = make_tensor(shape, dtype, device, seed=seed + 1)
    (dx,) = torch.autograd.grad(y, (x,), g)
    (dx_ref,) = torch.autograd.grad(y_ref, (x64,), g.double())
    n = shape[dim] if shape else 1
    # log_softmax's dx holds sum(dy) over the row: rounding grows like sqrt(n)
    grad_close(dx, dx_ref, dtype, "dx", n if kind == "log_softmax" else 1)


# ---- CPU kernels at every SIMD level (csrc/common/cpu_isa.h) ---------------------------
# The CPU kernels are compiled for the baseline, AVX2 and AVX-512 and picked at run time;
# the cpu_simd knob caps the level, so every copy this CPU can run is checked here.
# Row lengths around the vector widths (8 / 16 floats, 4 / 8 doubles) and the 4096-element
# chunk of the sums; (outer, N, inner) views with inner below, at and past a vector and
# past a column block (4 vectors), and a (N, 1) column.
CPU_ROWS = [1, 3, 7, 8, 9, 15, 16, 17, 31, 33, 100, 1023, 4095, 4097, 9000]
CPU_COLS = [((3, 40, 2), 1), ((2, 33, 5), 1), ((2, 9, 8), 1), ((2, 17, 16), 1), ((3, 7, 17), 1),
            ((2, 10, 70), 1), ((1, 5, 130), 1), ((65, 3), 0), ((4100, 2), 0), ((50, 1), 0)]


def _cpu_simd_levels():
    return [lvl for lvl in CPU_SIMD if CPU_SIMD.index(lvl) <= CPU_SIMD.index(torch.ops.gpu_puzzles._cpu_isa())]


@pytest.mark.parametrize("level", CPU_SIMD)
def test_cpu_simd_knob_caps_the_level(level):
    best = torch.ops.gpu_puzzles._cpu_isa()
    with gp.tuning.override(cpu_simd=level):
        got = torch.ops.gpu_puzzles._cpu_isa()
    # A cap: never above what this CPU (and this build) runs.
    assert got == CPU_SIMD[min(CPU_SIMD.index(level), CPU_SIMD.index(best))]
    assert torch.ops.gpu_puzzles._cpu_isa() == best


@pytest.mark.parametrize("level", CPU_SIMD)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["softmax", "log_softmax"])
def test_cpu_every_simd_level(level, dtype, kind):
    torch.manual_seed(5)
    f = FUNCS[kind][0]
    cases = [((2, n), -1) for n in CPU_ROWS] + CPU_COLS
    with gp.tuning.override(cpu_simd=level):
        for shape, dim in cases:
            x = (torch.randn(shape, dtype=torch.float64) * 3).to(dtype).requires_grad_()
            g = torch.randn(shape, dtype=dtype)
            y = f(x, dim)
            what = f"{kind} {shape} dim={dim} {dtype} {level}"
            assert_close_ref(y, _ref64(x.detach(), dim, kind), dtype, what)
            (dx,) = torch.autograd.grad(y, (x,), g)
            x64 = x.detach().double().requires_grad_()
            (ref,) = torch.autograd.grad(_ref64(x64, dim, kind), (x64,), g.double())
            n = x.shape[dim]
            assert_close_ref(dx / max(1.0, n ** 0.5), ref / max(1.0, n ** 0.5), dtype, what + " backward")


@pytest.mark.parametrize("level", CPU_SIMD)
@pytest.mark.parametrize("kind", ["softmax", "log_softmax"])
def test_cpu_extremes_every_simd_level(level, kind):
    # The extreme rows, long enough to take the vector loops (and their tails), as rows
    # and as columns (inner 16 and inner 3).
    rows = torch.tensor([[1e4, -1e4, 0.0, 1e4 - 1], [-1e30, 1e30, 5.0, -5.0], [1.0, -INF, 2.0, -INF],
                         [-INF, -INF, -INF, -INF], [INF, 1.0, 2.0, 3.0], [float("nan"), 1.0, 2.0, 3.0]])
    x = rows.repeat(1, 9)[:, :35]
    f, ref = FUNCS[kind]
    with gp.tuning.override(cpu_simd=level):
        for xx, dim in ((x, -1), (x.t().contiguous().repeat(1, 3)[:, :16], 0), (x.t().contiguous()[:, :3], 0)):
            y, r = f(xx, dim), ref(xx.double(), dim)
            assert torch.equal(torch.isnan(y), torch.isnan(r)), (level, dim, y, r)
            torch.testing.assert_close(y.double(), r, rtol=1e-5, atol=1e-6, equal_nan=True)


def test_cpu_simd_follows_aten_cpu_capability():
    # PyTorch's own cap on its CPU kernels caps ours too (read once per process).
    import os
    import subprocess
    import sys
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default")
    out = subprocess.run([sys.executable, "-c", "import gpu_puzzles, torch; print(torch.ops.gpu_puzzles._cpu_isa())"],
                         env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "baseline"


def test_cpu_simd_levels_agree():
    # The same numbers from every level (up to the exp implementations' last bits).
    torch.manual_seed(2)
    x = torch.randn(7, 1000) * 4
    outs = []
    for level in _cpu_simd_levels():
        with gp.tuning.override(cpu_simd=level):
            outs.append((gp.softmax(x), gp.log_softmax(x), gp.softmax(x.view(7, 10, 100), 1)))
    for o in outs[1:]:
        for a, b in zip(o, outs[0]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_cpu_long_row_fp64_and_threads():
    # float64 stays at float64 accuracy on a long row, and the result does not depend
    # on the thread count.
    x = torch.randn(3, 200_001, dtype=torch.float64) * 5
    assert_close_ref(gp.log_softmax(x), _ref64(x, -1, "log_softmax"), torch.float64, "long fp64")
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gp.softmax(x.float().view(3, 1, 200_001).expand(3, 4, -1).contiguous(), -1)
        torch.set_num_threads(max(2, prev))
        many_ = gp.softmax(x.float().view(3, 1, 200_001).expand(3, 4, -1).contiguous(), -1)
    finally:
        torch.set_num_threads(prev)
    assert torch.equal(one, many_)


# ---- odd row lengths, any alignment, strided rows without a copy ---------------------------------
# Rows of an odd length N start at r N elements: most are not 16-byte aligned. The long-row kernel
# (smem_rows_kernel, forward and backward, N > 2048 V) takes them, and rows at any strides, as they
# come; the other row kernels read them element by element. Outputs are fresh contiguous tensors.

_BWD_OPS = {"softmax": torch.ops.gpu_puzzles.softmax_backward.default,
            "log_softmax": torch.ops.gpu_puzzles.log_softmax_backward.default}
_FWD_OPS = {"softmax": torch.ops.gpu_puzzles.softmax.default, "log_softmax": torch.ops.gpu_puzzles.log_softmax.default}


def _vec(dtype):
    return 16 // torch.empty((), dtype=dtype).element_size()


def _strided_copy(t, pad):
    """t's values in a view t' = big[..., :N] of a wider buffer (its pad columns random)."""
    big = torch.randn(*t.shape[:-1], t.shape[-1] + pad, device=t.device, dtype=t.dtype)
    big[..., :t.shape[-1]] = t
    return big[..., :t.shape[-1]]


def _check_rows(x, g, kind, dtype, what, y_view=None):
    """The forward and backward ops called directly on x, g (any layout) vs float64 references;
    outputs poisoned first. y_view(y) gives the y the backward reads (default: y itself)."""
    if racecheck_skips(what):
        return
    with sanitize_timing(what):
        _poison_cache()
        y = _FWD_OPS[kind](x, -1, "auto")
        assert y.shape == x.shape and y.is_contiguous()
        assert_close_ref(y, _ref64(x, -1, kind), dtype, what)
        yb = y_view(y) if y_view else y
        _poison_cache()
        dx = _BWD_OPS[kind](g, yb, -1, "auto")
        assert dx.is_contiguous()
        y64, g64 = y.double(), g.double()
        if kind == "softmax":
            ref_dx = y64 * (g64 - (g64 * y64).sum(-1, keepdim=True))
        else:
            ref_dx = g64 - y64.exp() * g64.sum(-1, keepdim=True)
        scale = math.sqrt(x.shape[-1]) if kind == "log_softmax" else 1.0  # sum(dy) grows like sqrt(N)
        assert_close_ref(dx / scale, ref_dx / scale, dtype, what + " backward")


def _odd_lengths(v):
    # N = k V +/- 1..V-1 next to each row kernel's edge (warp 32 V / 128 V, warp-per-row 512 V,
    # block and shared-memory rows 2048 V, the shared-memory slices' cluster doubling), plus the
    # GPT-2 and a Llama-2 style vocabulary.
    edges = [32 * v, 128 * v, 512 * v, 2048 * v, 4096 * v, 16384 * v // 2]
    near = {e + d for e in edges for d in (-(v - 1), -1, 1, v - 1) if e + d > 0}
    return sorted(near | {50257, 32003})


@cuda_every_dtype_and_kind
def test_cuda_odd_lengths(dtype, kind):
    torch.manual_seed(41)
    v = _vec(dtype)
    lengths = _odd_lengths(v)
    if RACECHECK:  # seconds per launch of the shared-memory kernels: one length past their edge
        lengths = [n for n in lengths if n <= 2048 * v + 1]
    for j, n in enumerate(lengths):
        if kind not in kinds_for(j):
            continue
        rows = 3 if n > 20000 else 5
        x = torch.randn(rows, n, device="cuda", dtype=dtype) * 3
        g = torch.randn(rows, n, device="cuda", dtype=dtype)
        _check_rows(x, g, kind, dtype, f"{kind} odd ({rows},{n}) {dtype}")


@cuda_every_dtype_and_kind
def test_cuda_offset_views(dtype, kind):
    # x = buf[off:off + R N].view(R, N) for every element offset of a 16-byte vector, dy at a
    # different offset: input, dy and output misaligned against each other, row by row.
    torch.manual_seed(42)
    v = _vec(dtype)
    lengths = [100, 1000, 2048 * v + 3, 50257] if not RACECHECK else [2048 * v + 3]
    for n in lengths:
        rows = 3
        offsets = range(v) if n < 20000 else many(range(v), (0, 1, v - 1))
        if RACECHECK:
            offsets = (0, v // 2)
        for off in offsets:
            buf = torch.randn(rows * n + v, device="cuda", dtype=dtype) * 3
            gbuf = torch.randn(rows * n + v, device="cuda", dtype=dtype)
            x = buf[off:off + rows * n].view(rows, n)
            go = (off + 1) % v
            g = gbuf[go:go + rows * n].view(rows, n)
            _check_rows(x, g, kind, dtype, f"{kind} offset {off} ({rows},{n}) {dtype}")


def _strided_cases(n, dtype, seed):
    """(label, x, g) with rows at strides: column slices of wider buffers, t[:, :-1, :] and
    t[:, 1:, :] of (B, S, N), a row-sliced view, and an element-offset slice."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)
    t, tg = rnd(2, 4, n) * 3, rnd(2, 4, n)
    big, bigg = rnd(5, n + 7) * 3, rnd(5, n + 1)
    return [("x[:, :N] of (5, N+7)", big[:, :n], bigg[:, :n]),
            ("t[:, :-1, :]", t[:, :-1, :], tg[:, :-1, :]),
            ("t[:, 1:, :]", t[:, 1:, :], tg[:, 1:, :]),
            ("t[:, 1:3, :]", t[:, 1:3, :], tg[:, 1:3, :]),
            ("rows 1::2 of (5, N+7), from element 3", big[1::2, 3:n + 3], bigg[1::2, 1:n + 1])]


@cuda_every_dtype_and_kind
def test_cuda_strided_rows(dtype, kind):
    v = _vec(dtype)
    if RACECHECK and dtype not in (torch.float32, torch.bfloat16):
        pytest.skip("racecheck: the shared-memory kernels' launches cost seconds; fp32 and bf16 cover them")
    lengths = [37, 1000, 2048 * v + 5, 50257] if not RACECHECK else [2048 * v + 5]
    for n in lengths:
        cases = _strided_cases(n, dtype, seed=n)
        for label, x, g in cases[:2] if RACECHECK else cases:
            assert not x.is_contiguous() and x.stride(-1) == 1
            what = f"{kind} strided {label} N={n} {dtype}"
            _check_rows(x, g, kind, dtype, what)
            if not RACECHECK:  # y saved by the forward may be a strided view too
                _check_rows(x, g, kind, dtype, what + " y strided", y_view=lambda y: _strided_copy(y, 3))


@requires_cuda
@pytest.mark.parametrize("kind", ["softmax", "log_softmax"])
def test_cuda_strided_rows_no_copy(kind):
    # Forward and backward ops called directly: no copy kernel for rows at strides.
    for dtype in (torch.float32, torch.bfloat16):
        v = _vec(dtype)
        for n in (1000, 2048 * v + 5, 50257):
            for label, x, g in _strided_cases(n, dtype, seed=n):
                y, copies = copy_kernels(_FWD_OPS[kind], x, -1, "auto")
                assert copies == [], f"{kind} {label} N={n}: forward copied ({copies})"
                assert_close_ref(y, _ref64(x, -1, kind), dtype, f"{kind} {label} N={n}")
                _, copies = copy_kernels(_BWD_OPS[kind], g, _strided_copy(y, 5), -1, "auto")
                assert copies == [], f"{kind} {label} N={n}: backward copied ({copies})"


@pytest.mark.parametrize("device", DEVICES)
def test_strided_layouts_that_need_a_copy(device):
    # Three outer levels that do not collapse, a non-unit last-dim stride, a reduced dim that is
    # not last: still right (through a copy).
    t = torch.randn(3, 4, 5, 300, device=device)
    for x, dim in ((t[:, :-1, :-1, :], -1), (t.transpose(-1, -2), -1), (t[..., ::2], -1), (t[:, :, :, :7], 2)):
        for kind in ("softmax", "log_softmax"):
            assert_close_ref(FUNCS[kind][0](x, dim), _ref64(x, dim, kind), torch.float32, f"{kind} {x.stride()}")
    # Expanded rows (stride 0) are read, never written.
    e = torch.randn(1, 70, device=device).expand(4, 70)
    assert_close_ref(gp.softmax(e), _ref64(e, -1, "softmax"), torch.float32, "expanded")


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_strided(device):
    # The fake kernels give the real kernels' (contiguous) output strides for strided inputs.
    t = torch.randn(2, 5, 33, device=device)
    x = t[:, :-1, :]
    for kind in ("softmax", "log_softmax"):
        torch.library.opcheck(_FWD_OPS[kind], (x, -1, "auto"))
        y = FUNCS[kind][1](x.contiguous(), -1)
        torch.library.opcheck(_BWD_OPS[kind], (torch.randn_like(t)[:, 1:, :], y, -1, "auto"))


@requires_cuda
@pytest.mark.parametrize("rows", ["smem", "bulk", "cluster"])
@pytest.mark.parametrize("kind", ["softmax", "log_softmax"])
def test_cuda_large_vocab(rows, kind):
    # One large vocabulary per kind through the long-row kernels: the shifted logits
    # t[:, :-1, :] of GPT-2's 50257 (odd: rows misaligned, strided), Llama-3's 128256.
    torch.manual_seed(43)
    if RACECHECK and rows != "smem":
        pytest.skip("racecheck: the shared-memory kernels' launches cost seconds; rows=smem covers them")
    with gp.tuning.override(softmax_rows=rows):
        t = torch.randn(2, many(9, 3), 50257, device="cuda", dtype=torch.bfloat16) * 3
        tg = torch.randn_like(t)
        _check_rows(t[:, :-1, :], tg[:, :-1, :], kind, torch.bfloat16, f"{rows} {kind} t[:, :-1, :] 50257 bf16")
        for dtype in (torch.bfloat16, torch.float32) if not RACECHECK else ():
            x = torch.randn(many(6, 2), 128256, device="cuda", dtype=dtype) * 3
            _check_rows(x, torch.randn_like(x), kind, dtype, f"{rows} {kind} ({x.shape[0]},128256) {dtype}")


# ---- the shared-memory row kernels' three variants ------------------------------------------------
# Long rows (N > 2048 V) go to one of: smem_own_rows_kernel<..., ALIGNED=true> (every row 16-byte
# aligned, N % V == 0), smem_own_rows_kernel<..., false> (every input row at the output row's offset
# within 16 bytes: odd N, contiguous or at strides that keep it; no shift, edge vectors element by
# element), smem_rows_kernel (an input misaligned against the output: shifted). Each case checks the
# forward and the backward against float64 references with poisoned outputs and, outside the
# sanitizer, which variant each ran. 300 rows: more than the resident clusters, so a cluster takes
# several rows and each thread's shared vectors are refilled row after row.

def _smem_variant(fn, *args):
    """fn(*args) once under the CUDA profiler; the shared-memory row kernel variant it launched."""
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(*args)
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    names = {e["name"] for e in events if e.get("cat") == "kernel" and "smem_" in e["name"]}
    assert len(names) == 1, f"expected one shared-memory row kernel, got {sorted(names)}"
    name = names.pop()
    if "smem_own_rows_kernel<" in name:
        last = name.split("smem_own_rows_kernel<", 1)[1].split(">", 1)[0].split(",")[-1].strip()
        assert last in ("true", "false"), name
        return "aligned" if last == "true" else "same"
    assert "smem_rows_kernel<" in name, name
    return "shifted"


def _smem_variant_cases(dtype):
    """(label, x, g, forward variant, backward variant): y, the backward's input, is the forward's
    contiguous output, so the backward's variant follows g's layout (and N). x is scaled by 3
    before any view is taken (a scaled view would be a contiguous copy)."""
    v = _vec(dtype)
    al, odd = 2048 * v + 5 * v, 2048 * v + 3

    def rnd(*shape, s=1.0):
        return torch.randn(*shape, device="cuda", dtype=dtype) * s

    def off(rows, n, o, s=1.0):  # rows of n from element o of a buffer
        return rnd(rows * n + v, s=s)[o:o + rows * n].view(rows, n)
    t, tg = rnd(2, 3 + v, odd, s=3), rnd(2, 3 + v, odd)
    u, ug = rnd(2, 4, odd, s=3), rnd(2, 4, odd)
    n300 = 50304 - 50304 % v
    return [
        ("aligned", rnd(3, al, s=3), rnd(3, al), "aligned", "aligned"),
        ("aligned, row stride N + V", rnd(3, al + v, s=3)[:, :al], rnd(3, al + 2 * v)[:, :al], "aligned", "aligned"),
        ("aligned, 300 rows", rnd(300, n300, s=3), rnd(300, n300), "aligned", "aligned"),
        ("odd N", rnd(3, odd, s=3), rnd(3, odd), "same", "same"),
        ("odd N, 300 rows", rnd(300, 50257, s=3), rnd(300, 50257), "same", "same"),
        ("odd N, row stride N + V", rnd(3, odd + v, s=3)[:, :odd], rnd(3, odd + 2 * v)[:, :odd], "same", "same"),
        ("odd N, t[:, :3, :] of (2, 3 + V, N)", t[:, :3, :], tg[:, :3, :], "same", "same"),
        ("odd N, x and dy from element V", off(3, odd, v, s=3), off(3, odd, v), "same", "same"),
        ("aligned N, x and dy from element 1", off(3, al, 1, s=3), off(3, al, 1), "shifted", "shifted"),
        ("odd N, t[:, :-1, :] (batch 1 shifted)", u[:, :-1, :], ug[:, :-1, :], "shifted", "shifted"),
        ("odd N, dy from element 1", rnd(3, odd, s=3), off(3, odd, 1), "same", "shifted"),
        ("aligned N, dy from element V - 1", rnd(3, al, s=3), off(3, al, v - 1), "aligned", "shifted"),
    ]


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["softmax", "log_softmax"])
@pytest.mark.parametrize("rows", ["smem", "bulk"])
def test_cuda_smem_row_variants(rows, kind, dtype):
    if RACECHECK and (rows == "bulk" or (dtype, kind) not in ((torch.float32, "softmax"),
                                                                (torch.bfloat16, "log_softmax"))):
        pytest.skip("racecheck: the shared-memory kernels' launches cost seconds; smem fp32 softmax and bf16 "
                    "log_softmax cover them")
    torch.manual_seed(44)
    with gp.tuning.override(softmax_rows=rows):
        for label, x, g, fwd, bwd in _smem_variant_cases(dtype):
            if RACECHECK and label not in _RACECHECK_SMEM_CASES:
                continue
            what = f"{rows} {kind} {label} {tuple(x.shape)} {dtype}"
            _check_rows(x, g, kind, dtype, what)
            if SANITIZE:  # no profiler under compute-sanitizer
                continue
            y = _FWD_OPS[kind](x, -1, "auto")
            assert _smem_variant(_FWD_OPS[kind], x, -1, "auto") == fwd, what
            assert _smem_variant(_BWD_OPS[kind], g, y, -1, "auto") == bwd, what + " backward"


# Under racecheck: one case per variant, the 300-row ones refill each thread's vectors row after row.
_RACECHECK_SMEM_CASES = ("aligned, 300 rows", "odd N, 300 rows", "odd N, row stride N + V",
                         "aligned N, x and dy from element 1")


@requires_cuda
@pytest.mark.skipif(RACECHECK, reason="racecheck: test_cuda_smem_row_variants runs each variant")
@pytest.mark.parametrize("kind", ["softmax", "log_softmax"])
def test_cuda_smem_align_knob(kind):
    # softmax_smem_align caps the variant: the more general kernels on layouts the specialised
    # ones would take give the same values, never a more specialised kernel than the layout allows.
    torch.manual_seed(45)
    for dtype in (torch.float32, torch.bfloat16):
        v = _vec(dtype)
        for n, natural in ((2048 * v + 5 * v, "aligned"), (2048 * v + 3, "same")):
            x, g = torch.randn(3, n, device="cuda", dtype=dtype) * 3, torch.randn(3, n, device="cuda", dtype=dtype)
            for cap in ("aligned", "same", "shifted"):
                with gp.tuning.override(softmax_smem_align=cap):
                    what = f"{kind} smem_align={cap} ({3},{n}) {dtype}"
                    _check_rows(x, g, kind, dtype, what)
                    if SANITIZE:
                        continue
                    order = ["aligned", "same", "shifted"]
                    want = order[max(order.index(natural), order.index(cap))]
                    y = _FWD_OPS[kind](x, -1, "auto")
                    assert _smem_variant(_FWD_OPS[kind], x, -1, "auto") == want, what
                    assert _smem_variant(_BWD_OPS[kind], g, y, -1, "auto") == want, what + " backward"
