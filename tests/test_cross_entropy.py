"""cross_entropy and fused_linear_cross_entropy: float64 references (F.cross_entropy, F.linear) on
random logits with ignored targets, every reduction, odd and large vocabularies, strided logits read
without a copy, all-ignored batches, several fused chunks (knob), gradcheck, opcheck, compile, bad input."""
import pytest
import torch
import torch.nn.functional as F
from conftest import (
    DEVICES,
    assert_backward_fills_as_op,
    assert_close_ref,
    copy_kernels,
    device_dtypes,
    fill_ops,
    many,
    poison_allocator,
    requires_caching_allocator,
    requires_cuda,
)
from hypothesis import given
from hypothesis import strategies as st
from strategies import close_to_eager, dtypes, extents, index_dtypes, layouts, make_indices, make_tensor, seeds, shapes

import gpu_puzzles as gp
from gpu_puzzles import tuning

OP = torch.ops.gpu_puzzles.cross_entropy.default
BWD_OP = torch.ops.gpu_puzzles.cross_entropy_backward.default
FUSED_OP = torch.ops.gpu_puzzles.fused_linear_cross_entropy.default
REDUCTIONS = ["mean", "sum", "none"]


def _targets(shape, V, device, dtype=torch.int64, ignore=-100, frac=0.2, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, V, shape, generator=g)
    t[torch.rand(shape, generator=g) < frac] = ignore
    return t.to(device=device, dtype=dtype)


def _logits(shape, device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 3).to(device=device, dtype=dtype)


def _cap(x, softcap):
    return x if softcap is None else softcap * torch.tanh(x / softcap)


def _ref(logits, target, reduction, ignore=-100, softcap=None):
    """F.cross_entropy in float64 with the classes last (of the soft-capped logits)."""
    x = _cap(logits.double().reshape(-1, logits.shape[-1]), softcap)
    out = F.cross_entropy(x, target.reshape(-1).long(), ignore_index=ignore, reduction=reduction)
    return out.reshape(target.shape) if reduction == "none" else out


def _vocabs(device):
    return [1, 7, 4099, 50257] + ([128256] if device == "cuda" else [])


def _case_list():
    cases = []
    for device, dtype in device_dtypes():
        for V in _vocabs(device):
            cases.append((device, dtype, V))
    return cases


@pytest.mark.parametrize("device,dtype,V", _case_list())
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_forward_backward_match_reference(device, dtype, V, reduction):
    rows = 5 if V > 10000 else 33
    logits = _logits((rows, V), device, dtype, seed=V)
    target = _targets((rows,), V, device, seed=V + 1)
    target[0] = V - 1  # the last class, past any vector body
    if device == "cuda":
        poison_allocator(64 << 20)
    x = logits.clone().requires_grad_()
    loss = gp.cross_entropy(x, target, reduction=reduction)
    assert loss.dtype == dtype and loss.shape == ((rows,) if reduction == "none" else ())
    xr = logits.detach().double().requires_grad_()
    ref = _ref(xr, target, reduction)
    assert_close_ref(loss, ref.detach(), dtype, "loss")
    g = (_logits(loss.shape, device, dtype, seed=3) if reduction == "none"
         else torch.tensor(1.7, device=device, dtype=dtype))
    (gx,) = torch.autograd.grad(loss, x, g)
    (gr,) = torch.autograd.grad(ref, xr, g.double())
    assert gx.dtype == dtype and gx.shape == logits.shape
    # Gradients are ~1/count for the mean: compare on the scale of one row's gradient.
    scale = 1.0 / max(1, int((target != -100).sum())) if reduction == "mean" else 1.0
    assert_close_ref(gx.double() / scale, gr / scale, dtype, "grad")
    assert (gx[target == -100] == 0).all()


@pytest.mark.parametrize("device,dtype", device_dtypes())
def test_lse_and_int32_targets(device, dtype):
    logits = _logits((4, 6, 301), device, dtype, seed=5)
    target = _targets((4, 6), 301, device, dtype=torch.int32, seed=6)
    loss, lse = OP(logits, target, -100, "none")
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32) and lse.shape == (4, 6)
    keep = target != -100
    ref_lse = torch.logsumexp(logits.double(), -1)
    assert_close_ref(lse[keep], ref_lse[keep], torch.float32 if dtype != torch.float64 else dtype, "lse")
    assert_close_ref(loss, _ref(logits, target, "none"), dtype, "loss")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ignore_index", [-100, 3])
def test_ignore_index(device, ignore_index):
    logits = _logits((50, 11), device, torch.float64, seed=9)
    target = _targets((50,), 11, device, ignore=ignore_index, frac=0.3, seed=10)
    for reduction in REDUCTIONS:
        out = gp.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)
        torch.testing.assert_close(out, _ref(logits, target, reduction, ignore_index))


@pytest.mark.parametrize("device,dtype", device_dtypes())
def test_all_ignored(device, dtype):
    logits = _logits((6, 37), device, dtype, seed=11).requires_grad_()
    target = torch.full((6,), -100, device=device)
    mean = gp.cross_entropy(logits, target)
    assert torch.isnan(mean)  # 0 / 0, as F.cross_entropy
    assert gp.cross_entropy(logits, target, reduction="sum").item() == 0
    assert (gp.cross_entropy(logits, target, reduction="none") == 0).all()
    (g,) = torch.autograd.grad(gp.cross_entropy(logits, target, reduction="sum"), logits)
    assert (g == 0).all()


