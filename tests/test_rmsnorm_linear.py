"""RMSNorm and fused RMSNorm+Linear: float64 references, both plans, W layouts, gradcheck,
opcheck, torch.compile, modules and bad input."""
import pytest
import torch
import torch.nn.functional as F
from conftest import (
    DEVICES,
    HAS_CUDA,
    TOL,
    assert_backward_fills_as_op,
    assert_close_ref,
    assert_compiled_matches_eager,
    copy_kernels,
    device_dtypes,
    many,
    poison_allocator,
    requires_cuda,
)
from hypothesis import given
from hypothesis import strategies as st
from strategies import close_to_eager, extents, layouts, make_tensor, norm_input

import gpu_puzzles as gp
from gpu_puzzles.ops._common import schema_default

PLANS = ("fold", "normalize")  # the fused forward's plans (knob layernorm_linear_plan)
EPS = schema_default(torch.ops.gpu_puzzles.rms_norm.default, "eps")
ops = torch.ops.gpu_puzzles


def _planned(plan):
    # Llama's eps (the op's schema default), against which _ref computes; F's default: test_f_parity.py.
    def f(x, nw, W, b=None, eps=EPS):
        if plan is None:
            return gp.fused_rmsnorm_linear(x, nw, W, b, eps)
        with gp.tuning.override(layernorm_linear_plan=plan):
            return gp.fused_rmsnorm_linear(x, nw, W, b, eps)
    return f


IMPLS = {"auto": _planned(None), **{p: _planned(p) for p in PLANS}}


def _params(H, N, device, dtype, bias=True, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    nw = (1 + 0.5 * torch.randn(H, generator=g, dtype=torch.float64)).to(device, dtype)
    W = (torch.randn(N, H, generator=g, dtype=torch.float64) / H ** 0.5).to(device, dtype)
    b = (0.5 * torch.randn(N, generator=g, dtype=torch.float64)).to(device, dtype) if bias else None
    return [p.requires_grad_(grad) if p is not None else None for p in (nw, W, b)]


def _x(lead, H, device, dtype, seed=1, grad=False):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*lead, H, generator=g, dtype=torch.float64) + 0.3).to(device, dtype)
    return x.requires_grad_(grad)


def _rms64(x, w, eps=EPS):
    x = x.double()
    return x * (x.square().mean(-1, keepdim=True) + eps).rsqrt() * w.double()


def _w_view(W, layout):
    """W's values in a memory layout: "rows" (N, H) row-major, "t" a view of (H, N) memory."""
    if layout == "rows":
        return W
    return W.detach().t().contiguous().t().requires_grad_(W.requires_grad)


# Odd hidden sizes (1, 7, 768, 2049, 8193) and the vector/warp/block/loop paths of the kernels.
SHAPES = [((4, 4), 8, 16), ((3, 5), 1, 3), ((5,), 7, 9), ((2, 3), 64, 33), ((6,), 768, 40)]
CUDA_SHAPES = [((9,), 2049, 24), ((3,), 8193, 8), ((37,), 4096, 96), ((2,), 40000, 4)]


def _cases():
    out = []
    for device, dtype in device_dtypes():
        for shape in SHAPES + (CUDA_SHAPES if device == "cuda" else [((3,), 2049, 5)]):
            out.append((device, dtype, shape))
    return out


def _ids(c):
    return f"{c[0]}-{str(c[1]).split('.')[-1]}-{c[2]}"


CASES = _cases()


