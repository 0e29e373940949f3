"""Every op under torch.autocast, one row per op, on every device: the dtype each result
comes back in is the one its PyTorch counterpart gives there (ATen's autocast lists), the
values match that counterpart's computed in float64 from the same (cast) inputs, gradients
come back in each input's own dtype, and torch.compile(fullgraph=True) gives eager's
results. Plus the mixed dtypes autocast hands the fused ops (a float32 x under a half
linear weight), called directly."""
import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICES, poison_allocator, requires_cuda

import gpu_puzzles as gp

LOW = {"cpu": torch.bfloat16, "cuda": torch.float16}  # torch.autocast's default dtype per device
# Error of a result computed from `low` inputs, relative to the reference's scale.
TOL = {torch.bfloat16: 3e-2, torch.float16: 4e-3, torch.float32: 1e-5}


def _close(actual, ref, dtype, what, tol=None):
    """actual has `dtype` and is within `tol`'s (default: dtype's) tolerance of the reference."""
    assert actual.dtype == dtype, f"{what}: dtype {actual.dtype}, expected {dtype}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    scale = max(1.0, ref.abs().max().item())
    err = (actual.double() - ref.double()).abs().max().item()
    assert err <= 4 * TOL[tol or dtype] * scale, f"{what}: max error {err:.3e} ({tol or dtype})"


def _leaf(*shape, device, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, device=device, dtype=torch.float64) * scale).to(dtype).requires_grad_()


def _grads_back_in_own_dtype(out, inputs):
    g = torch.autograd.grad(out.float().sum(), inputs, allow_unused=False)
    for t, gt in zip(inputs, g):
        assert gt.dtype == t.dtype and gt.shape == t.shape and torch.isfinite(gt).all()
    return g


@pytest.mark.parametrize("device", DEVICES)
def test_attention_autocast_casts_q_k_v(device):
    """As SDPA under autocast: q and k in float32 (after a rotary embedding) meet a half v in
    the autocast dtype; the output is that dtype, the gradients each input's."""
    low = LOW[device]
    torch.manual_seed(0)
    q, k = _leaf(2, 4, 33, 64, device=device), _leaf(2, 4, 33, 64, device=device)
    v = _leaf(2, 4, 33, 64, device=device, dtype=low)
    with torch.autocast(device, dtype=low):
        out = gp.attention(q, k, v, causal=True)
    ref = F.scaled_dot_product_attention(*(t.detach().to(low).double() for t in (q, k, v)), is_causal=True)
    _close(out, ref, low, "attention")
    _grads_back_in_own_dtype(out, (q, k, v))


@pytest.mark.parametrize("device", DEVICES)
def test_conv1d_autocast(device):
    low = LOW[device]
    torch.manual_seed(1)
    x, w, b = _leaf(2, 8, 50, device=device), _leaf(8, 4, device=device), _leaf(8, device=device)
    with torch.autocast(device, dtype=low):
        out = gp.conv1d(x, w, b, causal=True)
    xd, wd, bd = (t.detach().to(low).double() for t in (x, w, b))
    ref = F.conv1d(F.pad(xd, (3, 0)), wd.unsqueeze(1), bd, groups=8)
    _close(out, ref, low, "conv1d")
    _grads_back_in_own_dtype(out, (x, w, b))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["softmax", "log_softmax"])
def test_softmax_autocast(device, kind):
    """As torch.softmax: float32 from a half input on CUDA; as given on the CPU (PyTorch has no
    CPU rule for it)."""
    low = LOW[device]
    torch.manual_seed(2)
    x = _leaf(5, 77, device=device, dtype=low, scale=3.0)
    with torch.autocast(device, dtype=low):
        out = getattr(gp, kind)(x, dim=-1)
        stock = getattr(torch, kind)(x, dim=-1)
    assert out.dtype == stock.dtype == (torch.float32 if device == "cuda" else low)
    _close(out, getattr(torch, kind)(x.detach().double(), dim=-1), out.dtype, kind)
    _grads_back_in_own_dtype(out, (x,))