@pytest.mark.parametrize("device,dtype", device_dtypes())
@pytest.mark.parametrize("V", [7, 50257])
def test_strided_logits(device, dtype, V):
    # A causal LM's shift: logits[:, :-1] against labels[:, 1:]; rows of odd V sit at every alignment.
    B, S = 3, 5
    full = _logits((B, S, V), device, dtype, seed=12).requires_grad_()
    labels = _targets((B, S), V, device, seed=13)
    x, t = full[:, :-1], labels[:, 1:]
    # F's layout, (B, V, S - 1), as a view: the op reads the (B, S - 1, V) rows in place.
    for reduction in REDUCTIONS:
        loss = gp.cross_entropy(x.transpose(1, 2), t, reduction=reduction)
        assert_close_ref(loss, _ref(x.detach(), t, reduction), dtype, reduction)
    loss = gp.cross_entropy(x.transpose(1, 2), t, reduction="sum")
    (g,) = torch.autograd.grad(loss, full)
    xr = full.detach().double().requires_grad_()
    (gr,) = torch.autograd.grad(_ref(xr[:, :-1], t, "sum"), xr)
    assert_close_ref(g, gr, dtype, "grad")


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_strided_logits_no_copy(dtype, reduction):
    # ("none" casts its per-row float32 losses to bf16: a copy kernel of rows elements, not of the logits.)
    B, S, V = 2, 9, 50257
    full = _logits((B, S, V), "cuda", dtype, seed=14)
    labels = _targets((B, S), V, "cuda", seed=15)
    x, t = full[:, :-1], labels[:, 1:]
    (loss, lse), copies = copy_kernels(OP, x, t, -100, reduction)
    assert not copies, copies
    g = torch.tensor(1.0, device="cuda", dtype=dtype)
    gx, copies = copy_kernels(BWD_OP, g, x, t, lse, -100, reduction)
    assert not copies, copies
    assert_close_ref(loss, _ref(x, t, reduction), dtype, "loss")
    xr = x.detach().double().requires_grad_()
    (gr,) = torch.autograd.grad(_ref(xr, t, reduction), xr)
    n = (t != -100).sum().item() if reduction == "mean" else 1
    assert_close_ref(gx.double() * n, gr * n, dtype, "grad")


@pytest.mark.parametrize("device,dtype", device_dtypes())
@pytest.mark.parametrize("V,Vp", [(13, 16), (50257, 50264)])
def test_padded_rows_gradient_layout(device, dtype, V, Vp):
    # Inductor pads an odd-V GEMM output's rows ((N, Vp)[:, :V]): the gradient keeps that
    # layout (no copy on either side under torch.compile); unevenly spaced rows get a contiguous one.
    B, S = 2, 3
    full = _logits((B, S, Vp), device, dtype, seed=40)
    labels = _targets((B, S), V, device, seed=41)
    cases = {"(N, V) of (N, Vp)": (full.view(B * S, Vp)[:, :V], labels.reshape(-1), (Vp, 1)),
             "(B, S, V) of (B, S, Vp)": (full[..., :V], labels, (S * Vp, Vp, 1)),
             "shifted (B, S-1, V)": (full[:, :-1, :V], labels[:, 1:], None)}
    for name, (x, t, want) in cases.items():
        _, lse = OP(x, t, -100, "mean")
        g = BWD_OP(torch.tensor(1.0, device=device, dtype=dtype), x, t, lse, -100, "mean")
        assert g.stride() == (want or g.contiguous().stride()), (name, g.stride())
        xr = x.detach().double().requires_grad_()
        (gr,) = torch.autograd.grad(_ref(xr, t, "mean"), xr)
        n = (t != -100).sum().item()
        assert_close_ref(g.double() * n, gr * n, dtype, f"{name} grad")
        torch.library.opcheck(BWD_OP, (torch.tensor(0.5, device=device, dtype=dtype), x, t, lse, -100, "mean"))
        if device == "cuda":
            _, copies = copy_kernels(BWD_OP, torch.tensor(1.0, device=device, dtype=dtype), x, t, lse, -100, "mean")
            assert not copies, (name, copies)


@requires_cuda
def test_out_of_range_target_cuda():
    # No error (that would need a host sync); the row's loss is NaN and nothing is read outside the row.
    logits = _logits((4, 100), "cuda", torch.float32, seed=16).requires_grad_()
    target = torch.tensor([1, 100, -5, -100], device="cuda")
    loss = gp.cross_entropy(logits, target, reduction="none")
    assert torch.isfinite(loss[0]) and torch.isnan(loss[1]) and torch.isnan(loss[2]) and loss[3] == 0
    (g,) = torch.autograd.grad(loss[0] + loss[3], logits)
    assert torch.isfinite(g).all()


