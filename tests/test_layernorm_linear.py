"""layer_norm, fused_layernorm_linear (algorithms auto / unfused / naive): seed config,
float64 references, large-mean inputs, gradients, opcheck, compile, bad input, and the
CUDA kernel paths (chosen with gpu_puzzles.tuning.override where a test needs both)."""
import functools

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    CPU_SIMD,
    DEVICES,
    TOL,
    assert_backward_fills_as_op,
    assert_close_ref,
    assert_compiled_matches_eager,
    device_dtypes,
    many,
    poison_allocator,
    requires_caching_allocator,
    requires_cuda,
)
from hypothesis import given
from hypothesis import strategies as st
from strategies import close_to_eager, extents, layouts, make_tensor, norm_input

import gpu_puzzles as gp
from gpu_puzzles.ops._common import schema_default

unfused = functools.partial(gp.fused_layernorm_linear, algorithm="unfused")
PLANS = ("fold", "normalize")  # the fused forward's plans (knob layernorm_linear_plan); "auto" picks one


def _planned(plan):
    """The fused op with its forward plan forced (the backward is the same for both)."""
    def f(*args, **kwargs):
        with gp.tuning.override(layernorm_linear_plan=plan):
            return gp.fused_layernorm_linear(*args, **kwargs)
    return f


IMPLS = {"fused": gp.fused_layernorm_linear, **{p: _planned(p) for p in PLANS}, "unfused": unfused}
# The ops' default eps, as the schema writes it.
EPS = schema_default(torch.ops.gpu_puzzles.layer_norm.default, "eps")

@pytest.fixture
def fold_plan():
    """Forces the fold plan: the tests of its kernels (prep, epilogue, CUTLASS GEMM, large-mean
    fix-up), whose shapes the auto plan may hand to normalize."""
    with gp.tuning.override(layernorm_linear_plan="fold"):
        yield


def _params(H, N, device, dtype, bias=True, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    lw = (1 + 0.5 * torch.randn(H, generator=g, dtype=torch.float64)).to(device, dtype)
    lb = (0.5 * torch.randn(H, generator=g, dtype=torch.float64)).to(device, dtype)
    W = (torch.randn(N, H, generator=g, dtype=torch.float64) / H ** 0.5).to(device, dtype)
    b = (0.5 * torch.randn(N, generator=g, dtype=torch.float64)).to(device, dtype) if bias else None
    ps = [lw, lb, W, b]
    return [p.requires_grad_(grad) if p is not None else None for p in ps]


def _assert_stats(x, mean, rstd, eps=EPS):
    """The op's returned row statistics against float64 (biased variance)."""
    torch.testing.assert_close(mean.double(), x.double().mean(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rstd.double(), (x.double().var(-1, unbiased=False) + eps).rsqrt(), rtol=1e-4, atol=1e-5)


def _assert_near_eager(y, y_ref, err_eager, dtype, what="output"):
    """y vs the float64 reference: within twice eager's own max error, plus 4 TOL at the
    reference's scale (at least 1)."""
    scale = max(1.0, y_ref.abs().max().item()) if y_ref.numel() else 1.0
    err = (y.double() - y_ref).abs().max().item() if y.numel() else 0.0
    assert err <= 2 * err_eager + 4 * TOL[dtype] * scale, f"{what}: error {err:.3e} vs eager {err_eager:.3e}"


def _ref(x, lw, lb, W, b, eps=EPS):
    """float64 F.linear(F.layer_norm(x)) and its inputs as float64 leaves."""
    leaves = [t.detach().double().requires_grad_() if t is not None else None for t in (x, lw, lb, W, b)]
    x64, lw64, lb64, W64, b64 = leaves
    y = F.linear(F.layer_norm(x64, (x64.shape[-1],), lw64, lb64, eps), W64, b64)
    return y, leaves


# ---- the seed's configuration (batch 4, seq 4, hidden 8, output 16) ------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", list(IMPLS))
def test_seed_config_forward_and_all_five_grads(device, impl):
    torch.manual_seed(0)
    x = torch.randn(4, 4, 8, device=device, dtype=torch.float64, requires_grad=True)
    lw, lb, W, b = _params(8, 16, device, torch.float64, grad=True)
    y = IMPLS[impl](x, lw, lb, W, b)
    assert y.shape == (4, 4, 16) and y.dtype == torch.float64
    y_ref, leaves = _ref(x, lw, lb, W, b)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, lw, lb, W, b), g)
    refs = torch.autograd.grad(y_ref, leaves, g)
    for name, a, r in zip(("x", "ln_weight", "ln_bias", "linear_weight", "linear_bias"), grads, refs):
        assert a.shape == r.shape, name
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10, msg=lambda m: f"d{name}: {m}")


# ---- forward against float64 -----------------------------------------------------

SHAPES = [((4, 4), 8, 16), ((3, 7), 33, 5), ((5,), 1, 3), ((2, 50), 100, 64), ((64,), 256, 128), ((9,), 24, 40)]
CUDA_SHAPES = [((37,), 4096, 96), ((3, 5), 1000, 33), ((6,), 4099, 17), ((4,), 4100, 8), ((2,), 40000, 4)]


def _shapes(device):
    return SHAPES + (CUDA_SHAPES if device == "cuda" else [])


def _cases():
    return [(d, t, s) for d, t in device_dtypes() for s in _shapes(d)]


@pytest.mark.parametrize("device,dtype,shape", _cases())
def test_layer_norm_forward(device, dtype, shape):
    lead, H, _ = shape
    torch.manual_seed(H)
    x = (torch.randn(*lead, H, dtype=torch.float64) * 2 + 0.3).to(device, dtype)
    lw, lb, _, _ = _params(H, 1, device, dtype)
    y = gp.layer_norm(x, lw, lb)
    y_ref = F.layer_norm(x.double(), (H,), lw.double(), lb.double(), EPS)
    assert y.shape == x.shape and y.dtype == dtype
    assert_close_ref(y, y_ref, dtype, "layer_norm")
    y2, mean, rstd = torch.ops.gpu_puzzles.layer_norm(x, lw, lb, EPS)
    assert mean.shape == x.shape[:-1] and mean.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    _assert_stats(x, mean, rstd)


@pytest.mark.parametrize("device,dtype,shape", _cases())
@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("bias", [True, False])
def test_forward_matches_reference(device, dtype, shape, impl, bias):
    lead, H, N = shape
    torch.manual_seed(H * 31 + N)
    x = (torch.randn(*lead, H, dtype=torch.float64) + 0.2).to(device, dtype)
    lw, lb, W, b = _params(H, N, device, dtype, bias=bias)
    y = IMPLS[impl](x, lw, lb, W, b)
    assert y.shape == (*lead, N) and y.dtype == dtype
    assert_close_ref(y, _ref(x, lw, lb, W, b)[0], dtype, f"{impl} forward")


@pytest.mark.parametrize("device,dtype,shape", _cases())
def test_fused_forward_statistics(device, dtype, shape):
    lead, H, N = shape
    torch.manual_seed(H * 17 + N)
    x = (torch.randn(*lead, H, dtype=torch.float64) * 1.5 - 0.7).to(device, dtype)
    lw, lb, W, b = _params(H, N, device, dtype, bias=N % 2 == 0)
    y, mean, rstd = torch.ops.gpu_puzzles.fused_layernorm_linear(x, lw, lb, W, b, EPS)
    assert y.shape == (*lead, N) and y.dtype == dtype
    assert_close_ref(y, _ref(x, lw, lb, W, b)[0], dtype, "fused forward")
    # the statistics the op returns are the backward's inputs
    _assert_stats(x, mean, rstd)


# ---- backward against float64 -----------------------------------------------------


def _check_five_grads(y, inputs, dtype, what):
    """All five gradients of y (under a random grad_out) vs the float64 reference; returns them."""
    x, lw, lb, W, b = inputs
    H, N = x.shape[-1], y.shape[-1]
    g = torch.randn_like(y)
    grads = torch.autograd.grad(y, inputs, g)
    y_ref, leaves = _ref(x, lw, lb, W, b)
    refs = torch.autograd.grad(y_ref, leaves, g.double())
    M = x.numel() // H
    # dx carries rstd = 1/sqrt(var + eps): at H = 1 (var 0) that is 316, and rounding
    # errors are amplified by it as well.
    rstd_max = (x.detach().double().var(-1, unbiased=False) + EPS).rsqrt().max().item()
    for name, a, r in zip(("dx", "dln_weight", "dln_bias", "dlinear_weight", "dlinear_bias"), grads, refs):
        assert a.shape == r.shape and a.dtype == dtype, name
        # Parameter gradients sum over M rows (and dx over N outputs): scale by sqrt of that.
        k = (N ** 0.5 * max(1.0, rstd_max)) if name == "dx" else M ** 0.5
        assert_close_ref(a / k, r / k, dtype, f"{what} {name}")
    return grads

@pytest.mark.parametrize("device,dtype,shape", _cases())
@pytest.mark.parametrize("impl", list(IMPLS))
def test_backward_matches_reference(device, dtype, shape, impl):
    lead, H, N = shape
    torch.manual_seed(H * 7 + N)
    x = (torch.randn(*lead, H, dtype=torch.float64) - 0.4).to(device, dtype).requires_grad_()
    lw, lb, W, b = _params(H, N, device, dtype, grad=True)
    _check_five_grads(IMPLS[impl](x, lw, lb, W, b), (x, lw, lb, W, b), dtype, impl)


def _layer_norm_ref_grads(x, lw, lb, g):
    """dx, dweight, dbias of F.layer_norm in float64 at the same inputs."""
    leaves = [t.detach().double().requires_grad_() for t in (x, lw, lb)]
    return torch.autograd.grad(F.layer_norm(leaves[0], (x.shape[-1],), leaves[1], leaves[2]), leaves, g.double())