@pytest.mark.parametrize("device", DEVICES)
def test_norms_autocast(device):
    """layer_norm as F.layer_norm under autocast (float32 on CUDA, as given on the CPU);
    rms_norm as F.rms_norm (no rule: as given on both)."""
    low = LOW[device]
    torch.manual_seed(3)
    x = _leaf(6, 96, device=device, dtype=low)
    w, b = _leaf(96, device=device, dtype=low), _leaf(96, device=device, dtype=low)
    with torch.autocast(device, dtype=low):
        y = gp.layer_norm(x, w, b)
        stock = F.layer_norm(x, (96,), w, b)
        r = gp.rms_norm(x, w)
        stock_r = F.rms_norm(x, (96,), w)
    assert y.dtype == stock.dtype and r.dtype == stock_r.dtype == low
    xd, wd, bd = (t.detach().double() for t in (x, w, b))
    _close(y, F.layer_norm(xd, (96,), wd, bd), y.dtype, "layer_norm")
    _close(r, F.rms_norm(xd, (96,), wd), low, "rms_norm")
    _grads_back_in_own_dtype(y, (x, w, b))
    _grads_back_in_own_dtype(r, (x, w))


def _ln_linear_ref(x, lw, lb, W, b, low, rms=False):
    """Stock under autocast: the norm on x as it is (float32), then F.linear in `low`."""
    xd = x.detach().double()
    xn = F.rms_norm(xd, (xd.shape[-1],), lw.detach().double()) if rms else \
        F.layer_norm(xd, (xd.shape[-1],), lw.detach().double(), lb.detach().double())
    xn = xn.to(low).double()
    return F.linear(xn, W.detach().to(low).double(), None if b is None else b.detach().to(low).double())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("w_view", [False, True], ids=["W", "W.t()"])
def test_fused_norm_linear_autocast(device, rms, w_view):
    """A float32 x and float32 parameters: the norm in float32, the linear and the output in the
    autocast dtype, as LayerNorm/RMSNorm followed by nn.Linear under autocast; the gradients in
    float32. W as GPT-2's Conv1D hands it over (a transposed view) too."""
    low = LOW[device]
    torch.manual_seed(4)
    M, H, N = 37, 64, 48
    x = _leaf(M, H, device=device, scale=2.0)
    x = (x.detach() + 3.0).requires_grad_()  # a mean far from 0: the norm must see float32 x
    lw, lb = _leaf(H, device=device), _leaf(H, device=device)
    W = _leaf(H, N, device=device).detach().t().requires_grad_() if w_view else _leaf(N, H, device=device)
    b = _leaf(N, device=device)
    with torch.autocast(device, dtype=low):
        y = gp.fused_rmsnorm_linear(x, lw, W, b) if rms else gp.fused_layernorm_linear(x, lw, lb, W, b)
    _close(y, _ln_linear_ref(x, lw, lb, W, b, low, rms), low, "fused norm+linear")
    inputs = (x, lw, W, b) if rms else (x, lw, lb, W, b)
    got = _grads_back_in_own_dtype(y, inputs)
    # Against stock's own modules under autocast, in float32: the gradients agree to `low`'s noise.
    ref_in = [t.detach().clone().requires_grad_() for t in inputs]
    with torch.autocast(device, dtype=low):
        if rms:
            ys = F.linear(F.rms_norm(ref_in[0], (H,), ref_in[1]), ref_in[2], ref_in[3])
        else:
            ys = F.linear(F.layer_norm(ref_in[0], (H,), ref_in[1], ref_in[2]), ref_in[3], ref_in[4])
    want = torch.autograd.grad(ys.float().sum(), ref_in)
    for name, a, r in zip(("x", "norm weight", "norm bias", "W", "b") if not rms else ("x", "norm weight", "W", "b"),
                          got, want):
        rel = ((a - r).norm() / r.norm()).item()
        assert rel < 4 * TOL[low], f"d{name}: relative error {rel:.3e}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_fused_norm_linear_mixed_dtypes(device, rms):
    """Called directly: x and the norm in float32, linear_weight and bias in a half dtype (the mix
    autocast hands over); the output in the half dtype. Other mixes are refused by name."""
    low = LOW[device]
    torch.manual_seed(5)
    x, lw, lb = _leaf(3, 5, 64, device=device), _leaf(64, device=device), _leaf(64, device=device)
    W, b = _leaf(40, 64, device=device, dtype=low), _leaf(40, device=device, dtype=low)
    y = gp.fused_rmsnorm_linear(x, lw, W, b) if rms else gp.fused_layernorm_linear(x, lw, lb, W, b)
    _close(y, _ln_linear_ref(x, lw, lb, W, b, low, rms), low, "mixed")
    _grads_back_in_own_dtype(y, (x, lw, W, b) if rms else (x, lw, lb, W, b))
    with pytest.raises(RuntimeError, match="linear_weight has dtype"):
        gp.fused_layernorm_linear(x.detach().to(low), lw.detach().to(low), lb.detach().to(low), W.detach().float())
    with pytest.raises(RuntimeError, match="linear_bias has dtype"):
        gp.fused_layernorm_linear(x.detach(), lw.detach(), lb.detach(), W.detach(), b.detach().float())
    with pytest.raises(RuntimeError, match="grad_out has dtype"):
        _, mean, rstd = torch.ops.gpu_puzzles.fused_layernorm_linear(x.detach(), lw.detach(), lb.detach(), W.detach())
        torch.ops.gpu_puzzles.fused_layernorm_linear_backward(torch.ones(3, 5, 40, device=device), x.detach(),
                                                              lw.detach(), lb.detach(), W.detach(), mean, rstd)