@requires_cuda
def test_deterministic():
    logits = _logits((512, 50257), "cuda", torch.bfloat16, seed=17)
    target = _targets((512,), 50257, "cuda", seed=18)
    a = gp.cross_entropy(logits, target)
    b = gp.cross_entropy(logits, target)
    assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_gradcheck(device, reduction):
    logits = _logits((2, 3, 5), device, torch.float64, seed=19).requires_grad_()
    target = torch.tensor([[0, 4, -100], [2, 2, 1]], device=device)
    assert torch.autograd.gradcheck(lambda x: gp.cross_entropy(x.transpose(1, 2), target, reduction=reduction),
                                    (logits,))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck(device, requires_grad):
    logits = _logits((3, 4, 9), device, torch.float32, seed=20).requires_grad_(requires_grad)
    target = _targets((3, 4), 9, device, seed=21)
    for reduction in REDUCTIONS:
        torch.library.opcheck(OP, (logits, target, -100, reduction))
    _, lse = OP(logits.detach(), target, -100, "mean")
    torch.library.opcheck(BWD_OP, (torch.tensor(0.5, device=device), logits.detach(), target, lse, -100, "mean"))
    torch.library.opcheck(BWD_OP, (torch.randn(3, 4, device=device), logits.detach(), target, lse, -100, "none"))
    h = _logits((7, 6), device, torch.float32, seed=22).requires_grad_(requires_grad)
    w = _logits((9, 6), device, torch.float32, seed=23).requires_grad_(requires_grad)
    b = _logits((9,), device, torch.float32, seed=24).requires_grad_(requires_grad)
    t = _targets((7,), 9, device, seed=25)
    torch.library.opcheck(FUSED_OP, (h, w, t, b, -100, "mean"))
    torch.library.opcheck(FUSED_OP, (h, w, t, None, -100, "sum"))
    torch.library.opcheck(FUSED_OP, (h.detach(), w.detach(), t, b.detach(), -100, "mean", [True, True, True]))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph(device):
    torch._dynamo.reset()

    def f(x, t, h, w, b, t2):
        return gp.cross_entropy(x[:, :-1].transpose(1, 2), t[:, 1:]) + gp.fused_linear_cross_entropy(h, w, t2, b)

    x = _logits((2, 6, 13), device, torch.float32, seed=26).requires_grad_()
    t = _targets((2, 6), 13, device, seed=27)
    h = _logits((2, 5, 8), device, torch.float32, seed=28).requires_grad_()
    w = _logits((13, 8), device, torch.float32, seed=29).requires_grad_()
    b = _logits((13,), device, torch.float32, seed=30).requires_grad_()
    t2 = _targets((2, 5), 13, device, seed=31)
    cf = torch.compile(f, fullgraph=True)
    out = cf(x, t, h, w, b, t2)
    grads = torch.autograd.grad(out, (x, h, w, b))
    ref = f(x, t, h, w, b, t2)
    rgrads = torch.autograd.grad(ref, (x, h, w, b))
    torch.testing.assert_close(out, ref)
    for a, r in zip(grads, rgrads):
        torch.testing.assert_close(a, r)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_weight_and_smoothing(device):
    # The class-weight / label-smoothing path (ATen ops around the op) traces without a break.
    torch._dynamo.reset()
    x = _logits((3, 13, 4), device, torch.float64, seed=32).requires_grad_()
    t = _targets((3, 4), 13, device, seed=33)
    w = torch.rand(13, device=device, dtype=torch.float64) + 0.1

    def f(x, t, w):
        return gp.cross_entropy(x, t, w, label_smoothing=0.1)

    out = torch.compile(f, fullgraph=True, backend="aot_eager")(x, t, w)
    ref = F.cross_entropy(x, t, w, label_smoothing=0.1)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(torch.autograd.grad(out, x)[0], torch.autograd.grad(ref, x)[0])


