"""attention: seed vector example, SDPA float64 references, gradients, opcheck, compile, bad input,
the unfused chain (algorithm="unfused"), nn.Attention; CUDA: every dtype at many shapes, poisoned
memory, linear memory, each forward kernel (the attention_fwd knob), each backward kernel
(attention_bwd) and the defaults' choices."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import (
    DEVICES,
    HAS_CUDA,
    SANITIZE,
    assert_backward_fills_as_op,
    assert_compiled_matches_eager,
    copy_kernels,
    many,
    poison_allocator,
    requires_caching_allocator,
    requires_cuda,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import OFFSET, make_tensor

import gpu_puzzles as gp
from gpu_puzzles.bench.attention import backward_kernels, forward_kernels

OPS = torch.ops.gpu_puzzles

# Error bounds relative to max(1, max |reference|): max-abs and Frobenius (catches small systematic errors).
MAX_TOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 6e-2}
FRO_TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


def _assert_close(actual, ref, dtype, what, grad=False):
    assert actual.shape == ref.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(actual).any(), f"{what}: NaN (unwritten or bad) elements"
    if ref.numel() == 0:
        return
    a, r = actual.double(), ref.double()
    scale = max(1.0, r.abs().max().item())
    f = 2.0 if grad else 1.0
    err = (a - r).abs().max().item()
    assert err <= f * MAX_TOL[dtype] * scale, f"{what}: max error {err:.3e} > {f * MAX_TOL[dtype] * scale:.3e}"
    fro = (a - r).norm().item() / max(r.norm().item(), 1e-30)
    if r.norm().item() > 1e-6:
        assert fro <= f * FRO_TOL[dtype], f"{what}: relative Frobenius error {fro:.3e} > {f * FRO_TOL[dtype]:.3e}"


def ref_attention(q, k, v, scale=None, causal=False):
    """Plain float64 math: softmax(q k^T * scale + mask) v (differentiable)."""
    q, k, v = q.double(), k.double(), v.double()
    vector = q.dim() == 1
    if vector:
        q = q.unsqueeze(0)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    out = torch.softmax(s, -1) @ v
    return out.squeeze(0) if vector else out


def sdpa64(q, k, v, scale=None, causal=False):
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal, scale=scale)


def make_qkv(lead, Sq, Sk, D, Dv, device, dtype, grad=False, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)  # noqa: E731
    q, k, v = mk(*lead, Sq, D), mk(*lead, Sk, D), mk(*lead, Sk, Dv)
    return [t.requires_grad_(grad) for t in (q, k, v)]


# ---- the seed ---------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algorithm", ["auto", "unfused"])
def test_seed_vector_example(device, algorithm):
    np.random.seed(42)  # the seed's inputs: q of 16, K and V of 16x16, scale 1.0
    q = (np.random.randn(16) * 0.1).astype(np.float32)
    K = (np.random.randn(16, 16) * 0.1).astype(np.float32)
    V = (np.random.randn(16, 16) * 0.1).astype(np.float32)
    s = K @ q
    w = np.exp(s - s.max())
    expected = (w / w.sum()) @ V
    np.testing.assert_allclose(expected[:5], [-0.00935538, -0.0243433, 0.00306551, 0.02346884, 0.019306], atol=1e-7)
    out = gp.attention(*(torch.from_numpy(a).to(device) for a in (q, K, V)), scale=1.0, algorithm=algorithm)
    assert out.shape == (16,)
    np.testing.assert_allclose(out.cpu().numpy(), expected, rtol=1e-5, atol=1e-7)


# ---- CPU (and CUDA) against SDPA in float64 -----------------------------------------

# (lead, Sq, Sk, D, Dv): odd lengths, Sq != Sk both ways, head dims 1..256, D != Dv.
SHAPES = [((), 1, 1, 1, 1), ((2,), 7, 7, 16, 16), ((1, 2), 33, 7, 64, 64), ((2,), 7, 33, 80, 80),
          ((1,), 129, 33, 16, 8), ((1,), 5, 129, 128, 128), ((1, 1), 9, 17, 256, 256), ((3,), 1, 20, 64, 32),
          ((2, 3), 20, 1, 8, 24), ((1,), 33, 33, 1, 5)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_cpu_forward_matches_sdpa(shape, causal, dtype):
    lead, Sq, Sk, D, Dv = shape
    q, k, v = make_qkv(lead, Sq, Sk, D, Dv, "cpu", dtype, seed=Sq * 7 + Sk)
    out, lse = OPS.attention(q, k, v, None, causal)
    assert out.shape == (*lead, Sq, Dv) and out.dtype == dtype and lse.shape == (*lead, Sq)
    _assert_close(out, sdpa64(q, k, v, causal=causal), dtype, f"{shape} causal={causal}")
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(D)
    if causal:
        s = s.masked_fill(torch.ones(Sq, Sk, dtype=torch.bool).triu(1), float("-inf"))
    _assert_close(lse, torch.logsumexp(s, -1), dtype, "lse")
    out2 = gp.attention(q, k, v, scale=0.3, causal=causal)
    _assert_close(out2, sdpa64(q, k, v, scale=0.3, causal=causal), dtype, "scale=0.3")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [((2,), 7, 7, 16, 16), ((1, 2), 33, 9, 64, 32), ((1,), 5, 40, 80, 80),
                                   ((1,), 3, 6, 256, 256)], ids=str)
def test_cpu_backward_matches_reference(shape, causal):
    lead, Sq, Sk, D, Dv = shape
    for dtype in (torch.float64, torch.float32):
        q, k, v = make_qkv(lead, Sq, Sk, D, Dv, "cpu", dtype, grad=True, seed=3)
        g = torch.randn(*lead, Sq, Dv, dtype=dtype)
        grads = torch.autograd.grad(gp.attention(q, k, v, causal=causal), (q, k, v), g)
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        refs = torch.autograd.grad(ref_attention(*leaves, causal=causal), leaves, g.double())
        for name, a, r in zip("qkv", grads, refs):
            _assert_close(a, r, dtype, f"d{name} {shape} causal={causal} {dtype}", grad=True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [((1,), 150, 1100, 24, 16), ((2,), 1100, 530, 8, 8), ((1,), 513, 513, 32, 32)],
                         ids=str)
def test_cpu_long_rows_blocked(shape, causal):
    # Longer than the CPU kernels' key block and query block: the online softmax across
    # key blocks, causal rows that see none of a later block, and partial last blocks.
    # Scores of size ~30 make the running maximum move between blocks.
    lead, Sq, Sk, D, Dv = shape
    for dtype in (torch.float64, torch.float32):
        q, k, v = make_qkv(lead, Sq, Sk, D, Dv, "cpu", dtype, seed=Sk)
        q = (q * 6).requires_grad_()
        k.requires_grad_()
        v.requires_grad_()
        out, lse = OPS.attention(q, k, v, None, causal)
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref = sdpa64(*leaves, causal=causal)
        _assert_close(out, ref, dtype, f"{shape} causal={causal} {dtype}")
        s = (leaves[0] @ leaves[1].transpose(-1, -2)).detach() / math.sqrt(D)
        if causal:
            s = s.masked_fill(torch.ones(Sq, Sk, dtype=torch.bool).triu(1), float("-inf"))
        _assert_close(lse, torch.logsumexp(s, -1), dtype, "lse")
        g = torch.randn(*lead, Sq, Dv, dtype=dtype)
        grads = torch.autograd.grad(gp.attention(q, k, v, causal=causal), (q, k, v), g)
        refs = torch.autograd.grad(ref, leaves, g.double())
        for name, a, r in zip("qkv", grads, refs):
            _assert_close(a, r, dtype, f"d{name} {shape} causal={causal} {dtype}", grad=True)


def test_cpu_saturated_softmax():
    # Scores spread over thousands: most probabilities underflow to 0 and each row is
    # dominated by a few keys (the exp's clamp, the lse's precision). float32 cannot
    # hold such scores to the usual bounds, so the errors are held to SDPA's own in float32.
    q, k, v = make_qkv((2,), 70, 90, 16, 8, "cpu", torch.float32, grad=True, seed=5)
    g = torch.randn(2, 70, 8, generator=torch.Generator().manual_seed(6))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    rel = lambda a, r: ((a.double() - r).norm() / r.norm()).item()  # noqa: E731
    for causal in (False, True):
        ref = sdpa64(*leaves, scale=100.0, causal=causal)
        refs = (ref, *torch.autograd.grad(ref, leaves, g.double()))
        errs = {}
        for label, fn in (("ours", gp.attention), ("sdpa", lambda *t, **kw: F.scaled_dot_product_attention(
                *t, scale=kw["scale"], is_causal=kw["causal"]))):
            out = fn(q, k, v, scale=100.0, causal=causal)
            errs[label] = [rel(a, r) for a, r in zip((out, *torch.autograd.grad(out, (q, k, v), g)), refs)]
        for name, ours, sdpa in zip(("out", "dq", "dk", "dv"), errs["ours"], errs["sdpa"]):
            assert ours <= 4 * sdpa + 1e-6, f"{name} causal={causal}: error {ours:.2e}, SDPA float32 {sdpa:.2e}"


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_and_vector(device):
    # The common layout: (B, S, H, D) viewed as (B, H, S, D).
    base = torch.randn(2, 11, 3, 3, 16, device=device, dtype=torch.float64)
    q, k, v = (base[:, :, i].transpose(1, 2) for i in range(3))
    assert not q.is_contiguous()
    _assert_close(gp.attention(q, k, v, causal=True), sdpa64(q, k, v, causal=True), torch.float64, "strided")
    q1, K, V = torch.randn(16, device=device), torch.randn(9, 16, device=device), torch.randn(9, 4, device=device)
    _assert_close(gp.attention(q1, K, V), ref_attention(q1, K, V), torch.float32, "vector")
    _assert_close(gp.attention(q1, K, V, causal=True), ref_attention(q1, K, V, causal=True), torch.float32,
                  "vector causal (sees key 0 only)")


@pytest.mark.parametrize("device", DEVICES)
def test_degenerate_sizes(device):
    # Sq = 0: empty; Sk = 0: nothing to attend to -> zeros (documented), zero gradients.
    q, k, v = make_qkv((2,), 0, 5, 8, 8, device, torch.float32, grad=True)
    out = gp.attention(q, k, v)
    assert out.shape == (2, 0, 8)
    q, k, v = make_qkv((2,), 3, 0, 8, 4, device, torch.float32, grad=True)
    out = gp.attention(q, k, v)
    assert out.shape == (2, 3, 4) and (out == 0).all()
    (dq,) = torch.autograd.grad(out.sum(), (q,))
    assert (dq == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck(device):
    for causal in (False, True):
        for lead, Sq, Sk in (((1, 2), 5, 7), ((2,), 6, 3)):
            q, k, v = make_qkv(lead, Sq, Sk, 3, 4, device, torch.float64, grad=True, seed=Sq)
            assert torch.autograd.gradcheck(lambda a, b, c: gp.attention(a, b, c, causal=causal), (q, k, v))
        q, k, v = make_qkv((1,), 4, 5, 3, 2, device, torch.float64, grad=True)
        assert torch.autograd.gradcheck(
            lambda a, b, c: gp.attention(a, b, c, causal=causal, scale=0.7, algorithm="unfused"), (q, k, v))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck(device, requires_grad):
    for causal in (False, True):
        q, k, v = make_qkv((2, 2), 5, 7, 8, 6, device, torch.float32, grad=requires_grad)
        torch.library.opcheck(OPS.attention.default, (q, k, v, None, causal))
        torch.library.opcheck(OPS.attention.default, (q, k, v, 0.5, causal))
        torch.library.opcheck(OPS.matmul.default, (q, k.transpose(-1, -2), 0.5, causal))
    q1, K, V = make_qkv((), 1, 7, 8, 8, device, torch.float32, grad=requires_grad)
    torch.library.opcheck(OPS.attention.default, (q1[0], K, V, 1.0, False))
    torch.library.opcheck(OPS.transpose_last2.default, (K,))
    torch.library.opcheck(OPS.transpose_last2.default, (q,))
    with torch.no_grad():
        out, lse = OPS.attention(q, k, v, None, True)
    g = torch.randn_like(out)
    torch.library.opcheck(OPS.attention_backward.default, (g, q.detach(), k.detach(), v.detach(), out, lse, None, True))


@pytest.mark.parametrize("device", DEVICES)
def test_backward_adds_no_fill_for_lse(device):
    # lse carries no gradient: autograd must not fill a zero (B, H, Sq) tensor per call.
    q, k, v = make_qkv((2, 2), 5, 7, 8, 8, device, torch.float32, grad=True)
    out, lse = OPS.attention(q, k, v, None, True)
    g = torch.randn_like(out)
    assert_backward_fills_as_op(out, g, lambda: OPS.attention_backward(g, q, k, v, out, lse, None, True))


@pytest.mark.parametrize("algorithm", ["auto", "unfused"])
def test_compile_forward_backward(algorithm):
    # fullgraph + dynamic: no graph break, one graph for both lengths. On the CPU the
    # chain runs under aot_eager (the same tracing: fake kernels, autograd) to keep CI short.
    device = "cuda" if HAS_CUDA else "cpu"

    def f(q, k, v):
        return (gp.attention(q, k, v, causal=True, algorithm=algorithm) * 2
                + gp.attention(q, k, v, scale=0.5, algorithm=algorithm))

    backend = "aot_eager" if (algorithm == "unfused" and not HAS_CUDA) else "inductor"
    cases = []
    for S in (16, 23):
        qkv = make_qkv((2, 2), S, S, 16, 16, device, torch.float32, grad=True, seed=S)
        cases.append((qkv, qkv))
    assert_compiled_matches_eager(f, cases, backend=backend)


@pytest.mark.parametrize("device", DEVICES)
def test_unfused_matches_fused(device):
    for lead, Sq, Sk, D, Dv in (((2, 3), 17, 17, 16, 16), ((1,), 9, 40, 32, 8), ((2,), 40, 9, 8, 8)):
        for causal in (False, True):
            q, k, v = make_qkv(lead, Sq, Sk, D, Dv, device, torch.float64, grad=True)
            g = torch.randn(*lead, Sq, Dv, device=device, dtype=torch.float64)
            a, b = gp.attention(q, k, v, causal=causal), gp.attention(q, k, v, causal=causal, algorithm="unfused")
            _assert_close(b, a, torch.float64, "unfused vs fused")
            ga, gb = torch.autograd.grad(a, (q, k, v), g), torch.autograd.grad(b, (q, k, v), g)
            for x, y in zip(gb, ga):
                _assert_close(x, y, torch.float64, "unfused vs fused grad", grad=True)


@pytest.mark.parametrize("device", DEVICES)
def test_chain_ops(device):
    x = torch.randn(2, 3, 37, 45, device=device)
    assert torch.equal(OPS.transpose_last2(x), x.transpose(-1, -2).contiguous())
    a, b = torch.randn(2, 33, 40, device=device, dtype=torch.float64), torch.randn(2, 40, 35, device=device,
                                                                                  dtype=torch.float64)
    ref = 0.5 * (a @ b)
    torch.testing.assert_close(OPS.matmul(a, b, 0.5), ref)
    m = OPS.matmul(a, b, 0.5, True)
    mask = torch.ones(33, 35, dtype=torch.bool, device=device).triu(1)
    assert torch.isneginf(m[:, mask]).all()
    torch.testing.assert_close(m[:, ~mask], ref[:, ~mask])


def _reference_mha(mod, x):
    """Plain PyTorch multi-head attention with mod's weights."""
    B, S, E = x.shape
    H, Dh = mod.num_heads, mod.head_dim
    q, k, v = F.linear(x, mod.qkv.weight, mod.qkv.bias).view(B, S, 3, H, Dh).permute(2, 0, 3, 1, 4)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=mod.causal)
    return F.linear(o.transpose(1, 2).reshape(B, S, E), mod.out_proj.weight, mod.out_proj.bias)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True])