@requires_cuda
@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("M,H", [(37, 256), (29, 768), (21, 3072), (9, 8200), (13, 66)])
def test_cuda_mixed_norm_kernels_exact(low, rms, M, H):
    """On CUDA the mixed fused op writes the half GEMM operand xn straight from float32 x, and its
    backward reads the half dxn and writes the half xn (no float32 copies): the same numbers,
    bit for bit, as our float32 norm followed by casts. Shapes walk every kernel of the plan
    (forward warp / block / loop rows, backward narrow / wide / loop, the scalar path at H = 66);
    poisoned allocations catch unwritten elements."""
    torch.manual_seed(M + H)
    N = 48
    x = (torch.randn(M, H, device="cuda", dtype=torch.float64) * 2 + 1.5).float()
    lw, lb = torch.randn(H, device="cuda") * 0.5 + 1, torch.randn(H, device="cuda")
    W, b = torch.randn(N, H, device="cuda").to(low), torch.randn(N, device="cuda").to(low)
    dy = torch.randn(M, N, device="cuda").to(low)
    ops = torch.ops.gpu_puzzles
    poison_allocator(64 << 20)
    if rms:
        y, rstd = ops.fused_rmsnorm_linear(x, lw, W, b, 1e-5)
        xn32, rstd_ref = ops.rms_norm(x, lw, 1e-5)
        mean = None
    else:
        y, mean, rstd = ops.fused_layernorm_linear(x, lw, lb, W, b, 1e-5)
        xn32, mean_ref, rstd_ref = ops.layer_norm(x, lw, lb, 1e-5)
        assert torch.equal(mean, mean_ref)
    assert torch.equal(rstd, rstd_ref)
    xn = xn32.to(low)
    assert y.dtype == low and torch.equal(y, torch.addmm(b, xn, W.t()))
    poison_allocator(64 << 20)
    if rms:
        dx, dlw, dW, db = ops.fused_rmsnorm_linear_backward(dy, x, lw, W, rstd, True)
        dx_ref, dlw_ref = ops.rms_norm_backward((dy @ W).float(), x, lw, rstd)
    else:
        dx, dlw, dlb, dW, db = ops.fused_layernorm_linear_backward(dy, x, lw, lb, W, mean, rstd)
        dx_ref, dlw_ref, dlb_ref = ops.layer_norm_backward((dy @ W).float(), x, lw, mean, rstd)
        assert torch.equal(dlb, dlb_ref)
    assert dx.dtype == torch.float32 and dW.dtype == low
    assert torch.equal(dx, dx_ref) and torch.equal(dlw, dlw_ref)
    assert torch.equal(dW, dy.t() @ xn)
    torch.testing.assert_close(db.float(), dy.float().sum(0), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_norm_linear_mixed_opcheck(device):
    """The mixed op's schema, fake kernel (output in W's dtype) and autograd registration."""
    low = LOW[device]
    x, lw, lb = (torch.randn(4, 32, device=device), torch.randn(32, device=device), torch.randn(32, device=device))
    W, b = torch.randn(16, 32, device=device, dtype=low), torch.randn(16, device=device, dtype=low)
    for args, op in (((x, lw, lb, W, b), torch.ops.gpu_puzzles.fused_layernorm_linear),
                     ((x, lw, W, b), torch.ops.gpu_puzzles.fused_rmsnorm_linear)):
        torch.library.opcheck(op, args)
        torch.library.opcheck(op, tuple(t.clone().requires_grad_() for t in args))


@pytest.mark.parametrize("device", DEVICES)
def test_cross_entropy_autocast(device):
    """As F.cross_entropy under autocast: a float32 loss, from half logits read as they are;
    the gradient in the logits' dtype."""
    low = LOW[device]
    torch.manual_seed(6)
    logits = _leaf(64, 211, device=device, dtype=low, scale=4.0)
    target = torch.randint(0, 211, (64,), device=device)
    target[::7] = -100
    for reduction in ("mean", "sum", "none"):
        with torch.autocast(device, dtype=low):
            loss = gp.cross_entropy(logits, target, reduction=reduction)
            stock = F.cross_entropy(logits, target, reduction=reduction)
        assert loss.dtype == stock.dtype == torch.float32
        ref = F.cross_entropy(logits.detach().double(), target, reduction=reduction)
        _close(loss, ref, torch.float32, f"loss ({reduction})")
        (g,) = torch.autograd.grad(loss.sum(), logits)
        (gs,) = torch.autograd.grad(stock.sum(), logits)
        assert g.dtype == low
        _close(g, gs.double(), low, f"grad ({reduction})")
    # Class weights and label smoothing (ATen ops on the op's per-row losses): the same dtype rule.
    w = torch.rand(211, device=device) + 0.1
    with torch.autocast(device, dtype=low):
        loss = gp.cross_entropy(logits, target, w, label_smoothing=0.1)
        stock = F.cross_entropy(logits, target, w, label_smoothing=0.1)
    assert loss.dtype == stock.dtype == torch.float32
    ref = F.cross_entropy(logits.detach().double(), target, w.double(), label_smoothing=0.1)
    _close(loss, ref, torch.float32, "loss (weight, label_smoothing)")
    # Outside autocast the loss keeps the logits' dtype (F's), or loss_dtype.
    assert gp.cross_entropy(logits, target).dtype == low
    assert gp.cross_entropy(logits, target, loss_dtype=torch.float32).dtype == torch.float32


@pytest.mark.parametrize("device", DEVICES)
def test_cross_entropy_large_loss_scale(device):
    """fp16 with GradScaler: a float32 loss scaled by 65536 (GradScaler's first scale, inf in
    float16) gives finite gradients, as stock's; so does the fused op."""
    torch.manual_seed(7)
    logits = _leaf(32, 50, device=device, dtype=torch.float16)
    target = torch.randint(0, 50, (32,), device=device)
    with torch.autocast(device, dtype=torch.float16):
        loss = gp.cross_entropy(logits, target)
    assert loss.dtype == torch.float32
    (g,) = torch.autograd.grad(loss * 65536.0, logits)
    ref = torch.autograd.grad(F.cross_entropy(logits.float(), target) * 65536.0, logits)[0]
    _close(g, ref.double(), torch.float16, "scaled grad")
    h = _leaf(32, 16, device=device)
    w = _leaf(50, 16, device=device)
    with torch.autocast(device, dtype=torch.float16):
        fl = gp.fused_linear_cross_entropy(h, w, target)
    assert fl.dtype == torch.float32
    gh, gw = torch.autograd.grad(fl * 65536.0, (h, w))
    assert gh.dtype == gw.dtype == torch.float32 and torch.isfinite(gh).all() and torch.isfinite(gw).all()


@pytest.mark.parametrize("device", DEVICES)
def test_fused_linear_cross_entropy_autocast(device):
    """As F.linear then F.cross_entropy under autocast: the GEMMs in the autocast dtype, a float32
    loss, float32 gradients for float32 inputs."""
    low = LOW[device]
    torch.manual_seed(8)
    h, w, b = _leaf(48, 32, device=device), _leaf(97, 32, device=device), _leaf(97, device=device)
    target = torch.randint(0, 97, (48,), device=device)
    with torch.autocast(device, dtype=low):
        loss = gp.fused_linear_cross_entropy(h, w, target, b)
    assert loss.dtype == torch.float32
    ref = F.cross_entropy(F.linear(*(t.detach().to(low).double() for t in (h, w, b))), target)
    _close(loss, ref, torch.float32, "loss", tol=low)
    got = _grads_back_in_own_dtype(loss, (h, w, b))
    ref_in = [t.detach().clone().requires_grad_() for t in (h, w, b)]
    with torch.autocast(device, dtype=low):
        stock = F.cross_entropy(F.linear(*ref_in), target)
    for a, r in zip(got, torch.autograd.grad(stock, ref_in)):
        assert ((a - r).norm() / r.norm()).item() < 4 * TOL[low]


@pytest.mark.parametrize("device", DEVICES)
def test_embedding_autocast_runs_as_given(device):
    """F.embedding has no autocast rule: the table's dtype comes back."""
    w = _leaf(50, 16, device=device)
    idx = torch.randint(0, 50, (3, 7), device=device)
    with torch.autocast(device, dtype=LOW[device]):
        out = gp.embedding(idx, w)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, w.detach()[idx])