@pytest.mark.parametrize("device", DEVICES)
def test_layer_norm_backward_matches_reference(device):
    torch.manual_seed(1)
    for dtype in ([torch.float32, torch.float64] + ([torch.bfloat16] if device == "cuda" else [])):
        for H in (1, 7, 64, 300) + ((4099, 4100, 40000) if device == "cuda" else ()):
            x = torch.randn(6, H, device=device, dtype=dtype, requires_grad=True)
            lw, lb, _, _ = _params(H, 1, device, dtype, grad=True)
            g = torch.randn_like(x)
            grads = torch.autograd.grad(gp.layer_norm(x, lw, lb), (x, lw, lb), g)
            refs = _layer_norm_ref_grads(x, lw, lb, g)
            for name, a, r in zip(("dx", "dweight", "dbias"), grads, refs):
                assert_close_ref(a, r, dtype, f"layer_norm {name} H={H} {dtype}")


# ---- large-mean inputs: the guard of the folded rewrite ------------------------------

def _large_mean_x(lead, H, means, device, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    m = torch.tensor(means, dtype=torch.float64)[torch.randint(len(means), lead, generator=g)]
    return (m[..., None] + torch.randn(*lead, H, generator=g, dtype=torch.float64)).to(device, dtype)


@pytest.mark.usefixtures("fold_plan")
@pytest.mark.parametrize("device,dtype", device_dtypes())
@pytest.mark.parametrize("means", [[8.0], [1000.0], [0.0, 3000.0, -12.0, 20.0]])
def test_large_mean_inputs(device, dtype, means):
    # Rows with |mean|/std below the guard go through the folded rewrite, rows above it
    # are recomputed normalise-first; both must stay as accurate as PyTorch's own
    # LayerNorm+Linear in the same dtype (whose mean itself carries eps * |mean|).
    lead, H, N = (3, 21), 256, 48
    x = _large_mean_x(lead, H, means, device, dtype, seed=len(means))
    lw, lb, W, b = _params(H, N, device, dtype)
    y_ref = _ref(x, lw, lb, W, b)[0]
    eager = F.linear(F.layer_norm(x, (H,), lw, lb), W, b)
    err_eager = (eager.double() - y_ref).abs().max().item()
    for impl, f in IMPLS.items():
        _assert_near_eager(f(x, lw, lb, W, b), y_ref, err_eager, dtype, impl)
    # and the gradients stay finite and close
    xg = x.clone().requires_grad_()
    grads = torch.autograd.grad(gp.fused_layernorm_linear(xg, lw, lb, W, b).sum(), (xg,))
    assert torch.isfinite(grads[0]).all()


# ---- gradcheck, opcheck, compile -------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck(device):
    torch.manual_seed(0)
    x = torch.randn(3, 2, 6, device=device, dtype=torch.float64, requires_grad=True)
    lw, lb, W, b = _params(6, 5, device, torch.float64, grad=True)
    assert torch.autograd.gradcheck(gp.fused_layernorm_linear, (x, lw, lb, W, b))
    assert torch.autograd.gradcheck(lambda *a: gp.fused_layernorm_linear(*a, None), (x, lw, lb, W))
    assert torch.autograd.gradcheck(unfused, (x, lw, lb, W, b))
    assert torch.autograd.gradcheck(gp.layer_norm, (x, lw, lb))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck(device, requires_grad):
    x = torch.randn(2, 3, 8, device=device, requires_grad=requires_grad)
    lw, lb, W, b = _params(8, 5, device, torch.float32, grad=requires_grad)
    ops = torch.ops.gpu_puzzles
    torch.library.opcheck(ops.layer_norm.default, (x, lw, lb, EPS))
    torch.library.opcheck(ops.fused_layernorm_linear.default, (x, lw, lb, W, b, EPS))
    torch.library.opcheck(ops.fused_layernorm_linear.default, (x, lw, lb, W, None, EPS))
    xd, lwd, lbd, Wd = (t.detach() for t in (x, lw, lb, W))
    _, mean, rstd = ops.layer_norm(xd, lwd, lbd, EPS)
    torch.library.opcheck(ops.layer_norm_backward.default, (torch.randn_like(xd), xd, lwd, mean, rstd))
    torch.library.opcheck(ops.fused_layernorm_linear_backward.default,
                          (torch.randn(2, 3, 5, device=device), xd, lwd, lbd, Wd, mean, rstd))


@pytest.mark.parametrize("device", DEVICES)
def test_backward_adds_no_fill_for_statistics(device):
    # mean and rstd carry no gradient: autograd must not fill zeros for them per call.
    x = torch.randn(4, 6, 8, device=device, requires_grad=True)
    lw, lb, W, b = _params(8, 5, device, torch.float32, grad=True)
    ops = torch.ops.gpu_puzzles
    y, mean, rstd = ops.layer_norm(x, lw, lb, EPS)
    g = torch.randn_like(y)
    assert_backward_fills_as_op(y, g, lambda: ops.layer_norm_backward(g, x, lw, mean, rstd))
    y, mean, rstd = ops.fused_layernorm_linear(x, lw, lb, W, b, EPS)
    g = torch.randn_like(y)
    assert_backward_fills_as_op(y, g, lambda: ops.fused_layernorm_linear_backward(g, x, lw, lb, W, mean, rstd))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_forward_backward(device):
    torch.manual_seed(0)
    fused = gp.nn.LayerNormLinear(16, 12, device=device)
    with torch.no_grad():
        fused.ln_weight.normal_(1, 0.3)
        fused.ln_bias.normal_(0, 0.3)

    def f(x):  # both ops in one graph: the fused op and our layer_norm (the unfused path)
        return fused(x) + unfused(x, fused.ln_weight, fused.ln_bias, fused.weight, fused.bias)

    params = (fused.ln_weight, fused.ln_bias, fused.weight, fused.bias)
    xs = [torch.randn(M, 16, device=device, requires_grad=True) for M in (5, 9)]
    assert_compiled_matches_eager(f, [((x,), (x, *params)) for x in xs])


# ---- module ---------------------------------------------------------------------------

@pytest.mark.parametrize("algorithm", ["auto", "unfused"])
def test_module_from_modules_matches_pair(algorithm):
    torch.manual_seed(0)
    ln, lin = torch.nn.LayerNorm(10, eps=1e-6), torch.nn.Linear(10, 7)
    with torch.no_grad():
        ln.weight.normal_(1, 0.2)
        ln.bias.normal_(0, 0.2)
    m = gp.nn.LayerNormLinear.from_modules(ln, lin, algorithm=algorithm)
    assert m.eps == 1e-6 and m.algorithm == algorithm
    x = torch.randn(3, 4, 10)
    torch.testing.assert_close(m(x), lin(ln(x)), rtol=1e-5, atol=1e-5)
    m.weight.sum().backward()  # parameters are leaves of their own
    assert ln.weight.grad is None
    m2 = gp.nn.LayerNormLinear(10, 7, bias=False)
    assert m2.bias is None and (m2.ln_weight == 1).all() and (m2.ln_bias == 0).all()
    assert m2(x).shape == (3, 4, 7)
    with pytest.raises(ValueError, match="normalized_shape"):
        gp.nn.LayerNormLinear.from_modules(torch.nn.LayerNorm(9), lin)
    with pytest.raises(ValueError, match="in_features"):
        gp.nn.LayerNormLinear(0, 3)
    with pytest.raises(ValueError, match="algorithm"):
        gp.nn.LayerNormLinear(10, 7, algorithm="fused")
    assert gp.nn.LayerNormLinear(10, 7).eps == EPS  # the schema's default


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("M,N", [(0, 4), (5, 0)], ids=["empty_rows", "empty_outputs"])
def test_empty_rows_or_outputs(device, M, N):
    # M == 0 or N == 0: y is (M, N); the backward still runs (with N == 0, on CUDA, its
    # LayerNorm backward and no db column sums), and every gradient is zero, of its input's shape.
    x = torch.randn(M, 8, device=device, requires_grad=True)
    lw, lb, W, b = _params(8, N, device, torch.float32, grad=True)
    y = gp.fused_layernorm_linear(x, lw, lb, W, b)
    assert y.shape == (M, N)
    grads = torch.autograd.grad(y.sum(), (x, lw, lb, W, b), allow_unused=True)
    for gr, t in zip(grads, (x, lw, lb, W, b)):
        assert gr is not None and gr.shape == t.shape and (gr == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_input(device):
    x = torch.randn(12, 5, device=device).t()  # (5, 12), strided
    lw, lb, W, b = _params(12, 6, device, torch.float32)
    assert not x.is_contiguous()
    assert_close_ref(gp.fused_layernorm_linear(x, lw, lb, W, b), _ref(x, lw, lb, W, b)[0], torch.float32, "strided")


# ---- the forward plans and W's layouts ----------------------------------------------------
# W comes as (N, H) rows or as a transposed view of (H, N) memory (GPT-2's Conv1D hands
# weight.t()); either is taken without a copy (the fold plan reads rows: a forced fold copies
# a transposed W, the auto plan takes normalize), and dW comes back in W's layout.

def _w_view(W, layout):
    """W's values in the given memory layout: "rows" (N, H) row-major, "t" a view of (H, N) memory."""
    if layout == "rows":
        return W
    Wt = W.detach().t().contiguous().t().requires_grad_(W.requires_grad)
    assert Wt.stride() == (1, W.shape[0]) or W.shape[0] == 1 or W.shape[1] == 1
    return Wt


LAYOUTS = ("rows", "t")
PLAN_SHAPES = [((4, 5), 24, 40), ((37,), 64, 8), ((3,), 1, 7), ((2, 3), 100, 33)]


@pytest.mark.parametrize("device,dtype", device_dtypes())
@pytest.mark.parametrize("plan", ("auto",) + PLANS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bias", [True, False])
def test_plans_and_layouts_forward(device, dtype, plan, layout, bias):
    # Every plan, W in either layout: y and the saved statistics vs float64.
    for lead, H, N in PLAN_SHAPES:
        torch.manual_seed(H + N)
        x = (torch.randn(*lead, H, dtype=torch.float64) * 1.3 + 0.4).to(device, dtype)
        lw, lb, W, b = _params(H, N, device, dtype, bias=bias, seed=N)
        W = _w_view(W, layout)
        with gp.tuning.override(layernorm_linear_plan=None if plan == "auto" else plan):
            y, mean, rstd = torch.ops.gpu_puzzles.fused_layernorm_linear(x, lw, lb, W, b, EPS)
        assert y.shape == (*lead, N) and y.dtype == dtype and y.is_contiguous()
        assert_close_ref(y, _ref(x, lw, lb, W, b)[0], dtype, f"{plan} {layout} {lead} {H} {N}")
        _assert_stats(x, mean, rstd)


@pytest.mark.parametrize("device,dtype", device_dtypes())
def test_plans_agree(device, dtype):
    # fold and normalize: the same output within the dtype's rounding, the same statistics.
    torch.manual_seed(2)
    M, H, N = 70, 96, 48
    x = (torch.randn(M, H, dtype=torch.float64) * 2 - 0.5).to(device, dtype)
    lw, lb, W, b = _params(H, N, device, dtype, seed=3)
    outs = {p: _planned(p)(x, lw, lb, W, b) for p in PLANS}
    stats = {}
    for p in PLANS:
        with gp.tuning.override(layernorm_linear_plan=p):
            stats[p] = torch.ops.gpu_puzzles.fused_layernorm_linear(x, lw, lb, W, b, EPS)[1:]
    y_ref = _ref(x, lw, lb, W, b)[0]
    scale = max(1.0, y_ref.abs().max().item())
    diff = (outs["fold"].double() - outs["normalize"].double()).abs().max().item()
    assert diff <= 8 * TOL[dtype] * scale, f"plans differ by {diff:.3e}"
    for a, c in zip(stats["fold"], stats["normalize"]):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device,dtype", device_dtypes())
@pytest.mark.parametrize("plan", ("auto",) + PLANS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_plans_and_layouts_backward(device, dtype, plan, layout):
    # All five gradients vs float64, dW in W's own layout (strides equal), for each plan and layout.
    lead, H, N = (3, 11), 40, 24
    torch.manual_seed(5)
    x = (torch.randn(*lead, H, dtype=torch.float64) - 0.3).to(device, dtype).requires_grad_()
    lw, lb, W, b = _params(H, N, device, dtype, grad=True, seed=7)
    W = _w_view(W, layout)
    with gp.tuning.override(layernorm_linear_plan=None if plan == "auto" else plan):
        y = gp.fused_layernorm_linear(x, lw, lb, W, b)
    grads = _check_five_grads(y, (x, lw, lb, W, b), dtype, f"{plan} {layout}")
    assert grads[3].stride() == W.stride(), f"dW strides {grads[3].stride()}, W's {W.stride()}"


@pytest.mark.parametrize("device", DEVICES)
def test_transposed_parameter_gradient_layout(device):
    # Conv1D's case: the parameter P is (H, N) and the op sees P.t(). P's gradient comes out
    # contiguous (as P), so that AccumulateGrad stores it without a copy; .backward() agrees.
    torch.manual_seed(9)
    H, N = 32, 20
    P = torch.randn(H, N, device=device, requires_grad=True)
    x = torch.randn(6, H, device=device)
    lw, lb, _, b = _params(H, N, device, torch.float32)
    y = gp.fused_layernorm_linear(x, lw, lb, P.t(), b)
    (dP,) = torch.autograd.grad(y, (P,), torch.ones_like(y), retain_graph=True)
    assert dP.is_contiguous() and dP.stride() == P.stride()
    y.sum().backward()
    torch.testing.assert_close(P.grad, dP)
    P64 = P.detach().double().requires_grad_()
    ref = F.linear(F.layer_norm(x.double(), (H,), lw.double(), lb.double(), EPS), P64.t(), b.double())
    assert_close_ref(dP, torch.autograd.grad(ref.sum(), (P64,))[0], torch.float32, "dP")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("plan", PLANS)
def test_gradcheck_transposed_w(device, plan):
    torch.manual_seed(1)
    x = torch.randn(5, 6, device=device, dtype=torch.float64, requires_grad=True)
    lw, lb, W, b = _params(6, 4, device, torch.float64, grad=True)
    Wt = _w_view(W, "t")
    f = _planned(plan)
    assert torch.autograd.gradcheck(f, (x, lw, lb, Wt, b))
    assert torch.autograd.gradcheck(lambda *a: f(*a, None), (x, lw, lb, Wt))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("plan", PLANS)
def test_opcheck_transposed_w(device, requires_grad, plan):
    # The fake kernels give dW W's strides, as the real backward does (opcheck compares them).
    x = torch.randn(2, 3, 8, device=device, requires_grad=requires_grad)
    lw, lb, W, b = _params(8, 5, device, torch.float32, grad=requires_grad)
    Wt = _w_view(W, "t")
    ops = torch.ops.gpu_puzzles
    with gp.tuning.override(layernorm_linear_plan=plan):
        torch.library.opcheck(ops.fused_layernorm_linear.default, (x, lw, lb, Wt, b, EPS))
        torch.library.opcheck(ops.fused_layernorm_linear.default, (x, lw, lb, Wt, None, EPS))
    xd, lwd, lbd, Wtd = (t.detach() for t in (x, lw, lb, Wt))
    _, mean, rstd = ops.layer_norm(xd, lwd, lbd, EPS)
    torch.library.opcheck(ops.fused_layernorm_linear_backward.default,
                          (torch.randn(2, 3, 5, device=device), xd, lwd, lbd, Wtd, mean, rstd))
    dW = ops.fused_layernorm_linear_backward(torch.randn(2, 3, 5, device=device), xd, lwd, lbd, Wtd, mean, rstd)[3]
    assert dW.stride() == Wtd.stride()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("plan", ("auto",) + PLANS)
def test_strided_rows(device, plan):
    # x as a slice of wider rows (x[:, :H]) and W as rows of a wider matrix (W[:, :H]): correct
    # under every plan (x is copied to rows of its own; W is read through its strides).
    torch.manual_seed(4)
    H, N = 48, 24
    xb = torch.randn(30, H + 16, device=device) + 0.2
    Wb = torch.randn(N, H + 8, device=device) / H ** 0.5
    x, W = xb[:, :H], Wb[:, :H]
    lw, lb, _, b = _params(H, N, device, torch.float32)
    with gp.tuning.override(layernorm_linear_plan=None if plan == "auto" else plan):
        y = gp.fused_layernorm_linear(x, lw, lb, W, b)
    assert_close_ref(y, _ref(x, lw, lb, W, b)[0], torch.float32, f"strided rows {plan}")


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M,H,N", [(64, 768, 2304), (1000, 1024, 264), (3, 4096, 40)])
def test_cuda_transposed_w_no_copy(dtype, M, H, N):
    # Conv1D's weight.t(): the forward (auto) and the backward op launch no copy kernel, and
    # every output element is written (poisoned memory) and correct.
    from conftest import copy_kernels
    torch.manual_seed(M + N)
    x = torch.randn(M, H, device="cuda", dtype=dtype) + 0.3
    lw, lb, W, b = _params(H, N, "cuda", dtype, seed=H)
    Wt = _w_view(W, "t")
    ops = torch.ops.gpu_puzzles
    _poison_allocator()
    (y, mean, rstd), copies = copy_kernels(ops.fused_layernorm_linear, x, lw, lb, Wt, b, EPS)
    assert copies == [], f"forward copies: {copies}"
    assert not torch.isnan(y).any()
    assert_close_ref(y, _ref(x, lw, lb, Wt, b)[0], dtype, "forward, transposed W")
    g = torch.randn(M, N, device="cuda", dtype=dtype)
    _poison_allocator()
    grads, copies = copy_kernels(ops.fused_layernorm_linear_backward, g, x, lw, lb, Wt, mean, rstd)
    assert copies == [], f"backward copies: {copies}"
    assert grads[3].stride() == Wt.stride()
    y_ref, leaves = _ref(x, lw, lb, Wt, b)
    refs = torch.autograd.grad(y_ref, leaves[:4], g.double())
    rstd_max = rstd.double().max().item()
    for name, a, r in zip(("dx", "dln_weight", "dln_bias", "dW"), grads[:4], refs):
        assert not torch.isnan(a).any(), name
        k = (N ** 0.5 * max(1.0, rstd_max)) if name == "dx" else M ** 0.5
        assert_close_ref(a / k, r / k, dtype, f"{name} transposed W")


@requires_cuda
@pytest.mark.parametrize("plan", PLANS)
def test_cuda_plans_no_copy_contiguous_w(plan):
    # W as (N, H) rows: neither plan copies anything (forward op, backward op).
    from conftest import copy_kernels
    torch.manual_seed(0)
    M, H, N = 512, 768, 256
    x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
    lw, lb, W, b = _params(H, N, "cuda", torch.bfloat16)
    ops = torch.ops.gpu_puzzles
    with gp.tuning.override(layernorm_linear_plan=plan):
        (y, mean, rstd), copies = copy_kernels(ops.fused_layernorm_linear, x, lw, lb, W, b, EPS)
    assert copies == [], f"{plan} forward copies: {copies}"
    _, copies = copy_kernels(ops.fused_layernorm_linear_backward, torch.randn_like(y), x, lw, lb, W, mean, rstd)
    assert copies == [], f"backward copies: {copies}"


@requires_cuda
@pytest.mark.parametrize("M,N,layout,want", [
    (16384, 1024, "rows", "fold"),     # tall x, narrow projection: the fold moves fewer bytes
    (256, 4096, "rows", "normalize"),  # N*H far above M*H: writing xn is cheaper than folding W
    (4096, 1024, "rows", "normalize"),  # tall but small: the fold's extra launches cost more
    (16384, 1024, "t", "normalize"),   # the fold reads W as rows: a transposed W is normalised
])
def test_cuda_auto_plan_choice(M, N, layout, want):
    # The auto plan by its kernels: the fold runs the prep (statistics + fold) kernel, the
    # normalise plan our LayerNorm forward and no fold.
    if not _profiler_sees_kernels():
        pytest.skip("the profiler sees no kernels here (compute-sanitizer)")
    torch.manual_seed(1)
    H = 1024
    x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
    lw, lb, W, b = _params(H, N, "cuda", torch.bfloat16)
    W = _w_view(W, layout)
    names, y = _kernels(lambda: gp.fused_layernorm_linear(x, lw, lb, W, b))
    folded = any("layernorm_linear_prep" in n or "fold_weight" in n for n in names)
    assert folded == (want == "fold"), f"expected {want}, kernels: {names}"
    assert_close_ref(y, _ref(x, lw, lb, W, b)[0], torch.bfloat16, f"auto {want}")


# ---- bad input --------------------------------------------------------------------------

def _bad(d):
    f32 = dict(device=d)
    x = torch.randn(2, 3, 8, **f32)
    lw, lb, W, b = torch.ones(8, **f32), torch.zeros(8, **f32), torch.randn(5, 8, **f32), torch.zeros(5, **f32)
    return [
        ((x, torch.ones(7, **f32), lb, W, b), "ln_weight must have shape"),
        ((x, lw, torch.zeros(9, **f32), W, b), "ln_bias must have shape"),
        ((x, lw, lb, torch.randn(5, 7, **f32), b), "linear_weight must have shape"),
        ((x, lw, lb, W, torch.zeros(4, **f32)), "linear_bias must have shape"),
        ((x, lw, lb, W.double(), b), "linear_weight has dtype"),
        ((x, lw.double(), lb, W, b), "ln_weight has dtype"),
        ((x, lw, lb, W, b.double()), "linear_bias has dtype"),
        ((x.long(), lw, lb, W, b), "x must be a float"),
        ((torch.tensor(1.0, **f32), lw, lb, W, b), "at least one dimension"),
    ]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", range(9))
def test_bad_input(device, k):
    args, msg = _bad(device)[k]
    with pytest.raises((RuntimeError, ValueError), match=msg):
        gp.fused_layernorm_linear(*args)
    if "linear" not in msg:
        with pytest.raises((RuntimeError, ValueError), match=msg.replace("ln_", "")):
            gp.layer_norm(args[0], args[1], args[2])


@requires_cuda
def test_mixed_devices():
    x = torch.randn(4, 8, device="cuda")
    lw, lb, W, b = _params(8, 3, "cuda", torch.float32)
    with pytest.raises(RuntimeError, match="linear_weight is on"):
        gp.fused_layernorm_linear(x, lw, lb, W.cpu(), b)
    with pytest.raises(RuntimeError, match="ln_bias is on"):
        gp.fused_layernorm_linear(x, lw, lb.cpu(), W, b)
    with pytest.raises(RuntimeError, match="weight is on"):
        gp.layer_norm(x.cpu(), lw, lb)
    assert torch.isfinite(gp.fused_layernorm_linear(x, lw, lb, W, b)).all()  # context still usable


# ---- CUDA-only: poisoned allocator, odd/misaligned views, determinism -------------------

def _poison_allocator():
    poison_allocator(256 << 20)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("M,H,N", [(1, 8, 8), (33, 1, 5), (257, 4096, 64), (19, 1000, 33), (7, 4099, 9),
                                   (3, 40000, 3), (1000, 128, 1000), (4, 2048, 2049)])
def test_cuda_every_element_written(dtype, M, H, N):
    torch.manual_seed(M + H + N)
    x = torch.randn(M, H, device="cuda", dtype=dtype) + 0.5
    lw, lb, W, b = _params(H, N, "cuda", dtype, grad=True)
    x.requires_grad_()
    _poison_allocator()
    for name, f in IMPLS.items():
        y = f(x, lw, lb, W, b)
        assert_close_ref(y, _ref(x, lw, lb, W, b)[0], dtype, f"{name} M={M} H={H} N={N}")
        _poison_allocator()
        grads = torch.autograd.grad(y, (x, lw, lb, W, b), torch.randn_like(y))
        for gr in grads:
            assert torch.isfinite(gr).all()


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_misaligned_views(dtype):
    # Storage offset by one element: the 16-byte vector paths must fall back to scalar.
    torch.manual_seed(5)
    M, H, N = 9, 64, 16
    xb = torch.randn(M * H + 1, device="cuda", dtype=dtype)
    x = xb[1:].view(M, H)
    lwb = torch.randn(H + 1, device="cuda", dtype=dtype)
    lw = lwb[1:]
    lb = torch.randn(H, device="cuda", dtype=dtype)
    W = torch.randn(N, H, device="cuda", dtype=dtype) / 8
    for name, f in IMPLS.items():
        assert_close_ref(f(x, lw, lb, W, None), _ref(x, lw, lb, W, None)[0], dtype, f"misaligned {name}")
    assert_close_ref(gp.layer_norm(x, lw, lb), F.layer_norm(x.double(), (H,), lw.double(), lb.double()), dtype, "ln")


@pytest.mark.usefixtures("fold_plan")
@requires_cuda
def test_cuda_matches_cpu_float64():
    torch.manual_seed(11)
    x = torch.randn(3, 50, 300, dtype=torch.float64) * 3 + 1
    lw, lb, W, b = _params(300, 70, "cpu", torch.float64)
    y_cpu = gp.fused_layernorm_linear(x, lw, lb, W, b)  # the same algebra on both devices
    y_gpu = gp.fused_layernorm_linear(*(t.cuda() for t in (x, lw, lb, W, b)))
    torch.testing.assert_close(y_gpu.cpu(), y_cpu, rtol=1e-12, atol=1e-12)


@requires_cuda
@pytest.mark.parametrize("dtype,M,H,N", [
    (torch.bfloat16, 3000, 64, 4104),   # 16-byte path, 2 column tiles (the second partial), ~3 rows per block
    (torch.bfloat16, 1200, 128, 5000),  # N % 8 != 0: scalar path, 10 column tiles
    (torch.float32, 2500, 33, 2052),    # odd H, 2 tiles of 4-wide vectors
    (torch.float16, 64, 4099, 7),       # a single narrow tile, rows wider than the GEMM output
    (torch.float64, 500, 100, 1030),    # 2-wide vectors, 2 tiles
    (torch.bfloat16, 20000, 16, 24),    # many rows per block (grid.y capped at ~one wave)
])
@pytest.mark.usefixtures("fold_plan")
def test_cuda_fold_epilogue_tiles(dtype, M, H, N):
    # The folded form's epilogue tiles columns across grid.x and walks rows across grid.y,
    # holding r/bp in registers; rows with a large mean (|mean| * rstd > 16) take the
    # accurate branch for their tile's columns only. Mixed rows, poisoned memory.
    x = _large_mean_x((M,), H, [0.0, 0.3, 1000.0, -50.0, 5.0], "cuda", dtype, seed=M + N)
    lw, lb, W, b = _params(H, N, "cuda", dtype, seed=H)
    y_ref = _ref(x, lw, lb, W, b)[0]
    eager = F.linear(F.layer_norm(x, (H,), lw, lb), W, b)
    err_eager = (eager.double() - y_ref).abs().max().item()
    scale = max(1.0, y_ref.abs().max().item())
    for bias in (b, None):
        want = y_ref if bias is not None else _ref(x, lw, lb, W, None)[0]
        _poison_allocator()
        y = gp.fused_layernorm_linear(x, lw, lb, W, bias)
        assert not torch.isnan(y).any(), "an output element was not written"
        err = (y.double() - want).abs().max().item()
        assert err <= 2 * err_eager + 4 * TOL[dtype] * scale, f"error {err:.3e} vs eager {err_eager:.3e}"
    # the large-mean rows specifically (a mistake in the tile bounds of the branch shows here)
    rows = (x.double().mean(-1).abs() > 40).nonzero().flatten()
    assert rows.numel() > 0
    y = gp.fused_layernorm_linear(x, lw, lb, W, b)
    err_rows = (y[rows].double() - y_ref[rows]).abs().max().item()
    assert err_rows <= 2 * err_eager + 4 * TOL[dtype] * scale


@requires_cuda
@pytest.mark.parametrize("dtype,H", [(torch.bfloat16, 1024), (torch.bfloat16, 1032), (torch.float16, 8),
                                     (torch.float32, 7), (torch.float32, 512), (torch.float64, 256),
                                     (torch.float64, 3), (torch.bfloat16, 1)])
def test_cuda_layer_norm_short_rows(dtype, H):
    # Short rows take the warp-per-row kernel (8 rows per block; up to 32 * 4 vectors per
    # row): M not a multiple of 8, poisoned outputs, statistics and output vs float64.
    M = 3001
    torch.manual_seed(H)
    x = (torch.randn(M, H, dtype=torch.float64) * 2 + torch.randn(M, 1, dtype=torch.float64) * 3).to("cuda", dtype)
    lw, lb, _, _ = _params(H, 1, "cuda", dtype)
    _poison_allocator()
    y, mean, rstd = torch.ops.gpu_puzzles.layer_norm(x, lw, lb, EPS)
    assert not torch.isnan(y).any() and not torch.isnan(mean).any() and not torch.isnan(rstd).any()
    assert_close_ref(y, F.layer_norm(x.double(), (H,), lw.double(), lb.double(), EPS), dtype, f"ln H={H}")
    _assert_stats(x, mean, rstd)


@requires_cuda
@pytest.mark.parametrize("dtype,M,H,N", [(torch.bfloat16, 3001, 1024, 24), (torch.bfloat16, 301, 1032, 24),
                                         (torch.float32, 77, 512, 1001), (torch.float16, 5, 8, 3),
                                         (torch.float64, 1000, 256, 40), (torch.float32, 9, 7, 16),
                                         (torch.bfloat16, 257, 4096, 136), (torch.float32, 65, 2052, 33),
                                         (torch.bfloat16, 20, 16384, 40), (torch.bfloat16, 9, 16392, 24),
                                         (torch.float64, 33, 4096, 17), (torch.float64, 17, 4098, 9)])
@pytest.mark.usefixtures("fold_plan")
def test_cuda_fused_prep_statistics_and_fold(dtype, M, H, N):
    # The forward's statistics and fold share one launch, the x rows and W rows in one
    # grid, when H is a multiple of the vector: a warp per row for rows of at most 4
    # vectors per lane (bf16 H <= 1024, fp32 512, fp64 256), a block per row up to 2048
    # vectors (bf16 16384, fp32 8192, fp64 4096; 2052 fp32 leaves some threads' last
    # slots empty); longer or unaligned rows take two launches. Poisoned outputs; mean,
    # rstd and the output (which needs the fold) vs float64.
    torch.manual_seed(M + H + N)
    x = (torch.randn(M, H, dtype=torch.float64) * 2 + torch.randn(M, 1, dtype=torch.float64)).to("cuda", dtype)
    lw, lb, W, b = _params(H, N, "cuda", dtype, bias=N % 2 == 0)
    _poison_allocator()
    y, mean, rstd = torch.ops.gpu_puzzles.fused_layernorm_linear(x, lw, lb, W, b, EPS)
    assert not torch.isnan(y).any() and not torch.isnan(mean).any() and not torch.isnan(rstd).any()
    assert_close_ref(y, _ref(x, lw, lb, W, b)[0], dtype, f"fused M={M} H={H} N={N}")
    _assert_stats(x, mean, rstd)


@requires_cuda
@pytest.mark.parametrize("dtype,M,H,N", [
    (torch.bfloat16, 1000, 1024, 1000),  # one vector per thread, 4 rows per step (M % 4 == 0)
    (torch.bfloat16, 3, 8, 520),         # fewer rows than one step
    (torch.float32, 70, 64, 7),          # db: scalar columns (N % 4 != 0)
    (torch.float16, 129, 40, 1032),      # db: a partial last column tile
    (torch.float64, 130, 16, 24),
    (torch.bfloat16, 5000, 16, 8),       # more than 64 db row chunks' worth of rows
    (torch.bfloat16, 37, 4096, 24),      # 512 threads x 1 vector, last step 1 row of 4
    (torch.bfloat16, 1589, 4096, 24),    # several steps per block (next rows prefetched), ragged last step
    (torch.float16, 3001, 1024, 8),      # 128 threads, several steps per block
    (torch.float32, 13, 2048, 8),        # fp32, 512 threads x 1 vector
    (torch.bfloat16, 21, 8192, 16),      # 4 vectors per thread, 2 rows per step
    (torch.bfloat16, 9, 8200, 16),       # past the register-cached kernels: the looping kernel
    (torch.float16, 30, 44, 24),         # H % 8 != 0: scalar (one element per thread) kernel
])
def test_cuda_fused_backward_all_paths(dtype, M, H, N):
    # On CUDA the fused backward's LayerNorm backward also writes xn (dW = dy^T xn reads it),
    # on each of its kernel paths (above), and db (dy's column sums) is its own launch:
    # column tiles of 64 vectors, up to 64 row chunks, then a fixed-order sum. Poisoned
    # allocations; all five gradients vs float64, and db and dW bitwise repeatable.
    torch.manual_seed(M * 3 + N + H)
    x = (torch.randn(M, H, dtype=torch.float64) + 0.3).to("cuda", dtype).requires_grad_()
    lw, lb, W, b = _params(H, N, "cuda", dtype, grad=True)
    g = torch.randn(M, N, device="cuda", dtype=dtype)
    _poison_allocator()
    grads = torch.autograd.grad(gp.fused_layernorm_linear(x, lw, lb, W, b), (x, lw, lb, W, b), g)
    y_ref, leaves = _ref(x, lw, lb, W, b)
    refs = torch.autograd.grad(y_ref, leaves, g.double())
    rstd_max = (x.detach().double().var(-1, unbiased=False) + EPS).rsqrt().max().item()
    for name, a, r in zip(("dx", "dln_weight", "dln_bias", "dW", "db"), grads, refs):
        assert not torch.isnan(a).any(), name
        k = (N ** 0.5 * max(1.0, rstd_max)) if name == "dx" else M ** 0.5
        assert_close_ref(a / k, r / k, dtype, f"{name} M={M} H={H} N={N}")
    _poison_allocator()
    again = torch.autograd.grad(gp.fused_layernorm_linear(x, lw, lb, W, b), (W, b), g)
    assert torch.equal(grads[3], again[0]) and torch.equal(grads[4], again[1])


@requires_cuda
@pytest.mark.parametrize("dtype,M,H", [
    (torch.bfloat16, 1589, 4096),  # 512 threads x 1 vector: ~100 blocks of ~4 steps, 5 rows past the last full step
    (torch.float32, 2051, 2048),   # fp32, 512 threads x 1 vector
    (torch.float16, 3001, 1024),   # 128 threads, several blocks per SM
    (torch.float64, 1037, 1024),   # fp64 (no prefetch: the second set of rows would spill)
])
def test_cuda_layer_norm_backward_many_steps(dtype, M, H):
    # The one-vector-per-thread backward loads the next step's rows while it reduces and
    # stores the current ones. Blocks take several steps here, the last one partial; poisoned
    # outputs; dx, dweight, dbias vs float64 and bitwise repeatable.
    torch.manual_seed(M + H)
    x = (torch.randn(M, H, dtype=torch.float64) * 1.5 + 0.7).to("cuda", dtype).requires_grad_()
    lw, lb, _, _ = _params(H, 1, "cuda", dtype, grad=True)
    g = torch.randn(M, H, device="cuda", dtype=dtype)
    _poison_allocator()
    grads = torch.autograd.grad(gp.layer_norm(x, lw, lb), (x, lw, lb), g)
    refs = _layer_norm_ref_grads(x, lw, lb, g)
    for name, a, r in zip(("dx", "dweight", "dbias"), grads, refs):
        assert not torch.isnan(a).any(), f"{name}: an element was not written"
        k = M ** 0.5 if name != "dx" else 1.0
        assert_close_ref(a / k, r / k, dtype, f"layer_norm {name} M={M} H={H} {dtype}")
    _poison_allocator()
    again = torch.autograd.grad(gp.layer_norm(x, lw, lb), (x, lw, lb), g)
    for a, c in zip(grads, again):
        assert torch.equal(a, c)


@requires_cuda
@requires_caching_allocator
@pytest.mark.parametrize("M,H,N", [(4096, 2048, 256), (2048, 1024, 1024)])
def test_cuda_fused_backward_peak_memory(M, H, N):
    # Peak extra memory of forward+backward, fused below eager. The fused backward holds xn
    # and dxn (dx is written over dxn); eager also saves its LayerNorm output. A backward
    # that held xn, dxn and dx at once read 417 MiB against eager's 340 at 16384x4096x512.
    torch.manual_seed(0)
    x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    lw, lb, W, b = _params(H, N, "cuda", torch.bfloat16, grad=True)
    g = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)

    def eager(*a):
        return F.linear(F.layer_norm(a[0], (H,), a[1], a[2]), a[3], a[4])

    def peak(f):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        grads = torch.autograd.grad(f(x, lw, lb, W, b), (x, lw, lb, W, b), g)
        torch.cuda.synchronize()
        out = torch.cuda.max_memory_allocated() - base
        del grads
        return out

    for f in (gp.fused_layernorm_linear, eager):
        peak(f)  # warm-up: library workspaces allocated once
    fused, ref = peak(gp.fused_layernorm_linear), peak(eager)
    assert fused < ref, f"fused peak {fused / 2**20:.1f} MiB, eager {ref / 2**20:.1f} MiB"


@requires_cuda
def test_cuda_layer_norm_grid_stride():
    # More rows than one grid covers (2^20 blocks of 8 warp rows): the grid-stride loop.
    M, H = 2**23 + 1001, 2
    x = torch.randn(M, H, device="cuda")
    x[:, 1] += 1.0
    lw, lb = torch.full((H,), 2.0, device="cuda"), torch.tensor([0.5, -0.25], device="cuda")
    _poison_allocator()
    y, mean, rstd = torch.ops.gpu_puzzles.layer_norm(x, lw, lb, EPS)
    ref = F.layer_norm(x.double(), (H,), lw.double(), lb.double(), EPS)
    assert not torch.isnan(y).any()
    assert (y.double() - ref).abs().max().item() < 1e-3  # rstd up to 316 amplifies fp32 rounding of the mean
    torch.testing.assert_close(mean.double(), x.double().mean(-1), rtol=1e-5, atol=1e-6)


@requires_cuda
def test_cuda_backward_deterministic():
    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    lw, lb, W, b = _params(1024, 256, "cuda", torch.bfloat16, grad=True)
    g = torch.randn(4096, 256, device="cuda", dtype=torch.bfloat16)
    first = torch.autograd.grad(gp.fused_layernorm_linear(x, lw, lb, W, b), (x, lw, lb, b), g)
    for _ in range(3):
        again = torch.autograd.grad(gp.fused_layernorm_linear(x, lw, lb, W, b), (x, lw, lb, b), g)
        for a, c in zip(first, again):
            assert torch.equal(a, c)


# ---- CUDA-only: the sm_90 one-GEMM forward (CUTLASS GEMM with the statistics in its epilogue) ----
# Taken for bf16/fp16 on a compute capability 9.0 device when the build holds the sm_90a
# file, H and N are multiples of 8 and x is 16-byte aligned (the knob layernorm_linear_evt=
# cublas turns it off); everything else takes cuBLAS + the epilogue pass. The CUTLASS
# kernel is recognised by its name in the profiler's kernel list.

EVT_SOURCE = "csrc/norms/layernorm_linear_evt_sm90.cu"
# Our CUTLASS kernel's demangled name (cuBLAS kernels are named differently; the epilogue
# node's name comes late in a very long name, in case the profiler shortens it).
EVT_KERNEL_MARKS = ("cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal", "Sm90ColBroadcast")


def _evt_built():
    """Whether the built library holds the CUTLASS forward (its sm_90a source was compiled in)."""
    return EVT_SOURCE in gp.build_info()["sm90a_sources"]


def _evt_expected():
    """Whether the default plan takes the CUTLASS forward (bf16/fp16, shapes and alignment allowing)."""
    return (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and _evt_built()
            and gp.tuning.knobs()["layernorm_linear_evt"][1] in (None, "evt"))


def _kernels(fn):
    """Names of the CUDA kernels `fn` launches, and its result."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA], out


def _ran_evt(names):
    return any(m in n for n in names for m in EVT_KERNEL_MARKS)


@functools.lru_cache(maxsize=None)
def _profiler_sees_kernels():
    """Whether torch.profiler records CUDA kernels in this process. Under compute-sanitizer it
    does not (CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED): the kernel-path checks below are
    then left out, the numerical checks still run. Plain runs check the paths."""
    names, _ = _kernels(lambda: torch.ones(8, device="cuda") + 1)
    return bool(names)


def _ref_and_eager_err(x, lw, lb, W, b):
    y_ref = _ref(x, lw, lb, W, b)[0]
    eager = F.linear(F.layer_norm(x, (x.shape[-1],), lw, lb), W, b)
    return y_ref, (eager.double() - y_ref).abs().max().item()


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,H,N", [
    (300, 264, 520),    # M, N, H not multiples of the tile (128 x 128/256 x 64); K < 2048: ping-pong config
    (1, 8, 8),          # smallest legal problem
    (129, 136, 8),      # a single partial column tile
    (1000, 1024, 256),  # K < 2048
    (257, 2048, 136),   # K = 2048: cooperative 128x256 config, partial tiles both ways
    (333, 4104, 520),   # K >= 2048, K not a multiple of 64
])
@pytest.mark.usefixtures("fold_plan")
def test_cuda_evt_matches_reference(dtype, M, H, N):
    torch.manual_seed(M + H + N)
    x = (torch.randn(M, H, dtype=torch.float64) * 2 + torch.randn(M, 1, dtype=torch.float64)).to("cuda", dtype)
    lw, lb, W, b = _params(H, N, "cuda", dtype, seed=H)
    for bias in (b, None):
        y_ref, err_eager = _ref_and_eager_err(x, lw, lb, W, bias)
        _poison_allocator()
        names, y = _kernels(lambda: gp.fused_layernorm_linear(x, lw, lb, W, bias))
        assert y.shape == (M, N) and y.dtype == dtype
        assert not torch.isnan(y).any(), "an output element was not written"
        _assert_near_eager(y, y_ref, err_eager, dtype)
        if _evt_expected() and _profiler_sees_kernels():
            assert _ran_evt(names), f"expected the CUTLASS EVT GEMM, kernels: {names}"


@pytest.mark.usefixtures("fold_plan")
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,H,N", [(517, 1024, 264), (300, 2048, 520)])  # both configs
def test_cuda_evt_large_mean_rows(dtype, M, H, N):
    # Rows with mean 1e3 and a small spread (|mean| * rstd >> 16) beside ordinary rows: the
    # GEMM writes every row, the fix-up recomputes the large-mean rows only and must leave
    # the others as the GEMM wrote them. Checked row by row against float64.
    g = torch.Generator().manual_seed(M)
    big = torch.rand(M, generator=g) < 0.3
    big[0] = big[-1] = True
    big[1] = False
    mean = torch.where(big, 1e3, 0.2).double()
    std = torch.where(big, 0.5, 1.5).double()
    x = (mean[:, None] + std[:, None] * torch.randn(M, H, generator=g, dtype=torch.float64)).to("cuda", dtype)
    lw, lb, W, b = _params(H, N, "cuda", dtype, seed=N)
    y_ref = _ref(x, lw, lb, W, b)[0]
    eager = F.linear(F.layer_norm(x, (H,), lw, lb), W, b).double()
    _poison_allocator()
    names, y = _kernels(lambda: gp.fused_layernorm_linear(x, lw, lb, W, b))
    assert not torch.isnan(y).any(), "an output element was not written"
    err = (y.double() - y_ref).abs().amax(-1)
    err_eager = (eager - y_ref).abs().amax(-1)
    scale = y_ref.abs().amax(-1).clamp_min(1.0)
    bad = (err > 2 * err_eager + 4 * TOL[dtype] * scale).nonzero().flatten().tolist()
    assert not bad, f"rows {bad[:10]} (large-mean: {big[bad[:10]].tolist()}) err {err[bad[:10]].tolist()}"
    if _evt_expected() and _profiler_sees_kernels():
        assert _ran_evt(names), f"expected the CUTLASS EVT GEMM, kernels: {names}"


@pytest.mark.usefixtures("fold_plan")
@pytest.mark.parametrize("device,dtype", device_dtypes())
@pytest.mark.parametrize("H", [1024, 4104, 40000])  # warp-per-row / block-per-row / looping kernels
def test_statistics_far_first_element(device, dtype, H):
    # The statistics shift by x[0] in their first pass; when x[0] is far from the rest of the
    # row that pass alone leaves the mean off by ~eps_acc * |x[0] - mean| * (a few), so the
    # second pass corrects it (corrected two-pass). Rows whose first 16 elements are 3e3,
    # with the rest ~N(0, 1.5): layer_norm and the fused op's mean and rstd vs float64.
    g = torch.Generator().manual_seed(H)
    xd = torch.randn(6, H, generator=g, dtype=torch.float64) * 1.5
    xd[:, :16] = 3e3
    xd[1] += 1e3  # and a large mean on top
    x = xd.to(device, dtype)
    lw, lb, W, b = _params(H, 8, device, dtype, seed=H)
    _, mean, rstd = torch.ops.gpu_puzzles.layer_norm(x, lw, lb, EPS)
    _assert_stats(x, mean, rstd)
    _, mean, rstd = torch.ops.gpu_puzzles.fused_layernorm_linear(x, lw, lb, W, b, EPS)
    _assert_stats(x, mean, rstd)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,H,N", [
    (5000, 1024, 1032),  # ping-pong config, several tiles per CTA for both warp groups
    (8200, 2048, 1032),  # cooperative config, several tiles per CTA
    (300, 264, 520),     # partial row, column and K tiles (264 = 4 x 64 + 8)
    (129, 40, 8),        # one K tile, most lanes without a chunk
    (1, 8, 16),          # one row, one chunk
    (333, 4104, 264),    # K >= 2048 and not a multiple of 64
])
@pytest.mark.usefixtures("fold_plan")
def test_cuda_evt_statistics(dtype, M, H, N):
    # The CUTLASS path's shapes: the statistics come from the prep pass before the GEMM and
    # its epilogue applies them. Written for the in-GEMM statistics experiment
    # (benchmarks/experiments/lnlinear_gemm_stats.patch, not merged), whose hard cases these
    # are; they hold for any statistics pass. Rows with large means, with a huge first chunk
    # (a bad pivot), with a far-out last chunk, and ordinary rows. Poisoned outputs; stats
    # and y vs float64.
    g = torch.Generator().manual_seed(M + H)
    xd = torch.randn(M, H, generator=g, dtype=torch.float64) * 1.5 + torch.randn(M, 1, generator=g, dtype=torch.float64)
    xd[::7] += 1e3                # large mean, same spread
    xd[3::7, :16] = 3e3           # the first 16 elements far from the rest of the row
    xd[5::7, -8:] = -2e3          # the last chunk (the masked K tile's edge) far from the rest
    x = xd.to("cuda", dtype)
    lw, lb, W, b = _params(H, N, "cuda", dtype, seed=N)
    _poison_allocator()
    names, (y, mean, rstd) = _kernels(lambda: torch.ops.gpu_puzzles.fused_layernorm_linear(x, lw, lb, W, b, EPS))
    assert not torch.isnan(mean).any() and not torch.isnan(rstd).any(), "a row's statistics were not written"
    assert not torch.isnan(y).any(), "an output element was not written"
    _assert_stats(x, mean, rstd)
    y_ref, err_eager = _ref_and_eager_err(x, lw, lb, W, b)
    _assert_near_eager(y, y_ref, err_eager, dtype)
    if _evt_expected() and _profiler_sees_kernels():
        assert _ran_evt(names), f"expected the CUTLASS EVT GEMM, kernels: {names}"


@pytest.mark.usefixtures("fold_plan")
@requires_cuda
@pytest.mark.parametrize("N", [8, 264])
def test_cuda_evt_fixup_many_rows_per_block(N):
    # The fix-up after the GEMM walks ~M / (SMs * blocks per SM) rows per block and skips
    # blockDim.x rows at a time when none of them has a large mean: rows scattered over
    # many such chunks (first, last, spaced by a prime) must all be recomputed, and the
    # others left as the GEMM wrote them. N = 8: 32-thread blocks, ~70 rows per block.
    M, H = many(300_000, 40_000), 16
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(N)
    big = torch.zeros(M, dtype=torch.bool)
    big[::997] = True
    big[-1] = True
    mean = torch.where(big, 1e3, -0.1).double()
    x = (mean[:, None] + 0.5 * torch.randn(M, H, generator=g, dtype=torch.float64)).to("cuda", dtype)
    lw, lb, W, b = _params(H, N, "cuda", dtype, seed=N)
    y_ref = _ref(x, lw, lb, W, b)[0]
    eager = F.linear(F.layer_norm(x, (H,), lw, lb), W, b).double()
    _poison_allocator()
    y = gp.fused_layernorm_linear(x, lw, lb, W, b)
    assert not torch.isnan(y).any(), "an output element was not written"
    err = (y.double() - y_ref).abs().amax(-1)
    bound = 2 * (eager - y_ref).abs().amax(-1) + 4 * TOL[dtype] * y_ref.abs().amax(-1).clamp_min(1.0)
    bad = (err > bound).nonzero().flatten().tolist()
    assert not bad, f"rows {bad[:10]} (large-mean: {big[bad[:10]].tolist()}) err {err[bad[:10]].tolist()}"


@pytest.mark.usefixtures("fold_plan")
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["misaligned_x", "H_not_8", "N_not_8"])
def test_cuda_evt_fallback_conditions(dtype, case):
    # TMA needs 16-byte aligned bases and rows: these take cuBLAS + the epilogue pass,
    # and stay correct.
    torch.manual_seed(7)
    M, H, N = {"misaligned_x": (200, 256, 136), "H_not_8": (200, 260, 136), "N_not_8": (200, 264, 516)}[case]
    if case == "misaligned_x":
        x = (torch.randn(M * H + 1, device="cuda", dtype=dtype) + 0.3)[1:].view(M, H)
        assert x.data_ptr() % 16 != 0
    else:
        x = torch.randn(M, H, device="cuda", dtype=dtype) + 0.3
    lw, lb, W, b = _params(H, N, "cuda", dtype, seed=H + N)
    y_ref, err_eager = _ref_and_eager_err(x, lw, lb, W, b)
    _poison_allocator()
    names, y = _kernels(lambda: gp.fused_layernorm_linear(x, lw, lb, W, b))
    assert not torch.isnan(y).any(), "an output element was not written"
    _assert_near_eager(y, y_ref, err_eager, dtype)
    if _profiler_sees_kernels():
        assert not _ran_evt(names), f"{case} must not take the CUTLASS path, kernels: {names}"


@pytest.mark.usefixtures("fold_plan")
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_evt_knob_off_agrees(dtype):
    # layernorm_linear_evt=cublas takes cuBLAS + the epilogue pass; both paths agree within
    # the dtype's tolerance and match float64.
    torch.manual_seed(3)
    M, H, N = 1030, 2048, 776
    x = _large_mean_x((M,), H, [0.0, 0.5, 1000.0, -3.0], "cuda", dtype, seed=9)
    lw, lb, W, b = _params(H, N, "cuda", dtype, seed=4)
    names, y = _kernels(lambda: gp.fused_layernorm_linear(x, lw, lb, W, b))
    if _evt_expected() and _profiler_sees_kernels():
        assert _ran_evt(names), f"expected the CUTLASS EVT GEMM, kernels: {names}"
    with gp.tuning.override(layernorm_linear_evt="cublas"):
        names_off, y_off = _kernels(lambda: gp.fused_layernorm_linear(x, lw, lb, W, b))
    if _profiler_sees_kernels():
        assert not _ran_evt(names_off), "layernorm_linear_evt=cublas still ran the CUTLASS GEMM"
    y_ref, err_eager = _ref_and_eager_err(x, lw, lb, W, b)
    scale = max(1.0, y_ref.abs().max().item())
    for name, yy in (("evt", y), ("off", y_off)):
        _assert_near_eager(yy, y_ref, err_eager, dtype, name)
    diff = (y.double() - y_off.double()).abs().max().item()
    assert diff <= 4 * TOL[dtype] * scale, f"EVT and cuBLAS paths differ by {diff:.3e}"


@pytest.mark.usefixtures("fold_plan")
@requires_cuda
@pytest.mark.parametrize("M,H,N", [(8192, 1024, 4096), (4096, 4096, 2048)])  # both configs
def test_cuda_evt_pdl_off_agrees(M, H, N):
    # The EVT GEMM is launched as a programmatic dependent of the prep launch, and the
    # large-mean fix-up as one of the GEMM (each waits for its predecessor on the device).
    # Large-mean rows sit in the last rows too, whose tiles the GEMM writes last: a fix-up
    # that did not wait would have its rows overwritten. The result must be bitwise the one
    # of plain launches (layernorm_linear_pdl=plain), and right.
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(M + H)
    big = torch.rand(M, generator=g) < 0.05
    big[-64:] = True
    mean = torch.where(big, 1e3, 0.2).double()
    x = (mean[:, None] + torch.randn(M, H, generator=g, dtype=torch.float64)).to("cuda", dtype)
    lw, lb, W, b = _params(H, N, "cuda", dtype, seed=H)
    _poison_allocator()
    y = gp.fused_layernorm_linear(x, lw, lb, W, b)
    _poison_allocator()
    with gp.tuning.override(layernorm_linear_pdl="plain"):
        y_off = gp.fused_layernorm_linear(x, lw, lb, W, b)
    assert torch.equal(y, y_off), f"PDL and plain launches differ by {(y.double() - y_off.double()).abs().max()}"
    y_ref = _ref(x[-64:], lw, lb, W, b)[0]
    eager = F.linear(F.layer_norm(x[-64:], (H,), lw, lb), W, b).double()
    err = (y[-64:].double() - y_ref).abs().amax(-1)
    bound = 2 * (eager - y_ref).abs().amax(-1) + 4 * TOL[dtype] * y_ref.abs().amax(-1).clamp_min(1.0)
    assert (err <= bound).all(), f"large-mean rows off: {err.max().item():.3e}"


@pytest.mark.usefixtures("fold_plan")
@requires_cuda
@pytest.mark.parametrize("K", [512, 2048])  # both configs
def test_cuda_evt_graph_capture(K):
    # The CUTLASS launch does host work per call (TMA descriptors, smem attribute, workspace
    # query): it must be legal inside CUDA graph capture and replay to the same result.
    # Large-mean rows too: the fix-up is captured as a programmatic dependent of the GEMM.
    torch.manual_seed(K)
    M, N = 384, 264
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16) + 0.3
    x[-3:] += 1e3
    lw, lb, W, b = _params(K, N, "cuda", torch.bfloat16)
    want = gp.fused_layernorm_linear(x, lw, lb, W, b)  # also warms up (first-call queries)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        gp.fused_layernorm_linear(x, lw, lb, W, b)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = gp.fused_layernorm_linear(x, lw, lb, W, b)
    y.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.isnan(y).any()
    if _evt_expected():
        assert torch.equal(y, want)  # no split-K, fixed tile order: bitwise repeatable
    else:
        torch.testing.assert_close(y, want, rtol=TOL[torch.bfloat16], atol=TOL[torch.bfloat16])


@pytest.mark.usefixtures("fold_plan")
@requires_cuda
def test_cuda_evt_taken_when_built():
    # build_info() tells the EVT tests whether CUTLASS was built in; on an sm_90 device a
    # CUTLASS build must actually take the path (else the tests above silently test cuBLAS).
    if not _profiler_sees_kernels():
        pytest.skip("torch.profiler records no kernels here (CUPTI held by compute-sanitizer)")
    if _evt_expected():
        x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
        lw, lb, W, b = _params(512, 256, "cuda", torch.bfloat16)
        names, _ = _kernels(lambda: gp.fused_layernorm_linear(x, lw, lb, W, b))
        assert _ran_evt(names), f"CUTLASS build on sm_90 but the EVT GEMM did not run: {names}"


@pytest.mark.parametrize("device,dtype", device_dtypes())
def test_naive_curriculum_kernel(device, dtype):
    torch.manual_seed(2)
    x = torch.randn(4, 4, 8, device=device, dtype=dtype) + 0.5
    lw, lb, W, b = _params(8, 16, device, dtype)
    for bias in (b, None):
        y = torch.ops.gpu_puzzles.fused_layernorm_linear_naive(x, lw, lb, W, bias, EPS)
        assert_close_ref(y, _ref(x, lw, lb, W, bias)[0], dtype, "naive")
    torch.library.opcheck(torch.ops.gpu_puzzles.fused_layernorm_linear_naive.default, (x, lw, lb, W, b, EPS))


@pytest.mark.parametrize("device,dtype", device_dtypes())
def test_algorithm_naive_and_unfused(device, dtype):
    # The curriculum variants behind the one public function: "naive" is the op
    # fused_layernorm_linear_naive (forward only), "unfused" our layer_norm then F.linear.
    torch.manual_seed(4)
    x = torch.randn(3, 5, 24, device=device, dtype=dtype) + 0.5
    lw, lb, W, b = _params(24, 10, device, dtype)
    y_ref = _ref(x, lw, lb, W, b)[0]
    y_naive = gp.fused_layernorm_linear(x, lw, lb, W, b, algorithm="naive")
    assert torch.equal(y_naive, torch.ops.gpu_puzzles.fused_layernorm_linear_naive(x, lw, lb, W, b, EPS))
    for algorithm in ("auto", "naive", "unfused"):
        assert_close_ref(gp.fused_layernorm_linear(x, lw, lb, W, b, algorithm=algorithm), y_ref, dtype, algorithm)
        assert_close_ref(gp.fused_layernorm_linear(x, None, None, W, algorithm=algorithm),
                         _ref(x, torch.ones_like(lw), torch.zeros_like(lb), W, None)[0], dtype, algorithm)
    eps = 0.5
    assert_close_ref(gp.fused_layernorm_linear(x, lw, lb, W, b, eps=eps, algorithm="naive"),
                     _ref(x, lw, lb, W, b, eps=eps)[0], dtype, "naive eps")


@pytest.mark.parametrize("device", DEVICES)
def test_algorithm_naive_forward_only_and_bad_name(device):
    x = torch.randn(4, 8, device=device, requires_grad=True)
    lw, lb, W, b = _params(8, 3, device, torch.float32)
    with pytest.raises(RuntimeError, match="naive.*forward only"):
        gp.fused_layernorm_linear(x, lw, lb, W, b, algorithm="naive")
    with torch.no_grad():
        y = gp.fused_layernorm_linear(x, lw, lb, W, b, algorithm="naive")
    assert y.shape == (4, 3) and not y.requires_grad
    with pytest.raises(ValueError, match="algorithm must be one of"):
        gp.fused_layernorm_linear(x, lw, lb, W, b, algorithm="fused")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("knobs", [dict(layernorm_linear_evt="evt"), dict(layernorm_linear_evt="cublas"),
                                   dict(layernorm_linear_pdl="plain"), dict(layernorm_linear_plan="normalize"),
                                   dict(layernorm_linear_plan="fold")])
@pytest.mark.usefixtures("fold_plan")
def test_knobs_keep_results(device, knobs):
    # The fused forward's knobs (the CPU path has no CUTLASS GEMM and ignores the evt/pdl
    # knobs): every setting gives a correct result, and the override is undone on exit.
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(6)
    x = torch.randn(130, 264, device=device, dtype=dtype) + 0.3
    x[::9] += 1e3  # large-mean rows: the fix-up after the CUTLASS GEMM
    lw, lb, W, b = _params(264, 136, device, dtype)
    y_ref, err_eager = _ref_and_eager_err(x, lw, lb, W, b)
    before = gp.tuning.knobs()
    with gp.tuning.override(**knobs):
        for name, value in knobs.items():
            assert gp.tuning.knobs()[name][1] == value
        y = gp.fused_layernorm_linear(x, lw, lb, W, b)
    assert gp.tuning.knobs() == before
    _assert_near_eager(y, y_ref, err_eager, dtype)


# ---- property tests (hypothesis; profile from GPU_PUZZLES_HYPOTHESIS_PROFILE, see conftest) ----


# A row whose spread is small against its mean (two values 1e-3 apart at mean 20: variance below
# eps) loses digits to the float32 mean's rounding in any kernel, eager's too, and which way each
# row's mean rounds decides most of the error: such draws get EAGER_FACTOR times eager PyTorch's own
# error on the same inputs on top of the fixed tolerance (600 draws: ours at most 3.2x eager's, in
# dln_weight; as often below eager's as above).
EAGER_FACTOR = 4


def _check_grads(grads, refs, names, x, dtype, N, eager):
    """Each gradient against float64, allowed EAGER_FACTOR times eager's own error (``eager``:
    its gradients of the same inputs) on top of the usual tolerance."""
    M = x.numel() // x.shape[-1]
    rstd_max = (x.detach().double().var(-1, unbiased=False) + EPS).rsqrt().max().item() if M else 1.0
    for name, a, r, e in zip(names, grads, refs, eager):
        # dx is scaled by rstd and sums N outputs; parameter grads sum over M rows
        if name == "dx":
            s = max(1.0, rstd_max)
            close_to_eager(a / s, r / s, e / s, dtype, name, N, EAGER_FACTOR)
        else:
            close_to_eager(a, r, e, dtype, name, M, EAGER_FACTOR)


@pytest.mark.parametrize("device", DEVICES)
@given(data=st.data())
def test_property_layer_norm(device, data):
    """Random leading shape (none, empty, primes), H (1, primes, vector edges), mean offset,
    dtype and strides (transposed: a strided last dim; stride 0) against float64."""
    x, dtype, seed = norm_input(device, data, 300 if device == "cpu" else 5000)
    H = x.shape[-1]
    lw = make_tensor((H,), dtype, device, data.draw(layouts(1), "w layout"), seed + 1, shift=1.0, requires_grad=True)
    lb = make_tensor((H,), dtype, device, data.draw(layouts(1), "b layout"), seed + 2, requires_grad=True)
    y = gp.layer_norm(x, lw, lb)
    assert y.shape == x.shape and y.dtype == dtype
    leaves = [t.detach().double().requires_grad_() for t in (x, lw, lb)]
    y_ref = F.layer_norm(leaves[0], (H,), leaves[1], leaves[2], EPS)
    eager_y = F.layer_norm(x.detach(), (H,), lw.detach(), lb.detach(), EPS)
    close_to_eager(y, y_ref, eager_y, dtype, "layer_norm", factor=EAGER_FACTOR)
    g = make_tensor(x.shape, dtype, device, seed=seed + 3)
    grads = torch.autograd.grad(y, (x, lw, lb), g)
    refs = torch.autograd.grad(y_ref, leaves, g.double())
    eager_in = [t.detach().requires_grad_() for t in (x, lw, lb)]
    eager = torch.autograd.grad(F.layer_norm(eager_in[0], (H,), eager_in[1], eager_in[2], EPS), eager_in, g)
    _check_grads(grads, refs, ("dx", "dweight", "dbias"), x, dtype, 1, eager)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", list(IMPLS))
@given(data=st.data())
def test_property_layernorm_linear(device, impl, data):
    """fused / unfused LayerNorm+Linear (and the naive kernel's forward) on random shapes,
    N, bias, dtype and strides (a transposed linear_weight too) against float64, all five grads."""
    x, dtype, seed = norm_input(device, data, 200 if device == "cpu" else 1100)
    H = x.shape[-1]
    N = data.draw(extents(70 if device == "cpu" else 300), "N")
    lw, lb, W, b = _params(H, N, device, dtype, bias=data.draw(st.booleans(), "bias"), grad=True, seed=seed)
    W = W.detach().t().contiguous().t() if data.draw(st.booleans(), "W column-major") else W
    W = W.detach().requires_grad_()
    y = IMPLS[impl](x, lw, lb, W, b)
    assert y.shape == (*x.shape[:-1], N) and y.dtype == dtype
    y_ref, leaves = _ref(x, lw, lb, W, b)
    # x's mean shift enters the GEMM in the folded form: compare like test_large_mean_inputs
    eager = F.linear(F.layer_norm(x.detach(), (H,), lw.detach(), lb.detach()), W.detach(),
                     None if b is None else b.detach())
    err_eager = (eager.double() - y_ref).abs().max().item() if y.numel() else 0.0
    assert not torch.isnan(y).any()
    _assert_near_eager(y, y_ref, err_eager, dtype, impl)
    if impl == "fused":
        y_naive = torch.ops.gpu_puzzles.fused_layernorm_linear_naive(x.detach(), lw.detach(), lb.detach(),
                                                                     W.detach(), None if b is None else b.detach())
        _assert_near_eager(y_naive, y_ref, err_eager, dtype, "naive")
    g = make_tensor(y.shape, dtype, device, seed=seed + 3)
    params = [t for t in (x, lw, lb, W, b) if t is not None]
    grads = torch.autograd.grad(y, params, g)
    refs = torch.autograd.grad(y_ref, [t for t in leaves if t is not None], g.double())
    eager_in = [t.detach().requires_grad_() for t in params]
    xe, lwe, lbe, We = eager_in[:4]
    ye = F.linear(F.layer_norm(xe, (H,), lwe, lbe, EPS), We, eager_in[4] if b is not None else None)
    eager = torch.autograd.grad(ye, eager_in, g)
    _check_grads(grads, refs, ("dx", "dln_weight", "dln_bias", "dlinear_weight", "dlinear_bias"), x, dtype, N, eager)


# ---- CPU kernels at every SIMD level (csrc/common/cpu_isa.h) ---------------------------
# The cpu_simd knob caps the run-time level; hidden sizes around the vector widths (8 / 16
# floats, 4 / 8 doubles) and past the 4096-element chunk of the row sums.


@pytest.mark.parametrize("level", CPU_SIMD)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_cpu_every_simd_level(level, dtype):
    torch.manual_seed(3)
    with gp.tuning.override(cpu_simd=level):
        for H, N in ((1, 3), (7, 9), (16, 17), (17, 8), (33, 40), (100, 31), (4097, 5)):
            x = (torch.randn(37, H, dtype=torch.float64) * 1.5 + 0.5).to(dtype).requires_grad_()
            lw, lb, W, b = _params(H, N, "cpu", dtype, grad=True)
            what = f"H={H} N={N} {dtype} {level}"
            # layer_norm forward and backward
            y = gp.layer_norm(x, lw, lb)
            ref = F.layer_norm(x.detach().double(), (H,), lw.detach().double(), lb.detach().double(), EPS)
            assert_close_ref(y, ref, dtype, "layer_norm " + what)
            g = torch.randn_like(y)
            grads = torch.autograd.grad(y, (x, lw, lb), g)
            refs = _layer_norm_ref_grads(x, lw, lb, g)
            rstd_max = (x.detach().double().var(-1, unbiased=False) + EPS).rsqrt().max().item()
            for name, a, r in zip(("dx", "dweight", "dbias"), grads, refs):
                k = max(1.0, rstd_max) if name == "dx" else 37 ** 0.5
                assert_close_ref(a / k, r / k, dtype, f"layer_norm {name} {what}")
            # fused forward, backward and the naive kernel
            y = gp.fused_layernorm_linear(x, lw, lb, W, b)
            y_ref, leaves = _ref(x, lw, lb, W, b)
            assert_close_ref(y, y_ref, dtype, "fused " + what)
            with torch.no_grad():
                y_naive = gp.fused_layernorm_linear(x, lw, lb, W, b, algorithm="naive")
            assert_close_ref(y_naive, y_ref, dtype, "naive " + what)
            g = torch.randn_like(y)
            grads = torch.autograd.grad(y, (x, lw, lb, W, b), g)
            refs = torch.autograd.grad(y_ref, leaves, g.double())
            for name, a, r in zip(("dx", "dln_weight", "dln_bias", "dlinear_weight", "dlinear_bias"), grads, refs):
                k = (N ** 0.5 * max(1.0, rstd_max)) if name == "dx" else 37 ** 0.5
                assert_close_ref(a / k, r / k, dtype, f"fused {name} {what}")


@pytest.mark.usefixtures("fold_plan")
@pytest.mark.parametrize("level", CPU_SIMD)
def test_cpu_large_mean_every_simd_level(level):
    # Rows far from zero mean: the statistics' shifted sums and the fused forward's
    # normalise-first rows, in every copy of the kernels.
    torch.manual_seed(4)
    with gp.tuning.override(cpu_simd=level):
        for dtype in (torch.float32, torch.float64):
            x = (torch.randn(6, 300, dtype=torch.float64) + torch.tensor([0.0, 8.0, 1000.0, -3000.0, 20.0, 1e5]
                                                                         ).unsqueeze(1)).to(dtype)
            lw, lb, W, b = _params(300, 24, "cpu", dtype)
            _, mean, rstd = torch.ops.gpu_puzzles.layer_norm(x, lw, lb, EPS)
            _assert_stats(x, mean, rstd)
            y_ref = _ref(x, lw, lb, W, b)[0]
            # as accurate as PyTorch's own pair in the same dtype (a float32 mean of 1e5 carries ~4e-3)
            err_eager = (F.linear(F.layer_norm(x, (300,), lw, lb), W, b).double() - y_ref).abs().max().item()
            for f in (gp.fused_layernorm_linear, functools.partial(gp.fused_layernorm_linear, algorithm="naive")):
                _assert_near_eager(f(x, lw, lb, W, b), y_ref, err_eager, dtype, f"large mean {dtype} {level}")


def test_cpu_layer_norm_backward_deterministic():
    # dweight / dbias are summed over fixed blocks of rows: the same bits at any thread count.
    torch.manual_seed(6)
    x = torch.randn(1000, 96, requires_grad=True)
    lw, lb, _, _ = _params(96, 1, "cpu", torch.float32, grad=True)
    g = torch.randn(1000, 96)
    prev = torch.get_num_threads()
    try:
        outs = []
        for t in (1, max(2, prev)):
            torch.set_num_threads(t)
            outs.append(torch.autograd.grad(gp.layer_norm(x, lw, lb), (x, lw, lb), g))
    finally:
        torch.set_num_threads(prev)
    for a, b in zip(*outs):
        assert torch.equal(a, b)