def test_module_matches_reference(device, causal):
    torch.manual_seed(1)
    for algorithm in ("auto", "unfused"):
        mod = gp.nn.Attention(32, 4, causal=causal, algorithm=algorithm, device=device, dtype=torch.float64)
        x = torch.randn(2, 13, 32, device=device, dtype=torch.float64, requires_grad=True)
        y, r = mod(x), _reference_mha(mod, x)
        torch.testing.assert_close(y, r)
        g = torch.randn_like(y)
        params = [x, mod.qkv.weight, mod.qkv.bias, mod.out_proj.weight]
        for a, b in zip(torch.autograd.grad(y, params, g), torch.autograd.grad(r, params, g)):
            torch.testing.assert_close(a, b)
        torch.testing.assert_close(mod(x[0]), r[0])  # unbatched (S, E)
    assert "num_heads=4" in repr(mod) and "algorithm='unfused'" in repr(mod)
    with pytest.raises(ValueError, match="multiple of num_heads"):
        gp.nn.Attention(30, 4)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input(device):
    r = lambda *s, dt=torch.float32: torch.randn(*s, device=device, dtype=dt)  # noqa: E731
    cases = [
        (lambda: gp.attention(r(2, 5, 8), r(2, 6, 7), r(2, 6, 8)), "k has head dim 7 but q has head dim 8"),
        (lambda: gp.attention(r(2, 5, 8), r(2, 6, 8), r(2, 4, 8)), "v has sequence length 4 but k has 6"),
        (lambda: gp.attention(r(2, 5, 8), r(3, 6, 8), r(3, 6, 8)), r"k has 3 heads \(dim -3\) but q has 2"),
        (lambda: gp.attention(r(2, 5, 8), r(2, 6, 8), r(3, 6, 8)), r"v has 3 heads \(dim -3\) but k has 2"),
        (lambda: gp.attention(r(2, 2, 5, 8), r(3, 2, 6, 8), r(3, 2, 6, 8)), "k has leading dims"),
        (lambda: gp.attention(r(2, 2, 5, 8), r(2, 2, 6, 8), r(3, 2, 6, 8)), "v has leading dims"),
        (lambda: gp.attention(r(2, 5, 8), r(6, 8), r(6, 8)), "k must have as many dims as q"),
        (lambda: gp.attention(r(8), r(1, 6, 8), r(6, 8)), "k and v must be 2-D"),
        (lambda: gp.attention(r(2, 5, 8), r(2, 6, 8, dt=torch.float64), r(2, 6, 8)), "k has dtype"),
        (lambda: gp.attention(r(2, 5, 8), r(2, 6, 8), r(2, 6, 8, dt=torch.float64)), "v has dtype"),
        (lambda: gp.attention(torch.ones(2, 5, 8, dtype=torch.int32, device=device), r(2, 6, 8), r(2, 6, 8)),
         "q must be a float"),
        (lambda: gp.attention(r(2, 5, 0), r(2, 6, 0), r(2, 6, 8)), "head dim >= 1"),
        (lambda: gp.attention(r(2, 5, 8), r(2, 6, 7), r(2, 6, 8), algorithm="unfused"), "attention: k has head dim"),
        (lambda: gp.attention(r(2, 5, 8), r(2, 6, 8), r(2, 6, 8), algorithm="fused"), "algorithm must be one of"),
        (lambda: OPS.matmul(r(2, 5, 8), r(2, 7, 3)), "b has 7 rows but a has 8 columns"),
        (lambda: OPS.transpose_last2(r(5)), "at least 2 dims"),
    ]
    if device != "cpu":
        cases.append((lambda: gp.attention(r(1, 5, 264), r(1, 6, 264), r(1, 6, 8)), "q head dim 264 exceeds 256"))
        cases.append((lambda: gp.attention(r(1, 5, 8), r(1, 6, 8), r(1, 6, 300)), "v head dim 300 exceeds 256"))
    for call, msg in cases:
        with pytest.raises((RuntimeError, ValueError), match=msg):
            call()
    q, k, v = r(2, 5, 8), r(2, 6, 8), r(2, 6, 8)
    out, lse = OPS.attention(q, k, v, None, False)
    with pytest.raises(RuntimeError, match="grad_out has shape"):
        OPS.attention_backward(r(2, 5, 7), q, k, v, out, lse, None, False)
    with pytest.raises(RuntimeError, match="lse"):
        OPS.attention_backward(out, q, k, v, out, lse.double(), None, False)


@requires_cuda
def test_mixed_devices():
    with pytest.raises(RuntimeError, match="k is on"):
        gp.attention(torch.randn(2, 5, 8, device="cuda"), torch.randn(2, 6, 8), torch.randn(2, 6, 8, device="cuda"))


# ---- property test -----------------------------------------------------------------

hypothesis = pytest.importorskip("hypothesis")


@settings(max_examples=30, deadline=None)
@given(lead=st.lists(st.integers(1, 3), min_size=0, max_size=2), Sq=st.integers(1, 24), Sk=st.integers(1, 24),
       D=st.integers(1, 24), Dv=st.integers(1, 24), causal=st.booleans(),
       scale=st.one_of(st.none(), st.floats(0.05, 2.0)), seed=st.integers(0, 2**16))
def test_property_matches_sdpa(lead, Sq, Sk, D, Dv, causal, scale, seed):
    q, k, v = make_qkv(tuple(lead), Sq, Sk, D, Dv, "cpu", torch.float64, grad=True, seed=seed)
    out = gp.attention(q, k, v, scale=scale, causal=causal)
    _assert_close(out, sdpa64(q, k, v, scale=scale, causal=causal), torch.float64, "property fwd")
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    refs = torch.autograd.grad(ref_attention(*leaves, scale=scale, causal=causal), leaves, g)
    for a, r in zip(grads, refs):
        _assert_close(a, r, torch.float64, "property bwd", grad=True)


# ---- CUDA: every dtype, many shapes, forward and backward, poisoned memory ------------

# (lead, Sq, Sk, D, Dv): tails past every 64/128 tile, Sq != Sk both ways, the fast head dims
# 64 and 128, every other supported head dim class up to 256, D != Dv.
CUDA_SHAPES = [((1,), 1, 1, 64, 64), ((2, 3), 7, 7, 16, 16), ((2,), 33, 129, 64, 64), ((1, 4), 129, 33, 128, 128),
               ((3,), 200, 200, 80, 80), ((2,), 127, 255, 128, 64), ((1, 2), 65, 65, 256, 256),
               ((2,), 100, 300, 1, 1), ((2, 2), 513, 513, 64, 64), ((1, 2), 1000, 1000, 128, 128),
               ((1,), 257, 1, 32, 32), ((1, 1), 1, 300, 96, 96), ((4,), 64, 64, 64, 64), ((2,), 128, 128, 128, 128),
               ((2,), 191, 191, 64, 64), ((1, 3), 383, 200, 128, 128), ((1,), 77, 1100, 160, 160),
               ((1,), 130, 130, 32, 128), ((2,), 1025, 1023, 64, 64)]