@pytest.mark.parametrize("device,dtype,shape", CASES, ids=[_ids(c) for c in CASES])
def test_rms_norm_forward_and_backward(device, dtype, shape):
    lead, H, _ = shape
    if device == "cuda":
        poison_allocator(1 << 24)
    x = _x(lead, H, device, dtype, grad=True)
    (w,) = [p.requires_grad_() for p in _params(H, 1, device, dtype)[:1]]
    y, rstd = ops.rms_norm(x, w, EPS)
    assert rstd.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert rstd.shape == x.shape[:-1]
    torch.testing.assert_close(rstd.double(), (x.double().square().mean(-1) + EPS).rsqrt(), rtol=1e-5, atol=0)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = _rms64(x64, w64)
    assert_close_ref(y, ref, dtype, "y")
    assert_close_ref(gp.rms_norm(x, w, EPS), ref, dtype, "rms_norm")
    g = torch.randn_like(ref)
    dx, dw = torch.autograd.grad(gp.rms_norm(x, w, EPS), (x, w), g.to(dtype))
    rdx, rdw = torch.autograd.grad(ref, (x64, w64), g.to(dtype).double())
    assert_close_ref(dx, rdx, dtype, "dx")
    # dw sums over M rows: its error grows like sqrt(M) * the element error.
    assert_close_ref(dw / max(1, x.numel() // H) ** 0.5, rdw / max(1, x.numel() // H) ** 0.5, dtype, "dw")


@pytest.mark.parametrize("device,dtype", device_dtypes())
def test_matches_torch_and_llama_rmsnorm(device, dtype):
    # torch.nn.functional.rms_norm, and Llama's RMSNorm (fp32 statistics, cast back before the weight).
    x = _x((4, 9), 96, device, dtype)
    w = _params(96, 1, device, dtype)[0]
    y = gp.rms_norm(x, w, 1e-5)
    ref = _rms64(x, w, 1e-5)
    err_torch = (F.rms_norm(x, (96,), w, 1e-5).double() - ref).abs().max().item()
    xf = x.float()
    llama = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    err_llama = (llama.double() - ref).abs().max().item()
    err = (y.double() - ref).abs().max().item()
    assert err <= max(err_torch, err_llama) + 4 * TOL[dtype] * max(1.0, ref.abs().max().item())
    if dtype in (torch.float32, torch.float64):
        torch.testing.assert_close(y, F.rms_norm(x, (96,), w, 1e-5))


def _ref(x, nw, W, b, eps=EPS):
    leaves = [t.detach().double().requires_grad_() if t is not None else None for t in (x, nw, W, b)]
    x64, nw64, W64, b64 = leaves
    return F.linear(_rms64(x64, nw64, eps), W64, b64), leaves


@pytest.mark.parametrize("device,dtype,shape", CASES, ids=[_ids(c) for c in CASES])
@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("bias", [True, False])
def test_fused_forward_backward(device, dtype, shape, impl, bias):
    lead, H, N = shape
    if device == "cuda":
        poison_allocator(1 << 24)
    x = _x(lead, H, device, dtype, grad=True)
    nw, W, b = _params(H, N, device, dtype, bias=bias, grad=True)
    y = IMPLS[impl](x, nw, W, b)
    ref, leaves = _ref(x, nw, W, b)
    assert y.shape == ref.shape and y.dtype == dtype
    assert_close_ref(y, ref, dtype, "y")
    g = torch.randn_like(ref)
    inputs = [t for t in (x, nw, W, b) if t is not None]
    grads = torch.autograd.grad(y, inputs, g.to(dtype))
    refs = torch.autograd.grad(ref, [t for t in leaves if t is not None], g.to(dtype).double())
    M = max(1, x.numel() // H)
    for name, a, r in zip(("dx", "dnorm_weight", "dW", "db"), grads, refs):
        # Gradients of weights sum over M rows (and dnorm_weight over N): scale their tolerance.
        s = 1.0 if name == "dx" else (M * (N if name == "dnorm_weight" else 1)) ** 0.5
        assert a.shape == r.shape
        assert_close_ref(a / s, r / s, dtype, name)


@pytest.mark.parametrize("device,dtype", device_dtypes())
@pytest.mark.parametrize("plan", ("auto",) + PLANS)
@pytest.mark.parametrize("layout", ("rows", "t"))
def test_w_layouts(device, dtype, plan, layout):
    x = _x((3, 5), 24, device, dtype, grad=True)
    nw, W, b = _params(24, 40, device, dtype, grad=True)
    Wv = _w_view(W, layout)
    y = IMPLS[plan](x, nw, Wv, b)
    ref, leaves = _ref(x, nw, W, b)
    assert_close_ref(y, ref, dtype, "y")
    (dW,) = torch.autograd.grad(y, (Wv,), torch.ones_like(y))
    assert dW.stride() == Wv.stride()  # dW in W's layout: no copy in AccumulateGrad
    (rdW,) = torch.autograd.grad(ref.sum(), (leaves[2],))
    assert_close_ref(dW / 15 ** 0.5, rdW / 15 ** 0.5, dtype, "dW")


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_transposed_w_not_copied(dtype):
    # Conv1D-style W.t() and Llama-style (N, H) W: neither forward nor backward copies W or x.
    x = _x((4, 64), 256, "cuda", dtype, grad=True)
    nw, W, _ = _params(256, 384, "cuda", dtype, bias=False, grad=True)
    for Wv in (W, _w_view(W, "t")):
        def step():
            y = gp.fused_rmsnorm_linear(x, nw, Wv)
            return torch.autograd.grad(y, (x, nw, Wv), torch.ones_like(y))
        _, copies = copy_kernels(step)
        assert not copies, copies


@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck(device):
    x = _x((3, 2), 6, device, torch.float64, grad=True)
    nw, W, b = _params(6, 5, device, torch.float64, grad=True)
    assert torch.autograd.gradcheck(gp.rms_norm, (x, nw))
    for plan in PLANS:
        f = _planned(plan)
        assert torch.autograd.gradcheck(f, (x, nw, W, b))
        assert torch.autograd.gradcheck(lambda *a: f(*a, None), (x, nw, _w_view(W, "t")))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("layout", ("rows", "t"))
def test_opcheck(device, requires_grad, layout):
    x = torch.randn(2, 3, 8, device=device, requires_grad=requires_grad)
    nw, W, b = _params(8, 5, device, torch.float32, grad=requires_grad)
    W = _w_view(W, layout)
    torch.library.opcheck(ops.rms_norm.default, (x, nw, EPS))
    for plan in PLANS:
        with gp.tuning.override(layernorm_linear_plan=plan):
            torch.library.opcheck(ops.fused_rmsnorm_linear.default, (x, nw, W, b, EPS))
            torch.library.opcheck(ops.fused_rmsnorm_linear.default, (x, nw, W, None, EPS))
    xd, nwd, Wd = (t.detach() for t in (x, nw, W))
    _, rstd = ops.rms_norm(xd, nwd, EPS)
    torch.library.opcheck(ops.rms_norm_backward.default, (torch.randn_like(xd), xd, nwd, rstd))
    g = torch.randn(2, 3, 5, device=device)
    for has_bias in (True, False):
        torch.library.opcheck(ops.fused_rmsnorm_linear_backward.default, (g, xd, nwd, Wd, rstd, has_bias))


@pytest.mark.parametrize("device", DEVICES)
def test_backward_adds_no_fill_for_statistics(device):
    # rstd carries no gradient: autograd must not fill zeros for it per call.
    x = _x((4, 6), 8, device, torch.float32, grad=True)
    nw, W, b = _params(8, 5, device, torch.float32, grad=True)
    y, rstd = ops.rms_norm(x, nw, EPS)
    g = torch.randn_like(y)
    assert_backward_fills_as_op(y, g, lambda: ops.rms_norm_backward(g, x, nw, rstd))
    y, rstd = ops.fused_rmsnorm_linear(x, nw, W, b, EPS)
    g = torch.randn_like(y)
    assert_backward_fills_as_op(y, g, lambda: ops.fused_rmsnorm_linear_backward(g, x, nw, W, rstd, True))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_forward_backward(device):
    torch.manual_seed(0)
    fused = gp.nn.RMSNormLinear(16, 12, bias=True, device=device)
    norm = gp.nn.RMSNorm(16, device=device)
    with torch.no_grad():
        fused.norm_weight.normal_(1, 0.3)
        norm.weight.normal_(1, 0.3)

    def f(x):
        return fused(x) + fused(norm(x))

    params = (fused.norm_weight, fused.weight, fused.bias, norm.weight)
    xs = [torch.randn(M, 16, device=device, requires_grad=True) for M in (5, 9)]
    assert_compiled_matches_eager(f, [((x,), (x, *params)) for x in xs])


@pytest.mark.parametrize("device", DEVICES)
def test_modules_share_parameters(device):
    torch.manual_seed(3)
    norm, lin = torch.nn.RMSNorm(32, eps=1e-5, device=device), torch.nn.Linear(32, 20, bias=False, device=device)
    with torch.no_grad():
        norm.weight.normal_(1, 0.3)
    fused = gp.nn.RMSNormLinear.from_modules(norm, lin)
    assert fused.norm_weight is norm.weight and fused.weight is lin.weight and fused.bias is None
    assert fused.eps == 1e-5
    x = torch.randn(3, 7, 32, device=device)
    torch.testing.assert_close(fused(x), lin(norm(x)), rtol=1e-5, atol=1e-5)
    fused(x).sum().backward()
    assert norm.weight.grad is not None and lin.weight.grad is not None
    single = gp.nn.RMSNorm.from_module(norm)
    assert single.weight is norm.weight
    torch.testing.assert_close(single(x), norm(x), rtol=1e-5, atol=1e-5)

    class LlamaStyle(torch.nn.Module):  # transformers' LlamaRMSNorm keeps variance_epsilon
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(32, device=device))
            self.variance_epsilon = 1e-6

    assert gp.nn.RMSNormLinear.from_modules(LlamaStyle(), lin).eps == 1e-6
    with pytest.raises(ValueError, match="in_features"):
        gp.nn.RMSNormLinear.from_modules(torch.nn.RMSNorm(8, device=device), lin)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("plan", ("auto",) + PLANS)
def test_empty_and_strided(device, plan):
    nw, W, b = _params(16, 6, device, torch.float32)
    f = IMPLS[plan]
    y = f(torch.randn(0, 16, device=device), nw, W, b)
    assert y.shape == (0, 6)
    xb = torch.randn(10, 24, device=device)
    x = xb[:, :16]  # rows of a wider buffer
    ref, _ = _ref(x, nw, W, b)
    assert_close_ref(f(x, nw, W, b), ref, torch.float32, "strided x")
    assert_close_ref(gp.rms_norm(x, nw, EPS), _rms64(x, nw), torch.float32, "strided rms_norm")


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input_names_the_argument(device):
    x = torch.randn(4, 8, device=device)
    nw, W, b = _params(8, 5, device, torch.float32)
    cases = [
        (lambda: gp.rms_norm(x, torch.ones(7, device=device)), "weight"),
        (lambda: gp.rms_norm(x, torch.ones(8, 1, device=device)), "weight"),
        (lambda: gp.rms_norm(x, nw.double()), "weight"),
        (lambda: gp.rms_norm(x.long(), nw), "x"),
        (lambda: gp.rms_norm(x, nw, -1.0), "eps"),
        (lambda: gp.fused_rmsnorm_linear(x, nw[:7], W, b), "norm_weight"),
        (lambda: gp.fused_rmsnorm_linear(x, nw.half(), W, b), "norm_weight"),
        (lambda: gp.fused_rmsnorm_linear(x, nw, W[:, :7], b), "linear_weight"),
        (lambda: gp.fused_rmsnorm_linear(x, nw, W[0], b), "linear_weight"),
        (lambda: gp.fused_rmsnorm_linear(x, nw, W.double(), b), "linear_weight"),
        (lambda: gp.fused_rmsnorm_linear(x, nw, W, b[:4]), "linear_bias"),
        (lambda: gp.fused_rmsnorm_linear(x, nw, W, b.double()), "linear_bias"),
    ]
    if HAS_CUDA:
        other = "cpu" if device == "cuda" else "cuda"
        cases += [(lambda: gp.rms_norm(x, nw.to(other)), "weight"),
                  (lambda: gp.fused_rmsnorm_linear(x, nw, W.to(other), b), "linear_weight"),
                  (lambda: gp.fused_rmsnorm_linear(x, nw, W, b.to(other)), "linear_bias")]
    for fn, name in cases:
        with pytest.raises((RuntimeError, ValueError), match=name):
            fn()


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("plan", PLANS)
def test_cuda_llama_like_shape(dtype, plan):
    # A Llama-like projection (tall x, K = 2048 is the normalise side of the rule; the forced
    # fold takes the sm_90a epilogue GEMM where built), against float64.
    M = many(512, 64)
    x = _x((M,), 2048, "cuda", dtype, grad=True)
    nw, W, _ = _params(2048, 768, "cuda", dtype, bias=False, grad=True)
    y = _planned(plan)(x, nw, W)
    ref, leaves = _ref(x, nw, W, None)
    assert_close_ref(y, ref, dtype, "y")
    g = torch.randn_like(ref)
    grads = torch.autograd.grad(y, (x, nw, W), g.to(dtype))
    refs = torch.autograd.grad(ref, leaves[:3], g.to(dtype).double())
    for name, a, r, s in zip(("dx", "dnw", "dW"), grads, refs, (1.0, (M * 768) ** 0.5, M ** 0.5)):
        assert_close_ref(a / s, r / s, dtype, name)


# ---- property tests (hypothesis; profile from GPU_PUZZLES_HYPOTHESIS_PROFILE, see conftest) ----
# Against float64, within twice eager PyTorch's own error (same dtype and inputs) on top of the
# tolerance: a row whose spread is small against its mean loses digits in any float32 kernel.

def _check_all(outs, refs, eagers, names, dtype, sums):
    for name, a, r, e, n in zip(names, outs, refs, eagers, sums):
        close_to_eager(a, r, e, dtype, name, n)


@pytest.mark.parametrize("device", DEVICES)
@given(data=st.data())
def test_property_rms_norm(device, data):
    """Random leading shape (none, empty), H, mean offset, dtype, strides, weight or none, eps."""
    x, dtype, seed = norm_input(device, data, 300 if device == "cpu" else 5000)
    H = x.shape[-1]
    w = make_tensor((H,), dtype, device, data.draw(layouts(1), "w layout"), seed + 1, shift=1.0, requires_grad=True) \
        if data.draw(st.booleans(), "weight") else None
    eps = data.draw(st.sampled_from([None, 1e-6, 1e-5]), "eps")
    y = gp.rms_norm(x, w, eps)
    assert y.shape == x.shape and y.dtype == dtype
    params = [t for t in (x, w) if t is not None]
    leaves = [t.detach().double().requires_grad_() for t in params]
    eager_in = [t.detach().requires_grad_() for t in params]
    ref_eps = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps if eps is None else eps
    ref = F.rms_norm(leaves[0], (H,), leaves[1] if w is not None else None, ref_eps)
    eager = F.rms_norm(eager_in[0], (H,), eager_in[1] if w is not None else None, eps)
    g = make_tensor(x.shape, dtype, device, seed=seed + 3)
    M = x.numel() // H
    _check_all((y,) + torch.autograd.grad(y, params, g), (ref,) + torch.autograd.grad(ref, leaves, g.double()),
               (eager,) + torch.autograd.grad(eager, eager_in, g), ("output", "dx", "dweight"), dtype, (1, 1, M))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", list(IMPLS))
@given(data=st.data())
def test_property_rmsnorm_linear(device, impl, data):
    """fused RMSNorm+Linear on random shapes, N, bias, mean offset, dtype, strides and a
    transposed linear weight against float64, output and all four gradients."""
    x, dtype, seed = norm_input(device, data, 200 if device == "cpu" else 1100)
    H = x.shape[-1]
    N = data.draw(extents(70 if device == "cpu" else 300), "N")
    nw, W, b = _params(H, N, device, dtype, bias=data.draw(st.booleans(), "bias"), grad=True, seed=seed)
    W = _w_view(W, data.draw(st.sampled_from(["rows", "t"]), "W layout"))
    eps = data.draw(st.sampled_from([1e-6, 1e-5]), "eps")
    y = IMPLS[impl](x, nw, W, b, eps)
    assert y.shape == (*x.shape[:-1], N) and y.dtype == dtype
    params = [t for t in (x, nw, W, b) if t is not None]
    ref, leaves = _ref(x, nw, W, b, eps)
    eager_in = [t.detach().requires_grad_() for t in params]
    eager = F.linear(F.rms_norm(eager_in[0], (H,), eager_in[1], eps), eager_in[2],
                     eager_in[3] if b is not None else None)
    g = make_tensor(y.shape, dtype, device, seed=seed + 3)
    M = x.numel() // H
    _check_all((y,) + torch.autograd.grad(y, params, g),
               (ref,) + torch.autograd.grad(ref, [t for t in leaves if t is not None], g.double()),
               (eager,) + torch.autograd.grad(eager, eager_in, g),
               ("output", "dx", "dnorm_weight", "dlinear_weight", "dlinear_bias"), dtype, (H, N, M, M, M))