def _amp_block(x, lw, lb, W, b, qk_extra, target, head):
    """A small block as a model calls our ops: fused LN+linear -> attention -> fused linear CE."""
    B, S, H = x.shape
    qkv = gp.fused_layernorm_linear(x, lw, lb, W, b)
    q, k, v = qkv.view(B, S, 3, 2, H // 2).permute(2, 0, 3, 1, 4)
    q = q.float() * qk_extra  # as a rotary embedding leaves q in float32
    att = gp.attention(q, k, v, causal=True).transpose(1, 2).reshape(B, S, H)
    return gp.fused_linear_cross_entropy(att, head, target)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_under_autocast_matches_eager(device):
    """torch.compile(fullgraph=True) of a block under autocast: our autocast kernels traced, no
    graph break, eager's loss and gradients."""
    low = LOW[device]
    torch.manual_seed(9)
    B, S, H = 2, 16, 32
    x = _leaf(B, S, H, device=device)
    params = [_leaf(H, device=device), _leaf(H, device=device), _leaf(3 * H, H, device=device),
              _leaf(3 * H, device=device), torch.rand(S, H // 2, device=device) + 0.5, _leaf(40, H, device=device)]
    target = torch.randint(0, 40, (B * S,), device=device)

    def f(x, lw, lb, W, b, rot, head):
        with torch.autocast(device, dtype=low):
            return _amp_block(x, lw, lb, W, b, rot, target.view(B, S), head)

    torch._dynamo.reset()
    inputs = [x] + params
    want = f(*inputs)
    gw = torch.autograd.grad(want, [t for t in inputs if t.requires_grad])
    got = torch.compile(f, fullgraph=True)(*inputs)
    gg = torch.autograd.grad(got, [t for t in inputs if t.requires_grad])
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    for a, r in zip(gg, gw):
        assert a.dtype == r.dtype
        torch.testing.assert_close(a, r, rtol=5e-2, atol=5e-2)