CUDA_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def _poison_cache():
    poison_allocator(256 << 20)  # outputs and workspaces (a workspace left uncleared shows too)


def _cuda_check(lead, Sq, Sk, D, Dv, causal, dtype, what, scale=None):
    q, k, v = make_qkv(lead, Sq, Sk, D, Dv, "cuda", dtype, grad=True, seed=Sq * 31 + Sk + D)
    g = torch.randn(*lead, Sq, Dv, device="cuda", dtype=torch.float64).to(dtype)
    _poison_cache()
    out, lse = OPS.attention(q, k, v, scale, causal)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = ref_attention(*leaves, scale=scale, causal=causal)
    _assert_close(out, ref, dtype, f"{what} out")
    s = (leaves[0] @ leaves[1].transpose(-1, -2)).detach() * (1 / math.sqrt(D) if scale is None else scale)
    if causal:
        s = s.masked_fill(torch.ones(Sq, Sk, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    _assert_close(lse, torch.logsumexp(s, -1), torch.float32 if dtype != torch.float64 else dtype, f"{what} lse")
    _poison_cache()
    dq, dk, dv = OPS.attention_backward(g, q.detach(), k.detach(), v.detach(), out, lse, scale, causal)
    refs = torch.autograd.grad(ref, leaves, g.double())
    for name, a, r in zip("qkv", (dq, dk, dv), refs):
        _assert_close(a, r, dtype, f"{what} d{name}", grad=True)


def _assert_same_grads(grads, want, what):
    """Two backward calls on the same values: dk and dv bitwise equal (summed in registers in one
    order, written once); dq too where the backward is deterministic, else within rounding (the
    wgmma backward adds its float32 partial dq sums by atomics, in any order)."""
    for name, a, c in zip("qkv", grads, want):
        if name != "q" or torch.are_deterministic_algorithms_enabled():
            assert torch.equal(a, c), f"{what}: d{name} differs bitwise"
        else:
            a, c = a.float(), c.float()
            bound = 2.0 ** -7 * c.abs() + 1e-3 * c.abs().max()
            assert ((a - c).abs() <= bound).all(), f"{what}: dq differs by more than rounding"


# One test per shape (not a loop): a failure names its shape, and the sanitizer runs
# (benchmarks/sanitize_queue.py) can spread the shapes over processes.
@requires_cuda
@pytest.mark.parametrize("shape", CUDA_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", CUDA_DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_forward_backward_many_shapes(shape, dtype, causal):
    _cuda_check(*shape, causal, dtype, f"{shape} causal={causal} {dtype}")


@requires_cuda
@pytest.mark.parametrize("dtype", CUDA_DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_forward_backward_scale(dtype, causal):
    _cuda_check((2,), 70, 90, 64, 64, causal, dtype, "scale=1.0", scale=1.0)


@requires_cuda
@pytest.mark.parametrize("scale", [-0.3, 0.0])
@pytest.mark.parametrize("D", [64, 128])
def test_cuda_nonpositive_scale(scale, D):
    # The warp-specialised forward (the default from 1024 keys on a 9.x GPU) takes the row max
    # before scaling, which holds for scale > 0 only; other scales take the other kernels.
    for causal in (False, True):
        _cuda_check((1, 2), 1100, 1100, D, D, causal, torch.bfloat16, f"scale={scale} causal={causal}", scale=scale)


# The fast configs at ~4096, lengths not multiples of 64/128: (lead, Sq, Sk, causal).
LONG_CASES = [((1, 2), 4100, 4100, False), ((1, 2), 4100, 4100, True), ((1,), 1000, 4097, True),
              ((1,), 4097, 1000, True)]


@requires_cuda
@pytest.mark.parametrize("case", LONG_CASES, ids=str)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cuda_fast_configs_long(case, D, dtype):
    lead, Sq, Sk, causal = case
    _cuda_check(lead, Sq, Sk, D, D, causal, dtype, f"Sq={Sq} Sk={Sk} D={D} causal={causal}")


@requires_cuda
def test_cuda_vector_and_misaligned_and_strided():
    q, K, V = torch.randn(16, device="cuda"), torch.randn(16, 16, device="cuda"), torch.randn(16, 16, device="cuda")
    _assert_close(gp.attention(q, K, V, scale=1.0), ref_attention(q, K, V, scale=1.0), torch.float32, "vector")
    for dtype in (torch.bfloat16, torch.float32):
        q = make_tensor((2, 3, 77, 64), dtype, "cuda", OFFSET)  # contiguous, misaligned base
        k = torch.randn(2, 77, 3, 64, device="cuda", dtype=dtype).transpose(1, 2)  # strided
        v = torch.randn(2, 3, 77, 64, device="cuda", dtype=dtype)
        _assert_close(gp.attention(q, k, v, causal=True), ref_attention(q, k, v, causal=True), dtype, "misaligned")


@requires_cuda
def test_cuda_autograd_and_cpu_agree():
    q, k, v = make_qkv((2, 2), 50, 70, 64, 64, "cuda", torch.float64, grad=True)
    g = torch.randn(2, 2, 50, 64, device="cuda", dtype=torch.float64)
    gc = torch.autograd.grad(gp.attention(q, k, v, causal=True), (q, k, v), g)
    qc, kc, vc = (t.detach().cpu().requires_grad_() for t in (q, k, v))
    gcpu = torch.autograd.grad(gp.attention(qc, kc, vc, causal=True), (qc, kc, vc), g.cpu())
    for a, b in zip(gc, gcpu):
        _assert_close(a.cpu(), b, torch.float64, "cuda vs cpu grad", grad=True)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_unfused_chain(dtype):
    for lead, Sq, Sk, D in (((2, 3), 100, 100, 64), ((1,), 33, 257, 128), ((1,), 1, 16, 16)):
        for causal in (False, True):
            q, k, v = make_qkv(lead, Sq, Sk, D, D, "cuda", dtype, grad=True)
            g = torch.randn(*lead, Sq, D, device="cuda", dtype=dtype)
            _poison_cache()
            out = gp.attention(q, k, v, causal=causal, algorithm="unfused")
            leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
            ref = ref_attention(*leaves, causal=causal)
            _assert_close(out, ref, dtype, "unfused")
            grads = torch.autograd.grad(out, (q, k, v), g)
            for a, r in zip(grads, torch.autograd.grad(ref, leaves, g.double())):
                _assert_close(a, r, dtype, "unfused grad", grad=True)
    x = torch.randn(70000, 3, 5, device="cuda")  # batch past gridDim.z's 65535
    assert torch.equal(OPS.transpose_last2(x), x.transpose(1, 2).contiguous())


@requires_cuda
@requires_caching_allocator
def test_cuda_memory_linear_in_sequence_length():
    # Peak memory above the live inputs, forward and forward+backward: linear in S
    # (doubling S about doubles it; the S x S scores would quadruple it).
    def peak(S, backward):
        q, k, v = make_qkv((1, 8), S, S, 128, 128, "cuda", torch.bfloat16, grad=backward)
        g = torch.randn(1, 8, S, 128, device="cuda", dtype=torch.bfloat16)
        for _ in range(2):  # the second run is measured
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            out = gp.attention(q, k, v, causal=True)
            if backward:
                grads = torch.autograd.grad(out, (q, k, v), g)
                del grads
            torch.cuda.synchronize()
            p = torch.cuda.max_memory_allocated() - base
            del out
        return p

    for backward in (False, True):
        p1, p2 = peak(2048, backward), peak(8192, backward)
        assert p2 <= 4.6 * p1, f"backward={backward}: peak {p1} B at S=2048, {p2} B at S=8192 (not linear)"
        assert p2 < 8192 * 8192 * 8 * 2, "peak as large as the S x S bf16 scores"


@requires_cuda
def test_cuda_graph_capture():
    # Kernels on the current stream, no host sync, workspace from the caching allocator:
    # forward and backward capture into a CUDA graph and replay to the eager result.
    q, k, v = make_qkv((2, 4), 300, 300, 64, 64, "cuda", torch.bfloat16, grad=True)
    g = torch.randn(2, 4, 300, 64, device="cuda", dtype=torch.bfloat16)

    def step():
        out = gp.attention(q, k, v, causal=True)
        return (out, *torch.autograd.grad(out, (q, k, v), g))

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            eager = step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    with torch.no_grad():
        for t in (q, k, v):
            t.add_(0.5 * torch.randn_like(t))
    graph.replay()
    torch.cuda.synchronize()
    fresh = step()
    for a, b in zip(captured, fresh):
        torch.testing.assert_close(a, b)  # not bitwise: a backward may accumulate dq with atomics
    assert eager[0].shape == captured[0].shape


def _check_chain_ops(device, dtype, before=lambda: None):
    """The chain's kernels alone: tiles with tails in every dim, tiles fully above the
    diagonal (skipped), K = 0 and 1; before() runs ahead of each op (poisons memory on CUDA)."""
    for B, M, K, N in ((1, 1, 1, 1), (3, 31, 33, 65), (2, 64, 64, 64), (1, 100, 1, 37), (2, 7, 0, 9),
                       (1, 300, 128, 129), (4, 33, 257, 31)):
        a = torch.randn(B, M, K, device=device, dtype=torch.float64).to(dtype)
        b = torch.randn(B, K, N, device=device, dtype=torch.float64).to(dtype)
        ref = 0.7 * (a.double() @ b.double())
        for causal in (False, True):
            before()
            c = OPS.matmul(a, b, 0.7, causal)
            mask = torch.ones(M, N, dtype=torch.bool, device=device).triu(1)
            if causal:
                assert torch.isneginf(c[:, mask]).all()
            keep = ~mask if causal else torch.ones_like(mask)
            _assert_close(c[:, keep], ref[:, keep], dtype, f"matmul {(B, M, K, N)} causal={causal}")
        before()
        assert torch.equal(OPS.transpose_last2(a), a.transpose(-1, -2).contiguous())


@requires_cuda
@pytest.mark.parametrize("dtype", CUDA_DTYPES, ids=str)
def test_cuda_chain_ops_shapes(dtype):
    _check_chain_ops("cuda", dtype, _poison_cache)


@pytest.mark.parametrize("dtype", CUDA_DTYPES, ids=str)
def test_cpu_chain_ops_shapes(dtype):
    # The CPU chain takes every float dtype too (the fused CPU op only float32/float64).
    _check_chain_ops("cpu", dtype)


def _check_given(q, k, v, causal, scale, dtype, what):
    """Forward and backward of the fused op against the float64 math on the same inputs."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    g = torch.randn(*q.shape[:-1], v.shape[-1], device=q.device, dtype=torch.float64).to(dtype)
    _poison_cache()
    out = gp.attention(q, k, v, scale=scale, causal=causal)
    grads = torch.autograd.grad(out, (q, k, v), g)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = ref_attention(*leaves, scale=scale, causal=causal)
    _assert_close(out, ref, dtype, f"{what} out")
    for name, a, r in zip("qkv", grads, torch.autograd.grad(ref, leaves, g.double())):
        _assert_close(a, r, dtype, f"{what} d{name}", grad=True)


@requires_cuda
@pytest.mark.parametrize("dtype", CUDA_DTYPES, ids=str)
def test_cuda_online_softmax_rescaling(dtype):
    # Scores that grow along the keys move the row max into every new tile, so the
    # running output is rescaled at every step; large magnitudes stress exp overflow;
    # a peaked row (one key dominates) stresses the sum.
    torch.manual_seed(12)
    for D in (64, 128):
        for causal in (False, True):
            S = many(1000, 300)  # still several key tiles, each moving the row max
            q = torch.randn(2, 2, S, D, device="cuda", dtype=torch.float64)
            ramp = torch.linspace(0, 1, S, device="cuda", dtype=torch.float64)[:, None]
            k = torch.randn(2, 2, S, D, device="cuda", dtype=torch.float64) * 0.3 + ramp * q.mean(2, keepdim=True) * 8
            v = torch.randn(2, 2, S, D, device="cuda", dtype=torch.float64)
            _check_given(q.to(dtype), k.to(dtype), v.to(dtype), causal, None, dtype, f"ramp D={D} causal={causal}")
            big = (torch.randn(1, 2, 333, D, device="cuda", dtype=torch.float64) * 4).to(dtype)
            kb = (torch.randn(1, 2, 333, D, device="cuda", dtype=torch.float64) * 4).to(dtype)
            vb = torch.randn(1, 2, 333, D, device="cuda", dtype=torch.float64).to(dtype)
            _check_given(big, kb, vb, causal, None, dtype, f"large scores D={D} causal={causal}")
            _check_given(big, kb, vb, causal, 0.3, dtype, f"scale=0.3 D={D} causal={causal}")
    # Causal, Sq = 1: the one query sees key 0 only, so the output is v[0].
    q, k, v = make_qkv((3,), 1, 500, 64, 64, "cuda", dtype)
    _assert_close(gp.attention(q, k, v, causal=True)[:, 0], v[:, 0].double(), dtype, "causal Sq=1")


# ---- each forward kernel (the attention_fwd knob) and the default's choice -----------------
# The knob forces a kernel for fp16/bf16 at D = Dv in {64, 128} (gpu_puzzles.tuning.override);
# torch.profiler's kernel names show which one ran (gpu_puzzles.bench.attention.forward_kernels;
# that check is left out where the profiler records no kernels, as under compute-sanitizer).
# "wgmma" / "wgmma3": the sm_90a kernel (attention_fwd_sm90.cu) with 2 / 3 warpgroups; "ws" its
# warp-specialised, TMA-fed variant (same file), "ws2" that with each consumer's GEMMs overlapping
# its softmax, "ws3" ws2 with the consumers taking turns to issue their GEMMs, "ws192" ws3 with
# three consumers (D = 64 only: at D = 128 it runs ws3).
# (attention_fwd, attention_fwd_warps) -> the label forward_kernel gives the kernel that runs.
FWD_KNOBS = [("mma", "4"), ("mma", "8"), ("mma_r32", None), ("wgmma", None), ("wgmma3", None), ("ws", None),
             ("ws2", None), ("ws3", None), ("ws192", None)]
_FWD_LABEL = {("mma", "4"): "mma/w4", ("mma", "8"): "mma/w8", ("mma_r32", None): "mma_r32",
              ("wgmma", None): "wgmma", ("wgmma3", None): "wgmma3", ("ws", None): "ws", ("ws2", None): "ws2",
              ("ws3", None): "ws3", ("ws192", None): "ws192"}


def _fwd_label(knobs, D):
    """The label of the kernel that knobs force at head dim D (three consumers: D = 64 only)."""
    want = _FWD_LABEL[knobs]
    return "ws3" if want == "ws192" and D != 64 else want
# (lead, Sq, Sk, D): S < BN (32/64), lengths not multiples of BM (64/128/256) or BN, exact
# multiples, Sq != Sk both ways (causal stays top-left aligned), one query, one key.
CFG_SHAPES = [((1,), 1, 1, 64), ((2,), 5, 17, 128), ((2, 3), 31, 33, 64), ((2,), 33, 129, 128),
              ((1, 4), 129, 33, 64), ((2,), 127, 255, 128), ((1, 2), 255, 127, 64), ((2,), 128, 128, 64),
              ((2,), 256, 256, 128), ((1, 2), 257, 257, 128), ((1, 2), 300, 700, 64), ((1,), 700, 300, 128),
              ((1,), 1000, 1000, 128), ((1,), 1, 300, 64), ((1,), 300, 1, 128), ((2,), 513, 511, 64)]
# wgmma (64 query rows per warpgroup, BM = 128 or 192 per CTA, BN = 64 or 128 keys per tile;
# causal at BM = 192, tiles wholly above a warpgroup's rows: 257 and 1000 rows):
# lengths around the warpgroup, CTA and tile edges, one row/key, several tiles; every pair, so
# Sq != Sk both ways.
WGMMA_LENS = [1, 63, 65, 127, 129, 193, 257, 1000]


def _built_with_sm90_attn():
    """Whether the loaded extension contains the wgmma forward."""
    return "csrc/attention/attention_fwd_sm90.cu" in gp.build_info()["sm90a_sources"]


def _skip_unless_wgmma():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the wgmma forward needs a compute capability 9.x device")
    if not _built_with_sm90_attn():
        pytest.skip("extension built without the CUTLASS headers (no wgmma forward)")


def _assert_ran(kernels, fn, want, what):
    """fn() launches exactly one of the attention kernels that `kernels` (forward_kernels or
    backward_kernels) labels, the one labelled `want`."""
    ran = kernels(fn)
    if ran is not None:  # None: the profiler records no kernels here
        assert ran == [want], f"{what}: {kernels.__name__} {ran}, want [{want!r}]"


def _assert_forward_kernel(fn, want, what):
    _assert_ran(forward_kernels, fn, want, what)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("knobs", FWD_KNOBS, ids=lambda k: k[0] + (f"-w{k[1]}" if k[1] else ""))
def test_cuda_forward_configs(knobs, dtype):
    # Output, lse (directly and through the backward's gradients) vs float64, on poisoned memory,
    # with the forward forced to one kernel; every call must have run that kernel.
    fwd, warps = knobs
    wgmma = fwd.startswith("wgmma") or fwd.startswith("ws")
    if wgmma:
        _skip_unless_wgmma()

    def check(lead, Sq, Sk, D, causal, what, scale=None):
        _assert_forward_kernel(lambda: _cuda_check(lead, Sq, Sk, D, D, causal, dtype, what, scale=scale),
                               _fwd_label(knobs, D), what)

    with gp.tuning.override(attention_fwd=fwd, attention_fwd_warps=warps):
        for lead, Sq, Sk, D in CFG_SHAPES:
            for causal in (False, True):
                check(lead, Sq, Sk, D, causal, f"{lead} Sq={Sq} Sk={Sk} D={D} causal={causal} {dtype}")
        check((2,), 70, 90, 128, True, "scale=1.0", scale=1.0)
        check((1, 2), 4100, 4100, 128, True, "S=4100 D=128 causal")
        if wgmma:
            for i, Sq in enumerate(WGMMA_LENS):
                for j, Sk in enumerate(WGMMA_LENS):
                    lead = (2,) if (i + j) % 2 == 0 else (1, 3)
                    for D in (64, 128):
                        for causal in (False, True):
                            check(lead, Sq, Sk, D, causal,
                                  f"wgmma {lead} Sq={Sq} Sk={Sk} D={D} causal={causal} {dtype}")
            # Sk = 0 is answered on the host (o = 0, lse = -inf) without any kernel.
            q, k, v = make_qkv((2,), 65, 0, 64, 64, "cuda", dtype)
            _poison_cache()
            out, lse = OPS.attention(q, k, v, None, False)
            assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
        test_cuda_online_softmax_rescaling(dtype)


# (BH, S, D, causal) for the default's kernel choice: D = 64 (mma.sync), D = 128 tiny, few CTAs
# (2 warpgroups fill the waves better on a 132-SM H100/H200) and many (3 warpgroups).
AUTO_CASES = [(2, 300, 64, False), (2, 300, 64, True), (2, 300, 128, False), (2, 300, 128, True),
              (64, 512, 64, False), (160, 512, 128, True), (16, 1024, 64, True),
              (16, 1024, 128, False), (16, 1024, 128, True), (128, 2048, 128, False), (8, 2048, 64, True)]


def _auto_warpgroups(BH, S, sms):
    """The documented default (attention_fwd_plan, attention_plan.cu): 3 warpgroups (192 rows per
    CTA) unless 2 (128 rows) fill the waves of one-CTA-per-SM grids better by more than 1.075x."""
    def fill(ctas):
        return ctas / (-(-ctas // sms) * sms)
    return 3 if 1.075 * fill(BH * -(-S // 192)) >= fill(BH * -(-S // 128)) else 2


def _auto_forward(BH, S, D, sms, broadcast_kv=False):
    """The documented default (attention_fwd_plan): ws3 from 1024 keys, or from 512 where its
    128-row CTAs fill two waves (ws192 at D = 64 from 2048 query rows); else wgmma (warpgroups
    as above) at D = 128, mma/w8 at 64."""
    if not broadcast_kv and (S >= 1024 or (S >= 512 and BH * -(-S // 128) >= 2 * sms)):
        return "ws192" if D == 64 and S >= 2048 else "ws3"
    return ("wgmma3" if _auto_warpgroups(BH, S, sms) == 3 else "wgmma") if D == 128 else "mma/w8"


@requires_cuda
def test_cuda_auto_forward_kernel():
    # Which forward kernel the default (no knob set) takes on a 9.x GPU in a CUTLASS build,
    # and with k/v heads broadcast (stride 0), which TMA cannot describe.
    _skip_unless_wgmma()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    with gp.tuning.override(attention_fwd=None, attention_fwd_warps=None):
        for BH, S, D, causal in AUTO_CASES:
            q, k, v = (torch.randn(BH, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            _assert_forward_kernel(lambda: gp.attention(q, k, v, causal=causal), _auto_forward(BH, S, D, sms),
                                   f"BH={BH} S={S} D={D} causal={causal}")
            q = q.view(1, BH, S, D)
            k, v = (t[:1].view(1, 1, S, D).expand(1, BH, S, D) for t in (k, v))
            _assert_forward_kernel(lambda: OPS.attention(q, k, v, None, causal), _auto_forward(BH, S, D, sms, True),
                                   f"broadcast k/v BH={BH} S={S} D={D} causal={causal}")
    if sms == 132:  # H100 SXM / H200: the cases take every default
        assert {_auto_forward(BH, S, D, sms, b) for BH, S, D, _ in AUTO_CASES for b in (False, True)} == {
            "ws3", "ws192", "wgmma", "wgmma3", "mma/w8"}
        assert {_auto_warpgroups(BH, S, sms) for BH, S, D, _ in AUTO_CASES if D == 128} == {2, 3}


@requires_cuda
def test_cuda_forward_kernel_fallbacks():
    # What the tensor-core kernels do not take runs the SIMT kernel whatever the knob says
    # (fp32, D != Dv, D = 96, a misaligned base); the default at D = 128 off a 9.x GPU (or in a
    # build without the wgmma kernel) is mma_r32, and a forced wgmma falls back to it there.
    q, k, v = make_qkv((2,), 40, 40, 64, 64, "cuda", torch.float32)
    for fwd in (None, "mma", "wgmma"):
        with gp.tuning.override(attention_fwd=fwd):
            _assert_forward_kernel(lambda: gp.attention(q, k, v), "simt", f"fp32 attention_fwd={fwd}")
    for D, Dv in ((64, 32), (96, 96)):
        q, k, v = make_qkv((2,), 40, 40, D, Dv, "cuda", torch.bfloat16)
        with gp.tuning.override(attention_fwd="mma_r32"):
            _assert_forward_kernel(lambda: gp.attention(q, k, v), "simt", f"D={D} Dv={Dv}")
    q = make_tensor((2, 40, 64), torch.bfloat16, "cuda", OFFSET)  # contiguous, misaligned base
    k, v = (torch.randn(2, 40, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    with gp.tuning.override(attention_fwd="mma"):
        _assert_forward_kernel(lambda: OPS.attention(q, k, v, None, False), "mma/w8", "misaligned q (copied)")
    if torch.cuda.get_device_capability()[0] != 9 or not _built_with_sm90_attn():
        q, k, v = make_qkv((2,), 300, 300, 128, 128, "cuda", torch.bfloat16)
        for fwd in (None, "wgmma", "wgmma3"):
            with gp.tuning.override(attention_fwd=fwd):
                _assert_forward_kernel(lambda: gp.attention(q, k, v), "mma_r32", f"attention_fwd={fwd}")


# ---- layouts: views taken where they lie, outputs in the inputs' memory order --------------
# Models hand attention views: q/k/v split out of a fused (B, S, 3 H D) projection and
# transposed to (B, H, S, D); (B, S, H, D) tensors transposed; slices of a (BH, S, 3 D) tensor.
# The CUDA kernels read them without a copy and write out (and dq, dk, dv) dense in the memory
# order of q (k, v), so the model's out.transpose(1, 2).reshape(B, S, H * D) is a view.

def _layout_qkv(layout, B, H, S, D, device, dtype, seed=0):
    """(q, k, v, how out/dq/dk/dv must be laid out: 'bshd' (memory (B, S, H, D)) or 'contiguous')."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)  # noqa: E731
    if layout == "qkv_proj":
        qkv = mk(B, S, 3 * H * D)
        q, k, v = (t.view(B, S, H, D).transpose(1, 2) for t in qkv.split(H * D, dim=2))
        return q, k, v, "bshd"
    if layout == "bshd":
        q, k, v = (mk(B, S, H, D).transpose(1, 2) for _ in range(3))
        return q, k, v, "bshd"
    if layout == "bh_slice":
        base = mk(B * H, S, 3 * D)
        q, k, v = base[..., :D], base[..., D:2 * D], base[..., 2 * D:]
        return q, k, v, "contiguous"
    raise ValueError(layout)


def _assert_layout(t, want, what):
    ok = t.transpose(1, 2).is_contiguous() if want == "bshd" else t.is_contiguous()
    assert ok, f"{what}: strides {t.stride()} for shape {tuple(t.shape)}, want {want} memory order"


LAYOUTS = ["qkv_proj", "bshd", "bh_slice"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cpu_strided_layouts(layout):
    # CPU: same output strides rule as CUDA (the fake kernels are device-agnostic), values vs float64.
    for dtype in (torch.float32, torch.float64):
        for causal in (False, True):
            q, k, v, want = _layout_qkv(layout, 2, 3, 19, 16, "cpu", dtype, seed=3)
            assert not q.is_contiguous()
            out, lse = OPS.attention(q, k, v, None, causal)
            _assert_layout(out, want, f"{layout} out")
            _assert_close(out, ref_attention(q, k, v, causal=causal), dtype, f"{layout} out")
            g = torch.randn_like(out)
            if want == "bshd":
                g = torch.randn(2, 19, 3, 16, dtype=dtype).transpose(1, 2)  # the model's grad layout
            grads = OPS.attention_backward(g, q, k, v, out, lse, None, causal)
            leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
            refs = torch.autograd.grad(ref_attention(*leaves, causal=causal), leaves, g.double())
            for name, a, r in zip("qkv", grads, refs):
                _assert_layout(a, want, f"{layout} d{name}")
                _assert_close(a, r, dtype, f"{layout} d{name}", grad=True)


@pytest.mark.parametrize("device", DEVICES)
def test_rank5_order_fallback(device):
    # A rank-5 order whose batch dims do not collapse into one stride: the kernels read a copy
    # and write a scratch copied into out, which still follows q's memory order (A, S, B, H, D).
    dtype = torch.float64
    base = torch.randn(2, 9, 2, 3, 8, dtype=dtype, device=device)  # (A, S, B, H, D)
    q = base.permute(0, 2, 3, 1, 4)  # (A, B, H, S, D)
    k, v = torch.randn(2, 2, 3, 11, 8, dtype=dtype, device=device), torch.randn(2, 2, 3, 11, 8, dtype=dtype,
                                                                                device=device)
    out, lse = OPS.attention(q, k, v, None, True)
    assert out.permute(0, 3, 1, 2, 4).is_contiguous(), out.stride()
    _assert_close(out, ref_attention(q, k, v, causal=True), dtype, "rank 5 out")
    g = torch.randn_like(out)
    dq, dk, dv = OPS.attention_backward(g, q, k, v, out, lse, None, True)
    assert dq.permute(0, 3, 1, 2, 4).is_contiguous() and dk.is_contiguous() and dv.is_contiguous()
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    refs = torch.autograd.grad(ref_attention(*leaves, causal=True), leaves, g)
    for name, a, r in zip("qkv", (dq, dk, dv), refs):
        _assert_close(a, r, dtype, f"rank 5 d{name}", grad=True)
    torch.library.opcheck(OPS.attention.default, (q, k, v, None, True))


def _assert_fake_strides(op, args, real):
    """The fake kernel's outputs have the real ones' strides (opcheck checks only ops with a meta
    kernel of their own, so it skips ours)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fake = op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    for i, (f, r) in enumerate(zip(fake, real)):
        assert f.shape == r.shape and f.stride() == r.stride(), \
            f"{op} output {i}: fake strides {f.stride()}, real {r.stride()} (shape {tuple(r.shape)})"


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_strided(device):
    # Strided inputs through opcheck, and the fakes' strides equal the real kernels', forward and backward.
    cases = [_layout_qkv(layout, 2, 2, 7, 8, device, torch.float32, seed=1)[:3] for layout in LAYOUTS]
    base = torch.randn(2, 9, 2, 3, 8, device=device)
    cases.append((base.permute(0, 2, 3, 1, 4), *(torch.randn(2, 2, 3, 11, 8, device=device) for _ in range(2))))
    cases.append((torch.randn(8, device=device), torch.randn(5, 8, device=device), torch.randn(5, 3, device=device)))
    for i, (q, k, v) in enumerate(cases):
        torch.library.opcheck(OPS.attention.default, (q, k, v, None, True))
        with torch.no_grad():
            out, lse = OPS.attention(q, k, v, None, True)
        _assert_fake_strides(OPS.attention.default, (q, k, v, None, True), (out, lse))
        g = torch.randn(2, 7, 2, 8, device=device).transpose(1, 2) if i < 2 else torch.randn_like(out)
        args = (g, q, k, v, out, lse, None, True)
        torch.library.opcheck(OPS.attention_backward.default, args)
        _assert_fake_strides(OPS.attention_backward.default, args, OPS.attention_backward(*args))


def test_model_transpose_back_is_a_view():
    # out.transpose(1, 2).reshape(B, S, H * D), as GPT-2 does after attention: no copy.
    B, H, S, D = 2, 3, 10, 8
    q, k, v, _ = _layout_qkv("qkv_proj", B, H, S, D, "cpu", torch.float32)
    out = gp.attention(q, k, v, causal=True)
    y = out.transpose(1, 2).reshape(B, S, H * D)
    assert y.data_ptr() == out.data_ptr() and y._base is not None


@requires_cuda
@pytest.mark.parametrize("D", [64, 128, 33])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_strided_layouts(layout, D):
    # Strided q/k/v (and grad_out in the model's layout): no copy kernel, output and gradient
    # strides in the inputs' memory order, results bitwise equal to the same call on contiguous
    # copies (the same kernel runs, in the same order), on poisoned memory; values vs float64.
    B, H, S = 2, 3, 100
    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    for i, dtype in enumerate(many(dtypes, dtypes[D % 3:D % 3 + 1])):
        for causal in (False, True):
            what = f"{layout} D={D} {dtype} causal={causal}"
            q, k, v, want = _layout_qkv(layout, B, H, S, D, "cuda", dtype, seed=D + i)
            _poison_cache()
            (out, lse), copies = copy_kernels(OPS.attention.default, q, k, v, None, causal)
            assert copies == [], f"{what}: forward copies {copies}"
            _assert_layout(out, want, f"{what} out")
            qc, kc, vc = (t.contiguous() for t in (q, k, v))
            out_c, lse_c = OPS.attention(qc, kc, vc, None, causal)
            assert torch.equal(out, out_c) and torch.equal(lse, lse_c), f"{what}: out/lse differ from contiguous"
            if i == 0:
                _assert_close(out, ref_attention(q, k, v, causal=causal), dtype, f"{what} out")
            if want == "bshd":
                g = torch.randn(B, S, H, D, device="cuda", dtype=dtype).transpose(1, 2)
            else:
                g = torch.randn(B * H, S, D, device="cuda", dtype=dtype)
            _poison_cache()
            grads, copies = copy_kernels(OPS.attention_backward.default, g, q, k, v, out, lse, None, causal)
            assert copies == [], f"{what}: backward copies {copies}"
            grads_c = OPS.attention_backward(g.contiguous(), qc, kc, vc, out_c, lse_c, None, causal)
            for name, a in zip("qkv", grads):
                _assert_layout(a, want, f"{what} d{name}")
            _assert_same_grads(grads, grads_c, f"{what} vs the contiguous call")
            if i == 0:
                leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
                refs = torch.autograd.grad(ref_attention(*leaves, causal=causal), leaves, g.double())
                for name, a, r in zip("qkv", grads, refs):
                    _assert_close(a, r, dtype, f"{what} d{name}", grad=True)


@requires_cuda
@pytest.mark.parametrize("fwd", ["ws", "ws2", "ws3", "ws192"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_ws_strided_layouts(layout, D, fwd):
    # The warp-specialised forward reads the views through its TMA descriptors' strides: no
    # copy, the ws kernel ran, out/lse bitwise equal to the ws call on contiguous copies, values
    # vs float64; sequence lengths off the 128-row tiles.
    _skip_unless_wgmma()
    for S, causal in ((100, False), (300, True), (257, False)):
        what = f"{fwd} {layout} D={D} S={S} causal={causal}"
        q, k, v, want = _layout_qkv(layout, 2, 3, S, D, "cuda", torch.bfloat16, seed=D + S)
        with gp.tuning.override(attention_fwd=fwd):
            _poison_cache()
            (out, lse), copies = copy_kernels(OPS.attention.default, q, k, v, None, causal)
            assert copies == [], f"{what}: forward copies {copies}"
            _assert_forward_kernel(lambda: OPS.attention(q, k, v, None, causal), _fwd_label((fwd, None), D), what)
            _assert_layout(out, want, f"{what} out")
            out_c, lse_c = OPS.attention(*(t.contiguous() for t in (q, k, v)), None, causal)
        assert torch.equal(out, out_c) and torch.equal(lse, lse_c), f"{what}: out/lse differ from contiguous"
        _assert_close(out, ref_attention(q, k, v, causal=causal), torch.bfloat16, f"{what} out")


def _grid_cases(label, small):
    """(what, q, k, v, causal) for the persistent-grid tests: grids of many more blocks than SMs,
    causal and full, GQA, tails, Sq != Sk, then `small` (B, H, Hkv, Sq, Sk, D, causal), whose values
    the tests also check against float64 (Sq = 129)."""
    for (B, H, Hkv, Sq, Sk, D, causal) in [(4, 40, 40, 1000, 1000, 64, True), (3, 24, 8, 700, 1100, 128, True),
                                           (2, 30, 30, 513, 257, 128, False), (5, 16, 4, 1500, 900, 64, False),
                                           small]:
        q = torch.randn(B, H, Sq, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(B, Hkv, Sk, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        yield f"{label} B={B} H={H}/{Hkv} Sq={Sq} Sk={Sk} D={D} causal={causal}", q, k, v, causal


@requires_cuda
@pytest.mark.parametrize("fwd", ["ws", "ws2", "ws3", "ws192"])
def test_cuda_ws_persistent_grid(fwd):
    # attention_fwd_grid=persistent: one CTA an SM, each running its share of the query blocks
    # (a Q buffer and the K/V ring carried from block to block). Every block is computed as with
    # one CTA a block, so out and lse are bitwise equal; grids of many more blocks than SMs,
    # causal and full, GQA, tails, Sq != Sk; values vs float64 on one.
    _skip_unless_wgmma()
    for what, q, k, v, causal in _grid_cases(fwd, (1, 2, 2, 129, 129, 64, True)):
        H, Hkv, Sq, D = q.shape[1], k.shape[1], q.shape[2], q.shape[3]
        res = {}
        for grid in ("blocks", "persistent"):
            with gp.tuning.override(attention_fwd=fwd, attention_fwd_grid=grid):
                _poison_cache()
                _assert_forward_kernel(lambda: OPS.attention(q, k, v, None, causal, H != Hkv),
                                       _fwd_label((fwd, None), D), what)
                res[grid] = OPS.attention(q, k, v, None, causal, H != Hkv)
        for name, a, b in zip(("out", "lse"), res["persistent"], res["blocks"]):
            assert torch.equal(a, b), f"{what}: persistent {name} differs from one CTA a block"
        if Sq == 129:
            _assert_close(res["persistent"][0], ref_attention(q, k, v, causal=causal), torch.bfloat16, f"{what} out")


@requires_cuda
def test_cuda_ws_expanded_heads_fall_back():
    # k and v expanded over the heads (stride 0): no TMA descriptor takes that, so a forced
    # "ws*" (or the default) runs another tensor-core kernel, with the right values.
    _skip_unless_wgmma()
    q = torch.randn(2, 4, 150, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 1, 150, 128, device="cuda", dtype=torch.bfloat16).expand(2, 4, 150, 128) for _ in range(2))
    for fwd in (None, "ws", "ws2", "ws3", "ws192"):
        with gp.tuning.override(attention_fwd=fwd):
            ran = forward_kernels(lambda: OPS.attention(q, k, v, None, True))
            out, _ = OPS.attention(q, k, v, None, True)
        assert ran is None or (len(ran) == 1 and not ran[0].startswith("ws")), ran
        _assert_close(out, ref_attention(q, k, v, causal=True), torch.bfloat16, f"expanded k/v, {fwd}")


# ---- each backward kernel (the attention_bwd knob) and the default's choice ----------------
# "wgmma": the warp-specialised sm_90a backward (attention_bwd_sm90.cu: 128 keys a CTA, 64 per
# consumer warpgroup, query blocks of 64 rows, dq summed in float32 out of order; at D = 64 its dQ
# GEMM split by column halves, "wgmma_split", or taken in turns by the consumers, "wgmma_turns",
# as the shape decides under "wgmma"); "mma": the two deterministic mma.sync passes
# (attention_bwd_sm80.cu).
BWD_LENS = [1, 63, 65, 127, 129, 255, 300]


def _assert_backward_kernel(fn, want, what):
    _assert_ran(backward_kernels, fn, want.split("_")[0], what)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("bwd", ["mma", "wgmma", "wgmma_split", "wgmma_turns"])
def test_cuda_backward_configs(bwd, dtype):
    # Gradients vs float64 on poisoned memory with the backward forced to one kernel, at lengths
    # around its key block, query block and warpgroup edges (Sq != Sk both ways), and GQA groups.
    if bwd.startswith("wgmma"):
        _skip_unless_wgmma()
    with gp.tuning.override(attention_bwd=bwd):
        for i, Sq in enumerate(BWD_LENS):
            for j, Sk in enumerate(BWD_LENS):
                lead = (2,) if (i + j) % 2 == 0 else (1, 3)
                for D in (64, 128):
                    for causal in (False, True):
                        what = f"{bwd} {lead} Sq={Sq} Sk={Sk} D={D} causal={causal} {dtype}"
                        _assert_backward_kernel(lambda: _cuda_check(lead, Sq, Sk, D, D, causal, dtype, what), bwd,
                                                what)
        for (H, Hkv), (Sq, Sk), D in [((4, 2), (129, 200), 64), ((8, 1), (257, 257), 128), ((6, 3), (65, 300), 128)]:
            for causal in (False, True):
                what = f"{bwd} H={H} Hkv={Hkv} Sq={Sq} Sk={Sk} D={D} causal={causal} {dtype}"
                q, k, v = make_gqa(2, H, Hkv, Sq, Sk, D, "cuda", dtype, seed=Sq + D)
                _poison_cache()
                _assert_backward_kernel(lambda: _check_gqa(q, k, v, causal, dtype, what), bwd, what)


@requires_cuda
def test_cuda_auto_backward_kernel():
    # The documented default (attention_bwd_plan): the wgmma backward on a 9.x GPU with the sm_90a
    # build, else mma; the deterministic mma passes under torch.use_deterministic_algorithms, bitwise
    # reproducible there.
    q, k, v = make_qkv((2, 3), 300, 300, 128, 128, "cuda", torch.bfloat16, seed=5)
    g = torch.randn_like(q)
    out, lse = OPS.attention(q, k, v, None, True)
    call = lambda: OPS.attention_backward(g, q, k, v, out, lse, None, True)  # noqa: E731
    sm90 = torch.cuda.get_device_capability()[0] == 9 and _built_with_sm90_attn()
    prev = torch.are_deterministic_algorithms_enabled()
    prev_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    with gp.tuning.override(attention_bwd=None):
        try:
            torch.use_deterministic_algorithms(False)
            _assert_backward_kernel(call, "wgmma" if sm90 else "mma", "default")
            torch.use_deterministic_algorithms(True)
            _assert_backward_kernel(call, "mma", "deterministic")
            first = call()
            for name, a, b in zip("qkv", first, call()):
                assert torch.equal(a, b), f"deterministic: d{name} differs run to run"
        finally:
            torch.use_deterministic_algorithms(prev, warn_only=prev_warn)


@requires_cuda
def test_cuda_wgmma_backward_falls_back():
    # Operands the backward's TMA cannot describe (k/v expanded over the heads, stride 0) take
    # the mma passes even when wgmma is forced, with the right values.
    _skip_unless_wgmma()
    q = torch.randn(2, 4, 150, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 1, 150, 128, device="cuda", dtype=torch.bfloat16).expand(2, 4, 150, 128) for _ in range(2))
    out, lse = OPS.attention(q, k, v, None, True)
    g = torch.randn_like(out)
    with gp.tuning.override(attention_bwd="wgmma"):
        _assert_backward_kernel(lambda: OPS.attention_backward(g, q, k, v, out, lse, None, True), "mma", "expanded")
        grads = OPS.attention_backward(g, q, k, v, out, lse, None, True)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    refs = torch.autograd.grad(ref_attention(*leaves, causal=True), leaves, g.double())
    for name, a, r in zip("qkv", grads, refs):
        _assert_close(a, r, torch.bfloat16, f"expanded k/v d{name}", grad=True)


@requires_cuda
@pytest.mark.parametrize("bwd", ["wgmma_split", "wgmma_turns"])
def test_cuda_wgmma_backward_persistent_grid(bwd):
    # attention_bwd_grid=persistent: one CTA an SM, each running its share of the key blocks (the
    # Q / dO ring carried on, K / V reloaded once released). Each block is computed as with one
    # CTA a block: dk and dv bitwise equal, dq within rounding (float32 atomics in any order);
    # grids of many more key blocks than SMs, causal and full, GQA, tails, Sq != Sk; values vs
    # float64 on one.
    _skip_unless_wgmma()
    for what, q, k, v, causal in _grid_cases(bwd, (2, 3, 3, 129, 300, 64, True)):
        H, Hkv, Sq = q.shape[1], k.shape[1], q.shape[2]
        out, lse = OPS.attention(q, k, v, None, causal, H != Hkv)
        g = torch.randn_like(out)
        res = {}
        for grid in ("blocks", "persistent"):
            with gp.tuning.override(attention_bwd=bwd, attention_bwd_grid=grid):
                _poison_cache()
                call = lambda: OPS.attention_backward(g, q, k, v, out, lse, None, causal, H != Hkv)  # noqa: E731
                _assert_backward_kernel(call, "wgmma", what)
                res[grid] = call()
        _assert_same_grads(res["persistent"], res["blocks"], f"{what}: persistent vs one CTA a block")
        if Sq == 129:
            leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
            refs = torch.autograd.grad(ref_attention(*leaves, causal=causal), leaves, g.double())
            for name, a, r in zip("qkv", res["persistent"], refs):
                _assert_close(a, r, torch.bfloat16, f"{what} d{name}", grad=True)


@requires_cuda
@pytest.mark.parametrize("D", [64, 128])
def test_cuda_wgmma_backward_unaligned_o(D):
    # o's rows need no alignment: the backward's delta kernel reads them by 16-byte loads only
    # where they are aligned, element by element otherwise, in the same order of sums; so dk and
    # dv (which depend on o only through delta) match the aligned call bit for bit.
    _skip_unless_wgmma()
    q, k, v = make_qkv((2, 3), 200, 200, D, D, "cuda", torch.bfloat16, seed=D)
    out, lse = OPS.attention(q, k, v, None, True)
    g = torch.randn_like(out)
    odd = torch.full((2, 3, 200, D + 1), float("nan"), device="cuda", dtype=out.dtype)[..., 1:]
    odd.copy_(out)  # row stride D + 1 elements: no row is 16-byte aligned past the first
    with gp.tuning.override(attention_bwd="wgmma"):
        _assert_backward_kernel(lambda: OPS.attention_backward(g, q, k, v, odd, lse, None, True), "wgmma", "odd o")
        dq, dk, dv = OPS.attention_backward(g, q, k, v, odd, lse, None, True)
        _, dk_a, dv_a = OPS.attention_backward(g, q, k, v, out, lse, None, True)
    assert torch.equal(dk, dk_a) and torch.equal(dv, dv_a), "unaligned o changed delta"
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    refs = torch.autograd.grad(ref_attention(*leaves, causal=True), leaves, g.double())
    for name, a, r in zip("qkv", (dq, dk, dv), refs):
        _assert_close(a, r, torch.bfloat16, f"unaligned o d{name}", grad=True)


@requires_cuda
@pytest.mark.parametrize("B, H, Hkv, S, D", [(1, 11, 11, 4096, 128), (1, 40, 20, 2048, 64)], ids=str)
def test_cuda_causal_block_order(B, H, Hkv, S, D):
    # The sm_90a causal grids run heaviest blocks first over chunks of (batch, head) rows
    # (attention_common.cuh: BlockOrder, chunk_rows; knob attention_order). On a 132-SM GPU these
    # shapes make chunks of several rows with a shorter last one (forward 6 + 5 rows at D = 128,
    # backward 4 + 4 + 3 and 7 + 7 + 6 kv heads). Both orders match float64, and each other: the
    # forward bitwise.
    _skip_unless_wgmma()
    q, k, v = make_gqa(B, H, Hkv, S, S, D, "cuda", torch.bfloat16, seed=S + H)
    runs = {}
    for order in ("rows", "longest"):
        with gp.tuning.override(attention_order=order):
            what = f"order={order} B={B} H={H} Hkv={Hkv} S={S} D={D}"
            _poison_cache()
            runs[order] = _check_gqa(q, k, v, True, torch.bfloat16, what)
    o_r, lse_r, g_r = runs["rows"]
    o_l, lse_l, g_l = runs["longest"]
    assert torch.equal(o_r, o_l) and torch.equal(lse_r, lse_l), "forward differs between block orders"
    _assert_same_grads(g_l, g_r, "block orders")


@requires_cuda
def test_cuda_strided_takes_tensor_cores_and_copies_misaligned_rows():
    # The qkv views run the tensor-core kernel in place; a view whose row stride is not a
    # multiple of 16 bytes (bf16 rows 68 elements apart) is copied, and then runs it too.
    q, k, v, _ = _layout_qkv("qkv_proj", 2, 3, 100, 64, "cuda", torch.bfloat16)
    with gp.tuning.override(attention_fwd="mma", attention_fwd_warps="8"):
        _assert_forward_kernel(lambda: OPS.attention(q, k, v, None, True), "mma/w8", "qkv views")
        qm = torch.randn(2, 3, 100, 68, device="cuda", dtype=torch.bfloat16)[..., :64]
        _assert_forward_kernel(lambda: OPS.attention(qm, k, v, None, True), "mma/w8", "misaligned rows")
        (out, _), copies = copy_kernels(OPS.attention.default, qm, k, v, None, True)
        assert copies or SANITIZE, "a 136-byte row stride must be copied for the 16-byte loads"
        assert torch.equal(out, OPS.attention(qm.contiguous(), k, v, None, True)[0])


def test_compile_strided_model_block():
    # The model's block under torch.compile(fullgraph, dynamic): fused projection, split, views,
    # attention, transpose back; the fakes' layout rule traces on symbolic strides, and values
    # and gradients match eager.
    device = "cuda" if HAS_CUDA else "cpu"
    H, D = 2, 16

    def block(x, w):
        B, S, _ = x.shape
        q, k, v = (t.view(B, S, H, D).transpose(1, 2) for t in (x @ w).split(H * D, dim=2))
        return gp.attention(q, k, v, causal=True).transpose(1, 2).reshape(B, S, H * D)

    cases = []
    for S in (16, 23):
        g = torch.Generator().manual_seed(S)
        x = torch.randn(2, S, 24, generator=g).to(device).requires_grad_()
        w = torch.randn(24, 3 * H * D, generator=g).to(device).requires_grad_()
        cases.append(((x, w), (x, w)))
    assert_compiled_matches_eager(block, cases)


# ---- grouped k/v heads (GQA / MQA, enable_gqa) ---------------------------------------
# k and v with Hkv heads, Hkv dividing q's H: query head h uses kv head h // (H // Hkv). The
# reference repeats k and v over each group (then their float64 gradients are the sums over
# the group's query heads, what dk and dv must hold); the op itself never repeats them.

def ref_gqa(q, k, v, scale=None, causal=False):
    group = q.shape[-3] // k.shape[-3]
    return ref_attention(q, k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3), scale=scale,
                         causal=causal)


def make_gqa(B, H, Hkv, Sq, Sk, D, device, dtype, grad=False, seed=0, layout="contiguous"):
    """q (B, H, Sq, D), k and v (B, Hkv, Sk, D); layout "bshd": (B, S, heads, D) tensors transposed,
    as a Llama-style model's separate q/k/v projections hand them over."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def mk(h, S):
        if layout == "bshd":
            t = torch.randn(B, S, h, D, generator=g, dtype=torch.float64)
            return t.to(device=device, dtype=dtype).transpose(1, 2)
        return torch.randn(B, h, S, D, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)

    return [t.requires_grad_(grad) for t in (mk(H, Sq), mk(Hkv, Sk), mk(Hkv, Sk))]


def _check_gqa(q, k, v, causal, dtype, what, scale=None, g=None):
    """Forward through the op, backward through attention_backward, both vs float64; returns the grads."""
    out, lse = OPS.attention(q, k, v, scale, causal, True)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = ref_gqa(*leaves, scale=scale, causal=causal)
    _assert_close(out, ref, dtype, f"{what} out")
    if g is None:
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64).to(out)
    if q.is_cuda:
        _poison_cache()
    grads = OPS.attention_backward(g, q.detach(), k.detach(), v.detach(), out, lse, scale, causal, True)
    refs = torch.autograd.grad(ref, leaves, g.double())
    for name, a, r, x in zip("qkv", grads, refs, (q, k, v)):
        assert a.shape == x.shape, f"{what} d{name}: shape {tuple(a.shape)}, want {tuple(x.shape)}"
        _assert_close(a, r, dtype, f"{what} d{name}", grad=True)
    return out, lse, grads


# (H, Hkv): plain multi-head (group 1), groups of 2 and 4, and multi-query (Hkv = 1).
GQA_HEADS = [(4, 4), (4, 2), (8, 2), (4, 1)]
# (Sq, Sk, D): odd lengths, Sq != Sk both ways, D 64 / 128 and an odd D.
GQA_SHAPES = [(7, 7, 16), (33, 9, 64), (9, 40, 128), (17, 17, 5)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", GQA_HEADS, ids=str)
@pytest.mark.parametrize("shape", GQA_SHAPES, ids=str)
def test_gqa_cpu_matches_reference(shape, heads, causal):
    (Sq, Sk, D), (H, Hkv) = shape, heads
    for dtype in (torch.float64, torch.float32):
        q, k, v = make_gqa(2, H, Hkv, Sq, Sk, D, "cpu", dtype, seed=Sq + H * Hkv)
        _check_gqa(q, k, v, causal, dtype, f"{shape} H={H} Hkv={Hkv} causal={causal} {dtype}")
    # F.scaled_dot_product_attention(enable_gqa=True), and the public function with its autograd.
    q, k, v = make_gqa(2, H, Hkv, Sq, Sk, D, "cpu", torch.float64, grad=True, seed=1)
    out = gp.attention(q, k, v, causal=causal, enable_gqa=True)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    _assert_close(out, ref, torch.float64, "vs SDPA enable_gqa")
    g = torch.randn_like(out)
    for name, a, r in zip("qkv", torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        _assert_close(a, r, torch.float64, f"d{name} vs SDPA enable_gqa", grad=True)


def test_gqa_cpu_long_rows():
    # Longer than the CPU kernels' key and query blocks, groups of 4 and MQA.
    for H, Hkv in ((8, 2), (4, 1)):
        for causal in (False, True):
            q, k, v = make_gqa(1, H, Hkv, 300, 600, 32, "cpu", torch.float32, seed=H)
            _check_gqa(q * 4, k, v, causal, torch.float32, f"H={H} Hkv={Hkv} causal={causal}")


@pytest.mark.parametrize("device", DEVICES)
def test_gqa_strided_views(device):
    # Llama's layout: separate projections viewed (B, S, heads, D) and transposed; and slices of
    # one fused projection. Results follow the inputs' memory order: dk, dv as k, v.
    dtype = torch.float64
    B, H, Hkv, S, D = 2, 4, 2, 13, 8
    q, k, v = make_gqa(B, H, Hkv, S, S, D, device, dtype, seed=2, layout="bshd")
    g = torch.randn(B, S, H, D, device=device, dtype=dtype).transpose(1, 2)
    out, lse, grads = _check_gqa(q, k, v, True, dtype, "bshd", g=g)
    for name, t in zip(("out", "dq", "dk", "dv"), (out, *grads)):
        _assert_layout(t, "bshd", f"gqa {name}")
    x = torch.randn(B, S, (H + 2 * Hkv) * D, device=device, dtype=dtype)
    q, k, v = x.split([H * D, Hkv * D, Hkv * D], dim=-1)
    q, k, v = (t.view(B, S, h, D).transpose(1, 2) for t, h in ((q, H), (k, Hkv), (v, Hkv)))
    out, lse, grads = _check_gqa(q, k, v, False, dtype, "fused projection", g=g)
    for name, t in zip(("out", "dq", "dk", "dv"), (out, *grads)):
        _assert_layout(t, "bshd", f"gqa fused projection {name}")


@pytest.mark.parametrize("device", DEVICES)
def test_gqa_gradcheck(device):
    for (H, Hkv), causal in (((4, 2), False), ((3, 1), True), ((2, 2), True)):
        q, k, v = make_gqa(1, H, Hkv, 5, 6, 3, device, torch.float64, grad=True, seed=H + Hkv)
        assert torch.autograd.gradcheck(lambda a, b, c: gp.attention(a, b, c, causal=causal, enable_gqa=True),
                                        (q, k, v))
    q, k, v = make_gqa(1, 4, 2, 4, 5, 3, device, torch.float64, grad=True)
    assert torch.autograd.gradcheck(
        lambda a, b, c: gp.attention(a, b, c, causal=True, enable_gqa=True, algorithm="unfused"), (q, k, v))


@pytest.mark.parametrize("device", DEVICES)
def test_gqa_opcheck_and_fake_strides(device):
    cases = [make_gqa(2, 4, 2, 5, 7, 8, device, torch.float32, seed=1),
             make_gqa(1, 3, 1, 6, 6, 8, device, torch.float32, seed=2, layout="bshd")]
    for q, k, v in cases:
        for causal in (False, True):
            torch.library.opcheck(OPS.attention.default, (q, k, v, None, causal, True))
            with torch.no_grad():
                out, lse = OPS.attention(q, k, v, None, causal, True)
            _assert_fake_strides(OPS.attention.default, (q, k, v, None, causal, True), (out, lse))
            args = (torch.randn_like(out), q, k, v, out, lse, None, causal, True)
            torch.library.opcheck(OPS.attention_backward.default, args)
            _assert_fake_strides(OPS.attention_backward.default, args, OPS.attention_backward(*args))
    q, k, v = make_gqa(2, 4, 2, 5, 7, 8, device, torch.float32, grad=True, seed=3)
    torch.library.opcheck(OPS.attention.default, (q, k, v, 0.5, True, True))


def test_gqa_compile():
    # fullgraph + dynamic over the sequence length, a Llama-style block: separate projections,
    # grouped k/v views, transpose back; values and gradients match eager.
    device = "cuda" if HAS_CUDA else "cpu"
    H, Hkv, D = 4, 2, 16

    def block(x, wq, wkv):
        B, S, _ = x.shape
        q = (x @ wq).view(B, S, H, D).transpose(1, 2)
        k, v = ((x @ wkv).view(B, S, 2 * Hkv, D).transpose(1, 2)).split(Hkv, dim=1)
        return gp.attention(q, k, v, causal=True, enable_gqa=True).transpose(1, 2).reshape(B, S, H * D)

    cases = []
    for S in (16, 23):
        g = torch.Generator().manual_seed(S)
        x = torch.randn(2, S, 24, generator=g).to(device).requires_grad_()
        wq = torch.randn(24, H * D, generator=g).to(device).requires_grad_()
        wkv = torch.randn(24, 2 * Hkv * D, generator=g).to(device).requires_grad_()
        cases.append(((x, wq, wkv), (x, wq, wkv)))
    assert_compiled_matches_eager(block, cases)


@pytest.mark.parametrize("device", DEVICES)
def test_gqa_bad_input(device):
    r = lambda *s: torch.randn(*s, device=device)  # noqa: E731
    cases = [
        (lambda: gp.attention(r(1, 4, 5, 8), r(1, 2, 6, 8), r(1, 2, 6, 8)),
         r"k has 2 heads \(dim -3\) but q has 4; they must be equal, or pass enable_gqa=True"),
        (lambda: gp.attention(r(1, 6, 5, 8), r(1, 4, 6, 8), r(1, 4, 6, 8), enable_gqa=True),
         r"with enable_gqa, q's heads \(6\) must be a multiple of k's and v's heads \(4"),
        (lambda: gp.attention(r(1, 4, 5, 8), r(1, 2, 6, 8), r(1, 1, 6, 8), enable_gqa=True),
         r"v has 1 heads \(dim -3\) but k has 2"),
        (lambda: gp.attention(r(2, 4, 5, 8), r(1, 2, 6, 8), r(1, 2, 6, 8), enable_gqa=True), "k has leading dims"),
        (lambda: gp.attention(r(1, 4, 5, 8), r(1, 2, 6, 8), r(1, 2, 6, 8), algorithm="unfused"),
         r"attention: k has 2 heads"),
        (lambda: gp.attention(r(1, 6, 5, 8), r(1, 4, 6, 8), r(1, 4, 6, 8), enable_gqa=True, algorithm="unfused"),
         r"q's heads \(6\) must be a multiple"),
    ]
    for call, msg in cases:
        with pytest.raises((RuntimeError, ValueError), match=msg):
            call()
    q, k, v = r(1, 4, 5, 8), r(1, 2, 6, 8), r(1, 2, 6, 8)
    out, lse = OPS.attention(q, k, v, None, False, True)
    with pytest.raises(RuntimeError, match=r"attention_backward: k has 2 heads"):
        OPS.attention_backward(out, q, k, v, out, lse, None, False)  # enable_gqa left False


@pytest.mark.parametrize("device", DEVICES)
def test_gqa_unfused_and_module(device):
    # The chain (which repeats k/v) agrees with the fused op; nn.Attention(num_kv_heads) with
    # separate-projection views agrees with SDPA(enable_gqa) on its weights.
    q, k, v = make_gqa(2, 4, 2, 9, 11, 8, device, torch.float64, grad=True, seed=4)
    for causal in (False, True):
        a = gp.attention(q, k, v, causal=causal, enable_gqa=True)
        b = gp.attention(q, k, v, causal=causal, enable_gqa=True, algorithm="unfused")
        _assert_close(b, a, torch.float64, "unfused vs fused")
        g = torch.randn_like(a)
        for x, y in zip(torch.autograd.grad(b, (q, k, v), g), torch.autograd.grad(a, (q, k, v), g)):
            _assert_close(x, y, torch.float64, "unfused vs fused grad", grad=True)
    torch.manual_seed(2)
    mod = gp.nn.Attention(32, 4, num_kv_heads=2, causal=True, device=device, dtype=torch.float64)
    assert mod.qkv.out_features == (4 + 2 * 2) * 8 and "num_kv_heads=2" in repr(mod)
    x = torch.randn(2, 13, 32, device=device, dtype=torch.float64, requires_grad=True)
    B, S, _ = x.shape
    qr, kr, vr = F.linear(x, mod.qkv.weight, mod.qkv.bias).split([32, 16, 16], dim=-1)
    o = F.scaled_dot_product_attention(qr.view(B, S, 4, 8).transpose(1, 2), kr.view(B, S, 2, 8).transpose(1, 2),
                                       vr.view(B, S, 2, 8).transpose(1, 2), is_causal=True, enable_gqa=True)
    ref = F.linear(o.transpose(1, 2).reshape(B, S, 32), mod.out_proj.weight, mod.out_proj.bias)
    y = mod(x)
    torch.testing.assert_close(y, ref)
    params = [x, mod.qkv.weight, mod.out_proj.weight]
    g = torch.randn_like(y)
    for a, b in zip(torch.autograd.grad(y, params, g), torch.autograd.grad(ref, params, g)):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="num_kv_heads"):
        gp.nn.Attention(32, 4, num_kv_heads=3)


# CUDA: (B, H, Hkv, Sq, Sk, D). D 64/128 take the tensor-core kernels in fp16/bf16 (tails past
# every tile, several query tiles per head so the dK/dV pipeline crosses heads mid-stream),
# odd D the SIMT ones; every dtype.
GQA_CUDA_SHAPES = [(2, 4, 2, 33, 129, 64), (1, 8, 2, 129, 33, 128), (2, 4, 1, 200, 200, 64),
                   (1, 4, 4, 100, 100, 128), (1, 6, 3, 300, 257, 128), (2, 4, 2, 17, 17, 33),
                   (1, 8, 1, 65, 130, 80), (1, 2, 1, 1, 70, 64), (1, 4, 2, 513, 511, 64)]


@requires_cuda
@pytest.mark.parametrize("shape", GQA_CUDA_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", CUDA_DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_cuda_forward_backward(shape, dtype, causal):
    B, H, Hkv, Sq, Sk, D = shape
    what = f"{shape} causal={causal} {dtype}"
    q, k, v = make_gqa(B, H, Hkv, Sq, Sk, D, "cuda", dtype, seed=Sq + Sk + H)
    _poison_cache()
    out, lse, grads = _check_gqa(q, k, v, causal, dtype, what)
    # dk and dv are summed over the group in a fixed order, written once.
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64).to(out)
    _poison_cache()
    again = OPS.attention_backward(g, q, k, v, out, lse, None, causal, True)
    _assert_same_grads(grads, again, f"{what}: two identical backward calls")


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("knobs", FWD_KNOBS, ids=lambda k: k[0] + (f"-w{k[1]}" if k[1] else ""))
def test_gqa_cuda_forward_configs(knobs, dtype):
    # Each forward kernel reads the group's kv head (the knob forces it; the label checks it ran).
    fwd, warps = knobs
    if fwd.startswith("wgmma") or fwd.startswith("ws"):
        _skip_unless_wgmma()
    with gp.tuning.override(attention_fwd=fwd, attention_fwd_warps=warps):
        for (H, Hkv), (Sq, Sk), D in many([((4, 2), (129, 200), 64), ((8, 1), (257, 257), 128),
                                          ((6, 3), (65, 33), 128), ((4, 4), (200, 129), 64)],
                                         [((8, 1), (257, 257), 128)]):
            for causal in (False, True):
                what = f"{fwd} H={H} Hkv={Hkv} Sq={Sq} Sk={Sk} D={D} causal={causal} {dtype}"
                q, k, v = make_gqa(2, H, Hkv, Sq, Sk, D, "cuda", dtype, seed=Sq + D)
                _poison_cache()
                _assert_forward_kernel(lambda: _check_gqa(q, k, v, causal, dtype, what), _fwd_label(knobs, D), what)


@requires_cuda
@pytest.mark.parametrize("D", [64, 128, 33])
def test_gqa_cuda_strided_no_copy(D):
    # Llama's separate projections (B, S, heads, D) transposed: read and written in place (no copy
    # kernel), grads in the inputs' memory order, bitwise equal to the call on contiguous copies.
    B, H, Hkv, S = 2, 8, 2, 100
    for dtype in many((torch.bfloat16, torch.float16, torch.float32), (torch.bfloat16,)):
        for causal in (False, True):
            what = f"D={D} {dtype} causal={causal}"
            q, k, v = make_gqa(B, H, Hkv, S, S, D, "cuda", dtype, seed=D, layout="bshd")
            _poison_cache()
            (out, lse), copies = copy_kernels(OPS.attention.default, q, k, v, None, causal, True)
            assert copies == [], f"{what}: forward copies {copies}"
            _assert_layout(out, "bshd", f"{what} out")
            qc, kc, vc = (t.contiguous() for t in (q, k, v))
            out_c, lse_c = OPS.attention(qc, kc, vc, None, causal, True)
            assert torch.equal(out, out_c) and torch.equal(lse, lse_c), f"{what}: out/lse differ from contiguous"
            g = torch.randn(B, S, H, D, device="cuda", dtype=dtype).transpose(1, 2)
            _poison_cache()
            grads, copies = copy_kernels(OPS.attention_backward.default, g, q, k, v, out, lse, None, causal, True)
            assert copies == [], f"{what}: backward copies {copies}"
            grads_c = OPS.attention_backward(g.contiguous(), qc, kc, vc, out_c, lse_c, None, causal, True)
            for name, a in zip("qkv", grads):
                _assert_layout(a, "bshd", f"{what} d{name}")
            _assert_same_grads(grads, grads_c, f"{what} vs the contiguous call")
            leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
            ref = ref_gqa(*leaves, causal=causal)
            _assert_close(out, ref, dtype, f"{what} out")
            for name, a, r in zip("qkv", grads, torch.autograd.grad(ref, leaves, g.double())):
                _assert_close(a, r, dtype, f"{what} d{name}", grad=True)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_gqa_cuda_matches_sdpa(dtype):
    # Against PyTorch's own enable_gqa in the same dtype (and both against float64).
    q, k, v = make_gqa(2, 8, 2, 300, 300, 64, "cuda", dtype, grad=True, seed=9, layout="bshd")
    for causal in (False, True):
        ours = gp.attention(q, k, v, causal=causal, enable_gqa=True)
        theirs = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        ref = ref_gqa(*(t.detach().double() for t in (q, k, v)), causal=causal)
        _assert_close(ours, ref, dtype, f"ours causal={causal}")
        _assert_close(theirs, ref, dtype, f"sdpa causal={causal}")
        g = torch.randn_like(ours)
        grads_t = torch.autograd.grad(theirs, (q, k, v), g)
        for name, a, b in zip("qkv", torch.autograd.grad(ours, (q, k, v), g), grads_t):
            _assert_close(a, b.double(), dtype, f"d{name} vs SDPA causal={causal}", grad=True)