def _backward_graphs(f, *args):
    """Compiles ``f`` (fullgraph, aot_eager) and runs it and its backward on ``args``; returns
    (outputs, input grads, the backward graphs' call targets as strings)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    targets = []

    def bw(gm, _):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    fw = lambda gm, _: make_boxed_func(gm.forward)  # noqa: E731
    cf = torch.compile(f, fullgraph=True, backend=aot_autograd(fw_compiler=fw, bw_compiler=bw))
    out = cf(*args)
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    total = out[0] + out[1].float().square().sum() if isinstance(out, tuple) else out
    return out, torch.autograd.grad(total, leaves), targets


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("knob", ["inductor", "kernel"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_compiled_backward_choice(device, knob, reduction):
    # Under torch.compile the backward is ATen math (knob "inductor", the default) or our
    # backward op ("kernel"); both give eager's gradients, ignored and all-ignored rows included.
    x = _logits((3, 5, 11), device, torch.float32, seed=60).requires_grad_()
    for t in (_targets((3, 5), 11, device, seed=61, frac=0.3), torch.full((3, 5), -100, device=device)):

        def f(x, t):
            loss = gp.cross_entropy(x.transpose(1, 2), t, reduction=reduction)
            return loss.sum() if reduction == "none" else loss

        with tuning.override(cross_entropy_compiled_backward=knob):
            out, (g,), targets = _backward_graphs(f, x, t)
        ref = f(x, t)
        (rg,) = torch.autograd.grad(ref, x)
        torch.testing.assert_close(out, ref, equal_nan=True)
        torch.testing.assert_close(g, rg)
        ours = [n for n in targets if "gpu_puzzles" in n]
        assert ours == ([] if knob == "inductor" else ["gpu_puzzles.cross_entropy_backward.default"]), targets


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_backward_with_returned_logits(device):
    # A causal LM returns its logits beside the loss, so their gradient is the loss's plus the
    # logits' own (zeros when unused): with the ATen backward both are in one graph of ATen
    # ops, where inductor can fuse the addition into the gradient's pass; values as eager.
    h = _logits((2, 7, 6), device, torch.float32, seed=62).requires_grad_()
    w = _logits((13, 6), device, torch.float32, seed=63).requires_grad_()
    t = _targets((2, 7), 13, device, seed=64)

    def f(h, w, t):
        logits = h @ w.t()
        return gp.cross_entropy(logits[:, :-1].transpose(1, 2), t[:, 1:]), logits

    (loss, logits), grads, targets = _backward_graphs(f, h, w, t)
    rl, rlogits = f(h, w, t)
    rgrads = torch.autograd.grad(rl + rlogits.float().square().sum(), (h, w))
    torch.testing.assert_close(loss, rl)
    for a, b in zip(grads, rgrads):
        torch.testing.assert_close(a, b)
    assert not [n for n in targets if "gpu_puzzles" in n], targets


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_backward_inductor_matches_reference(device):
    # The real compiler (inductor), bf16 logits as a model hands them, vs float64.
    x = _logits((4, 9, 37), device, torch.bfloat16 if device == "cuda" else torch.float32, seed=65)
    x = x.requires_grad_()
    t = _targets((4, 9), 37, device, seed=66)
    torch._dynamo.reset()
    cf = torch.compile(lambda x, t: gp.cross_entropy(x.transpose(1, 2), t), fullgraph=True)
    (g,) = torch.autograd.grad(cf(x, t), x)
    xr = x.detach().double().requires_grad_()
    (gr,) = torch.autograd.grad(_ref(xr, t, "mean"), xr)
    n = (t != -100).sum().item()
    assert g.dtype == x.dtype and g.shape == x.shape
    assert_close_ref(g.double() * n, gr * n, x.dtype, "grad")


# ---- soft-capped logits (softcap=c: the loss of c * tanh(x / c)) ---------------------

@pytest.mark.parametrize("device,dtype", device_dtypes())
@pytest.mark.parametrize("V,cap", [(7, 2.0), (4099, 2.0), (50257, 30.0)])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_softcap_matches_reference(device, dtype, V, cap, reduction):
    # Logits ~3 sigma: a cap of 2 saturates many, so a cap left out (or applied twice) shows.
    rows = 5 if V > 10000 else 33
    logits = _logits((rows, V), device, dtype, seed=V + 70)
    if V == 50257:
        logits = logits * 20  # past the cap of 30
    target = _targets((rows,), V, device, seed=V + 71)
    target[0] = V - 1
    if device == "cuda":
        poison_allocator(64 << 20)
    x = logits.clone().requires_grad_()
    loss = gp.cross_entropy(x, target, reduction=reduction, softcap=cap)
    xr = logits.detach().double().requires_grad_()
    ref = _ref(xr, target, reduction, softcap=cap)
    assert_close_ref(loss, ref.detach(), dtype, "loss")
    g = (_logits(loss.shape, device, dtype, seed=3) if reduction == "none"
         else torch.tensor(1.7, device=device, dtype=dtype))
    (gx,) = torch.autograd.grad(loss, x, g)
    (gr,) = torch.autograd.grad(ref, xr, g.double())
    scale = 1.0 / max(1, int((target != -100).sum())) if reduction == "mean" else 1.0
    assert_close_ref(gx.double() / scale, gr / scale, dtype, "grad")
    assert (gx[target == -100] == 0).all()
    _, lse = OP(logits, target, -100, "none", None, cap)
    keep = target != -100
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert_close_ref(lse[keep], torch.logsumexp(_cap(logits.double(), cap), -1)[keep], acc, "lse")


@pytest.mark.parametrize("device", DEVICES)
def test_softcap_gradcheck_and_weighted(device):
    logits = (_logits((2, 3, 5), device, torch.float64, seed=72) * 2).requires_grad_()
    target = torch.tensor([[0, 4, -100], [2, 2, 1]], device=device)
    f = lambda x: gp.cross_entropy(x.transpose(1, 2), target, softcap=1.5)  # noqa: E731
    assert torch.autograd.gradcheck(f, (logits,))
    # The backward differentiated again (create_graph=True) runs as ATen math through the cap.
    assert torch.autograd.gradgradcheck(f, (logits,))
    # Class weights and label smoothing weigh the capped logits' losses.
    w = torch.rand(5, device=device, dtype=torch.float64) + 0.5
    out = gp.cross_entropy(logits.transpose(1, 2), target, w, label_smoothing=0.2, softcap=1.5)
    ref = F.cross_entropy(_cap(logits, 1.5).transpose(1, 2), target, w, label_smoothing=0.2)
    torch.testing.assert_close(out, ref)
    assert torch.autograd.gradcheck(
        lambda x: gp.cross_entropy(x.transpose(1, 2), target, w, label_smoothing=0.2, softcap=1.5), (logits,))
    h = _logits((5, 4), device, torch.float64, seed=73).requires_grad_()
    wt = _logits((6, 4), device, torch.float64, seed=74).requires_grad_()
    t = torch.tensor([0, 5, -100, 2, 2], device=device)
    with tuning.override(cross_entropy_chunk="2"):
        assert torch.autograd.gradcheck(lambda h, w: gp.fused_linear_cross_entropy(h, w, t, softcap=2.0), (h, wt))


@pytest.mark.parametrize("device", DEVICES)
def test_softcap_opcheck_and_compile(device):
    logits = _logits((3, 4, 9), device, torch.float32, seed=75).requires_grad_()
    target = _targets((3, 4), 9, device, seed=76)
    for reduction in REDUCTIONS:
        torch.library.opcheck(OP, (logits, target, -100, reduction, None, 2.0))
    _, lse = OP(logits.detach(), target, -100, "mean", None, 2.0)
    torch.library.opcheck(BWD_OP, (torch.tensor(0.5, device=device), logits.detach(), target, lse, -100, "mean", 2.0))
    h = _logits((7, 6), device, torch.float32, seed=77).requires_grad_()
    w = _logits((9, 6), device, torch.float32, seed=78).requires_grad_()
    t = _targets((7,), 9, device, seed=79)
    torch.library.opcheck(FUSED_OP, (h, w, t, None, -100, "mean", [False, False, False], None, 2.0))
    # Compiled, with either backward (inductor's ATen math or our kernel), as eager.
    for knob in ("inductor", "kernel"):
        torch._dynamo.reset()

        def f(x, t, h, w, t2):
            return (gp.cross_entropy(x.transpose(1, 2), t, softcap=2.0)
                    + gp.fused_linear_cross_entropy(h, w, t2, softcap=2.0))

        with tuning.override(cross_entropy_compiled_backward=knob):
            out = torch.compile(f, fullgraph=True)(logits, target, h, w, t)
            grads = torch.autograd.grad(out, (logits, h, w))
        ref = f(logits, target, h, w, t)
        torch.testing.assert_close(out, ref)
        for a, r in zip(grads, torch.autograd.grad(ref, (logits, h, w))):
            torch.testing.assert_close(a, r)


@pytest.mark.parametrize("device,dtype", device_dtypes())
@pytest.mark.parametrize("chunk", [None, "8"])
def test_fused_softcap_matches_reference(device, dtype, chunk):
    N, H, V = 37, 24, 301
    h = _logits((N, H), device, torch.float32, seed=80).to(dtype).requires_grad_()
    w = (_logits((V, H), device, torch.float32, seed=81) * 0.5).to(dtype).requires_grad_()
    b = _logits((V,), device, dtype, seed=82).requires_grad_()
    t = _targets((N,), V, device, seed=83)
    with tuning.override(cross_entropy_chunk=chunk):
        loss = gp.fused_linear_cross_entropy(h, w, t, b, softcap=3.0)
    grads = torch.autograd.grad(loss, (h, w, b))
    ref, rgrads = _fused_ref(h, w, t, b, "mean", softcap=3.0)
    assert_close_ref(loss, ref, dtype, "loss")
    norm = (t != -100).sum().item()
    for name, g, r in zip(("hidden", "weight", "bias"), grads, rgrads):
        assert_close_ref(g.double() * norm, r * norm, dtype, name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cap", [0.0, -1.0, float("inf"), float("nan")])
def test_softcap_bad_value(device, cap):
    x = torch.randn(4, 5, device=device)
    t = torch.tensor([0, 1, 2, 3], device=device)
    with pytest.raises(RuntimeError, match="softcap must be a positive finite number"):
        gp.cross_entropy(x, t, softcap=cap)
    with pytest.raises(RuntimeError, match="softcap must be a positive finite number"):
        gp.fused_linear_cross_entropy(x, torch.randn(7, 5, device=device), t, softcap=cap)


# ---- fused linear cross-entropy ---------------------------------------------------

def _fused_ref(h, w, t, b, reduction, ignore=-100, softcap=None):
    hr, wr = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    br = b.detach().double().requires_grad_() if b is not None else None
    logits = _cap(F.linear(hr, wr, br), softcap)
    loss = F.cross_entropy(logits.reshape(-1, wr.shape[0]), t.reshape(-1).long(), ignore_index=ignore,
                           reduction=reduction)
    inputs = (hr, wr) + ((br,) if br is not None else ())
    return loss.detach(), torch.autograd.grad(loss, inputs)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_auto_chunks_many_rows(device):
    # Past the plan's 4096 rows per chunk: 9001 rows run as 3 equal chunks (3001, 3001, 2999),
    # the weight and bias gradients summed across them; float64, against the unfused math.
    N, H, V = 9001, 16, 11
    h = _logits((N, H), device, torch.float64, seed=36).requires_grad_()
    w = _logits((V, H), device, torch.float64, seed=37).requires_grad_()
    b = _logits((V,), device, torch.float64, seed=38).requires_grad_()
    t = _targets((N,), V, device, seed=39)
    t[::7] = -100
    for reduction in ("mean", "sum"):
        loss = gp.fused_linear_cross_entropy(h, w, t, b, reduction=reduction)
        grads = torch.autograd.grad(loss, (h, w, b))
        ref, rgrads = _fused_ref(h, w, t, b, reduction)
        torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
        for g, r in zip(grads, rgrads):
            torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("device,dtype", device_dtypes())
@pytest.mark.parametrize("chunk", [None, "1", "3", "8", "64"])  # 8: 37 rows end in a partial chunk
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_fused_matches_unfused(device, dtype, chunk, bias, reduction):
    N, H, V = 37, 24, 301
    h = (_logits((N, H), device, torch.float32, seed=32) * 0.3).to(dtype).requires_grad_()
    w = (_logits((V, H), device, torch.float32, seed=33) * 0.3).to(dtype).requires_grad_()
    b = _logits((V,), device, dtype, seed=34).requires_grad_() if bias else None
    t = _targets((N,), V, device, seed=35)
    with tuning.override(cross_entropy_chunk=chunk):
        loss = gp.fused_linear_cross_entropy(h, w, t, b, reduction=reduction)
    assert loss.dtype == dtype and loss.shape == ()
    gout = torch.tensor(0.7, device=device, dtype=dtype)
    inputs = (h, w) + ((b,) if bias else ())
    grads = torch.autograd.grad(loss, inputs, gout)
    ref, rgrads = _fused_ref(h, w, t, b, reduction)
    assert_close_ref(loss, ref, dtype, "loss")
    norm = (t != -100).sum().item() if reduction == "mean" else 1.0
    for name, g, r in zip(("hidden", "weight", "bias"), grads, rgrads):
        assert g.dtype == dtype
        assert_close_ref(g.double() * norm, r * 0.7 * norm, dtype, name)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_shapes_views_and_no_grad(device):
    # (B, S, H) hidden, tied-embedding weight as a transposed view, frozen weight, no_grad.
    B, S, H, V = 2, 7, 16, 53
    h = _logits((B, S, H), device, torch.float64, seed=36).requires_grad_()
    wt = _logits((H, V), device, torch.float64, seed=37)
    w = wt.t()  # (V, H), not contiguous
    t = _targets((B, S), V, device, seed=38)
    with tuning.override(cross_entropy_chunk="5"):
        loss = gp.fused_linear_cross_entropy(h, w, t)
        (gh,) = torch.autograd.grad(loss, h)
        with torch.no_grad():
            loss2 = gp.fused_linear_cross_entropy(h, w, t)
    ref, (rh, _) = _fused_ref(h, w, t, None, "mean")
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(loss2, ref)
    torch.testing.assert_close(gh, rh)
    # Under no_grad no gradient is computed: the op's gradient outputs are empty.
    with torch.no_grad():
        _, g1, g2, g3 = FUSED_OP(h, w, t, None, -100, "mean")
    assert g1.numel() == 0 and g2.numel() == 0 and g3.numel() == 0


@pytest.mark.parametrize("device", DEVICES)
def test_backward_adds_no_fill_for_extra_outputs(device):
    # lse, and the fused op's precomputed gradients (vocabulary x hidden for the weight),
    # carry no gradient: autograd must not fill zeros of their size per call.
    logits = _logits((6, 301), device, torch.float32, seed=7).requires_grad_()
    target = _targets((6,), 301, device, seed=8)
    loss, lse = OP(logits, target, -100, "mean")
    g = torch.tensor(1.3, device=device)
    assert_backward_fills_as_op(
        loss, g, lambda: torch.ops.gpu_puzzles.cross_entropy_backward(g, logits, target, lse, -100, "mean"))
    h = _logits((6, 16), device, torch.float32, seed=9).requires_grad_()
    w = _logits((301, 16), device, torch.float32, seed=10).requires_grad_()
    loss = gp.fused_linear_cross_entropy(h, w, target)
    assert fill_ops(lambda: loss.backward(g)) == 0  # the backward only scales the saved gradients


@pytest.mark.parametrize("device", DEVICES)
def test_fused_gradcheck(device):
    h = _logits((5, 4), device, torch.float64, seed=39).requires_grad_()
    w = _logits((6, 4), device, torch.float64, seed=40).requires_grad_()
    b = _logits((6,), device, torch.float64, seed=41).requires_grad_()
    t = torch.tensor([0, 5, -100, 2, 2], device=device)
    with tuning.override(cross_entropy_chunk="2"):
        assert torch.autograd.gradcheck(lambda h, w, b: gp.fused_linear_cross_entropy(h, w, t, b), (h, w, b))


@requires_cuda
@requires_caching_allocator
def test_fused_peak_memory_below_logits():
    # The stock path stores (N, V) bf16 logits (and their gradient); the fused op only a chunk.
    N, H, V = 4096, 256, 50257
    h = (torch.randn(N, H, device="cuda") * 0.1).bfloat16().requires_grad_()
    w = (torch.randn(V, H, device="cuda") * 0.1).bfloat16().requires_grad_()
    t = torch.randint(0, V, (N,), device="cuda")
    with tuning.override(cross_entropy_chunk="256"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = gp.fused_linear_cross_entropy(h, w, t)
        loss.backward()
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert peak < N * V * 2 / 2, f"peak {peak / 2**20:.0f} MiB vs logits {N * V * 2 / 2**20:.0f} MiB"
    ref, (rh, rw) = _fused_ref(h, w, t, None, "mean")
    assert_close_ref(loss, ref, torch.bfloat16, "loss")
    assert_close_ref(h.grad.double() * N, rh * N, torch.bfloat16, "hidden")
    assert_close_ref(w.grad.double() * N, rw * N, torch.bfloat16, "weight")


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_large_vocab(dtype):
    N, H, V = many(300, 40), 64, 128256
    h = (torch.randn(N, H, device="cuda") * 0.2).to(dtype).requires_grad_()
    w = (torch.randn(V, H, device="cuda") * 0.2).to(dtype).requires_grad_()
    t = _targets((N,), V, "cuda", seed=42)
    loss = gp.fused_linear_cross_entropy(h, w, t)
    gh, gw = torch.autograd.grad(loss, (h, w))
    ref, (rh, rw) = _fused_ref(h, w, t, None, "mean")
    n = (t != -100).sum().item()
    assert_close_ref(loss, ref, dtype, "loss")
    assert_close_ref(gh.double() * n, rh * n, dtype, "hidden")
    assert_close_ref(gw.double() * n, rw * n, dtype, "weight")


def test_chunk_knob_listed():
    values, current = tuning.knobs()["cross_entropy_chunk"]
    assert "1" in values and "8" in values and current is None


# ---- bad input --------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_bad_input(device):
    x = torch.randn(4, 5, device=device)
    t = torch.tensor([0, 1, 2, 3], device=device)
    with pytest.raises(RuntimeError, match="target must be an int64 or int32"):
        gp.cross_entropy(x, t.float())
    with pytest.raises(RuntimeError, match=r"target must have shape logits.shape\[:-1\]"):
        gp.cross_entropy(x, t[:3])
    with pytest.raises(RuntimeError, match=r"target must have shape logits.shape\[:-1\]"):
        gp.cross_entropy(x, t.view(2, 2))
    with pytest.raises(RuntimeError, match="logits must have at least 1 dimension"):
        OP(torch.tensor(1.0, device=device), t, -100, "mean")
    with pytest.raises(RuntimeError, match="logits must be a float32"):
        gp.cross_entropy(x.int(), t)
    with pytest.raises(RuntimeError, match="reduction must be one of 'mean', 'sum', 'none', got 'avg'"):
        gp.cross_entropy(x, t, reduction="avg")
    w = torch.randn(7, 5, device=device)
    with pytest.raises(RuntimeError, match="weight must be"):
        gp.fused_linear_cross_entropy(x, w.t(), t)
    with pytest.raises(RuntimeError, match="bias must have shape"):
        gp.fused_linear_cross_entropy(x, w, t, torch.randn(6, device=device))
    with pytest.raises(RuntimeError, match="reduction must be 'mean' or 'sum'"):
        gp.fused_linear_cross_entropy(x, w, t, reduction="none")
    with pytest.raises(RuntimeError, match="weight has dtype"):
        gp.fused_linear_cross_entropy(x, w.double(), t)


def test_bad_target_cpu():
    x = torch.randn(4, 5)
    with pytest.raises(RuntimeError, match=r"target holds 5 at flat position 2, outside \[0, 5\)"):
        gp.cross_entropy(x, torch.tensor([0, 1, 5, -100]))
    with pytest.raises(RuntimeError, match=r"target holds -1 at flat position 0"):
        gp.cross_entropy(x, torch.tensor([-1, 1, 2, 3]), ignore_index=3)
    with pytest.raises(RuntimeError, match="outside"):
        gp.fused_linear_cross_entropy(x, torch.randn(7, 5), torch.tensor([0, 1, 7, 2]))


@requires_cuda
def test_bad_device():
    with pytest.raises(RuntimeError, match="target is on"):
        gp.cross_entropy(torch.randn(3, 4, device="cuda"), torch.tensor([0, 1, 2]))


@pytest.mark.parametrize("device", DEVICES)
def test_fused_all_ignored(device):
    h = _logits((6, 8), device, torch.float32, seed=43).requires_grad_()
    w = _logits((11, 8), device, torch.float32, seed=44).requires_grad_()
    t = torch.full((6,), -100, device=device)
    with tuning.override(cross_entropy_chunk="2"):
        loss = gp.fused_linear_cross_entropy(h, w, t)
        gh, gw = torch.autograd.grad(loss, (h, w))
        assert gp.fused_linear_cross_entropy(h, w, t, reduction="sum").item() == 0
    assert torch.isnan(loss)  # 0 / 0, as F.cross_entropy
    assert (gh == 0).all() and (gw == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_nn_module(device):
    # torch.nn.CrossEntropyLoss's arguments and layout (classes on dim 1).
    logits = _logits((3, 10, 4), device, torch.float64, seed=45)
    target = _targets((3, 4), 10, device, seed=46)
    weight = torch.rand(10, device=device, dtype=torch.float64) + 0.1
    target3 = torch.where(target == -100, 3, target)  # class 3 ignored below
    for reduction in REDUCTIONS:
        for t, kw in ((target, {}), (target3, {"weight": weight, "label_smoothing": 0.2, "ignore_index": 3})):
            mod = gp.nn.CrossEntropyLoss(reduction=reduction, **kw)
            ref = torch.nn.CrossEntropyLoss(reduction=reduction, **kw)
            torch.testing.assert_close(mod(logits, t), ref(logits, t))
    with pytest.raises(ValueError, match="reduction"):
        gp.nn.CrossEntropyLoss(reduction="avg")


# ---- property tests (hypothesis; profile from GPU_PUZZLES_HYPOTHESIS_PROFILE, see conftest) ----
# Each draw is checked against float64 and allowed twice eager PyTorch's own error (same dtype,
# same inputs) on top of the tolerance: our kernels may round differently, never worse.

@pytest.mark.parametrize("device", DEVICES)
@given(data=st.data())
def test_property_cross_entropy(device, data):
    """Random form ((C,), (N, C), (N, C, d...)), C, dtype, logits strides, int32/int64 targets,
    ignore_index, class weights, label smoothing, reduction and soft-cap against float64."""
    dtype = data.draw(dtypes(device), "dtype")
    C = data.draw(extents(300 if device == "cpu" else 5000), "C")
    form = data.draw(st.sampled_from(["C", "NC", "NCd"]), "form")
    lead = () if form == "C" else (data.draw(extents(40), "N"),)
    tail = data.draw(shapes(1, 2, max_side=9, max_numel=20), "d") if form == "NCd" else ()
    shape = (*lead, C, *tail)
    seed = data.draw(seeds(), "seed")
    scale = data.draw(st.sampled_from([1.0, 3.0, 30.0]), "logit scale")
    x = make_tensor(shape, dtype, device, data.draw(layouts(len(shape)), "logits layout"), seed, scale=scale,
                    requires_grad=True)
    tshape = (*lead, *tail)
    ignore = data.draw(st.sampled_from([-100, C] + ([0] if C > 1 else [])), "ignore_index")
    t = make_indices(tshape, 0, C, data.draw(index_dtypes(), "target dtype"), device, seed=seed + 1)
    drop = torch.rand(tshape, generator=torch.Generator().manual_seed(seed + 2)) < 0.2
    t = t.masked_fill(drop.to(device), ignore)
    t.view(-1)[0] = C - 1 if ignore != C - 1 else 0  # at least one counted target: the mean is defined
    weight = (make_tensor((C,), dtype, device, seed=seed + 3).abs() + 0.1) if data.draw(st.booleans(), "weight") \
        else None
    smoothing = data.draw(st.sampled_from([0.0, 0.0, 0.1, 1.0]), "label_smoothing")
    reduction = data.draw(st.sampled_from(REDUCTIONS), "reduction")
    softcap = data.draw(st.sampled_from([None, None, 1.0, 30.0]), "softcap")
    kw = dict(weight=weight, ignore_index=ignore, reduction=reduction, label_smoothing=smoothing)

    loss = gp.cross_entropy(x, t, softcap=softcap, **kw)
    x64 = x.detach().double().requires_grad_()
    w64 = None if weight is None else weight.double()
    ref = F.cross_entropy(_cap(x64, softcap), t.long(), **dict(kw, weight=w64))
    xe = x.detach().requires_grad_()
    eager = F.cross_entropy(_cap(xe, softcap), t.long(), **kw)
    assert loss.shape == ref.shape
    close_to_eager(loss, ref.detach(), eager.detach(), dtype, "loss")
    g = make_tensor(loss.shape, loss.dtype, device, seed=seed + 4)
    dx, = torch.autograd.grad(loss, x, g)
    ref_dx, = torch.autograd.grad(ref, x64, g.double())
    eager_dx, = torch.autograd.grad(eager, xe, g)
    close_to_eager(dx, ref_dx, eager_dx, dtype, "dinput")


@pytest.mark.parametrize("device", DEVICES)
@given(data=st.data())
def test_property_fused_linear_cross_entropy(device, data):
    """Random leading shape, H, V, dtype, bias, a transposed (tied) weight, ignore_index, reduction,
    soft-cap and chunk size against float64 F.cross_entropy(F.linear(...)), all three gradients."""
    dtype = data.draw(dtypes(device), "dtype")
    lead = data.draw(shapes(1, 2, max_side=40, max_numel=80), "leading shape")
    H = data.draw(extents(96), "H")
    V = data.draw(extents(700 if device == "cpu" else 5000), "V")
    seed = data.draw(seeds(), "seed")
    h = make_tensor((*lead, H), dtype, device, data.draw(layouts(len(lead) + 1, allow_expanded=False), "hidden layout"),
                    seed, scale=0.5, requires_grad=True)
    tied = data.draw(st.booleans(), "weight as a transposed view")
    w = make_tensor((H, V) if tied else (V, H), dtype, device, seed=seed + 1, scale=0.5)
    w = (w.t() if tied else w).detach().requires_grad_()
    b = make_tensor((V,), dtype, device, seed=seed + 2, requires_grad=True) if data.draw(st.booleans(), "bias") \
        else None
    ignore = data.draw(st.sampled_from([-100, 0] if V > 1 else [-100]), "ignore_index")
    t = make_indices(lead, 0, V, torch.int64, device, seed=seed + 3)
    t = t.masked_fill((torch.rand(lead, generator=torch.Generator().manual_seed(seed + 4)) < 0.2).to(device), ignore)
    t.view(-1)[0] = V - 1 if ignore != V - 1 else 0
    reduction = data.draw(st.sampled_from(["mean", "sum"]), "reduction")
    softcap = data.draw(st.sampled_from([None, None, 30.0]), "softcap")
    chunk = data.draw(st.sampled_from([None, "1", "3", "64"]), "chunk")
    params = [p for p in (h, w, b) if p is not None]

    with tuning.override(cross_entropy_chunk=chunk):
        loss = gp.fused_linear_cross_entropy(h, w, t, b, ignore_index=ignore, reduction=reduction, softcap=softcap)
    leaves = [p.detach().double().requires_grad_() for p in params]
    eager_in = [p.detach().requires_grad_() for p in params]

    def math(hh, ww, bb):
        logits = _cap(F.linear(hh, ww, bb), softcap)
        return F.cross_entropy(logits.reshape(-1, V), t.reshape(-1), ignore_index=ignore, reduction=reduction)
    ref = math(*leaves, *([None] if b is None else []))
    eager = math(*eager_in, *([None] if b is None else []))
    close_to_eager(loss, ref.detach(), eager.detach(), dtype, "loss")
    g = make_tensor((), loss.dtype, device, seed=seed + 5)
    grads = torch.autograd.grad(loss, params, g)
    refs = torch.autograd.grad(ref, leaves, g.double())
    eagers = torch.autograd.grad(eager, eager_in, g)
    M = max(1, t.numel())
    for name, a, r, e, n in zip(("dhidden", "dweight", "dbias"), grads, refs, eagers, (V, M, M)):
        close_to_eager(a, r, e, dtype, name, n)
