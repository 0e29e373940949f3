"""rotary: q and k rotated against the float64 math and transformers' apply_rotary_pos_emb,
gradients, layouts (views, broadcasts, partial rotary), mixed dtypes, opcheck, compile, bad
input."""
import pytest
import torch
from conftest import DEVICES, HAS_CUDA, assert_close_ref, assert_compiled_matches_eager, device_dtypes, poison_allocator
from hypothesis import given
from hypothesis import strategies as st
from strategies import dtypes, extents, layouts, make_tensor, seeds

import gpu_puzzles as gp
from gpu_puzzles.bench.rotary import cos_sin, reference


def _ref64(q, k, cos, sin):
    return reference(q.double(), k.double(), cos.double(), sin.double())


def _check(q, k, cos, sin, what, out_dtype=None):
    """Forward and gradients of q and k (leaves, or views of leaves) against float64."""
    dtype = q.dtype
    out_dtype = out_dtype or dtype
    oq, ok = gp.rotary(q, k, cos, sin)
    assert oq.shape == q.shape and ok.shape == k.shape, what
    assert oq.dtype == ok.dtype == out_dtype and oq.is_contiguous() and ok.is_contiguous(), what
    rq, rk = _ref64(q.detach(), k.detach(), cos, sin)
    assert_close_ref(oq, rq, out_dtype, f"{what}: q")
    assert_close_ref(ok, rk, out_dtype, f"{what}: k")
    leaves = [t for t in (q, k) if t.requires_grad]
    if not leaves:
        return
    gq, gk = torch.randn_like(oq), torch.randn_like(ok)
    got = torch.autograd.grad((oq, ok), (q, k), (gq, gk))
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    want = torch.autograd.grad(_ref64(q64, k64, cos, sin), (q64, k64), (gq.double(), gk.double()))
    for g, w, n in zip(got, want, ("dq", "dk")):
        assert g.dtype == dtype, f"{what}: {n} dtype {g.dtype}"
        assert_close_ref(g, w, dtype, f"{what}: {n}")


def test_reference_is_transformers():
    """Our reference is transformers' apply_rotary_pos_emb (Llama's), on (B, H, S, D)."""
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 9, 16, dtype=torch.float64), torch.randn(2, 2, 9, 16, dtype=torch.float64)
    cos, sin = cos_sin(2, 9, 16, "cpu", torch.float64)
    want = llama.apply_rotary_pos_emb(q, k, cos.squeeze(1), sin.squeeze(1))
    for a, b in zip(reference(q, k, cos, sin), want):
        torch.testing.assert_close(a, b)
    for a, b in zip(gp.rotary(q, k, cos, sin), want):
        torch.testing.assert_close(a, b)


# (B, S, H, Hkv, D, R): D = 64 and 128 as real heads (vectorised), partial rotary (R < D, as
# Phi-3 / GPT-NeoX), D = 2, odd widths, one row.
SHAPES = [(2, 7, 4, 2, 64, 64), (1, 33, 3, 1, 128, 128), (2, 5, 2, 2, 96, 32), (3, 4, 1, 1, 2, 2),
          (2, 3, 2, 1, 10, 6), (1, 1, 1, 1, 8, 8)]


@pytest.mark.parametrize("device,dtype", device_dtypes())
@pytest.mark.parametrize("shape", SHAPES)
def test_projection_views_match_float64(device, dtype, shape):
    """q and k as attention layers make them: (B, H, S, D) transposed views of (B, S, H * D)."""
    B, S, H, Hkv, D, R = shape
    torch.manual_seed(hash(shape) % 2**31)
    qp = torch.randn(B, S, H * D, device=device, dtype=dtype, requires_grad=True)
    kp = torch.randn(B, S, Hkv * D, device=device, dtype=dtype, requires_grad=True)
    q, k = qp.view(B, S, H, D).transpose(1, 2), kp.view(B, S, Hkv, D).transpose(1, 2)
    cos, sin = cos_sin(B, S, R, device, dtype)
    if device == "cuda":
        poison_allocator(1 << 24)
    _check(q, k, cos, sin, f"views {shape}")


@pytest.mark.parametrize("device,dtype", device_dtypes())
def test_layouts_and_broadcasts(device, dtype):
    """Contiguous (B, H, S, D); flash-attention's (B, S, H, D) with cos (B, S, 1, D); cos
    (S, D) shared by the batch; 3-D and 1-D q; cos and sin of different strides."""
    torch.manual_seed(5)
    B, S, H, D = 2, 6, 3, 16
    mk = lambda *s: torch.randn(*s, device=device, dtype=dtype, requires_grad=True)  # noqa: E731
    cos, sin = cos_sin(B, S, D, device, dtype)
    _check(mk(B, H, S, D), mk(B, 1, S, D), cos, sin, "contiguous")
    _check(mk(B, S, H, D), mk(B, S, 2, D), cos.transpose(1, 2), sin.transpose(1, 2), "bshd")
    c2, s2 = cos[0, 0], sin[0, 0]
    _check(mk(B, H, S, D), mk(B, H, S, D), c2, s2, "shared (S, D)")
    _check(mk(H, S, D), mk(1, S, D), c2, s2, "3-D")
    _check(mk(D), mk(D), c2[0], s2[0], "1-D")
    wide = torch.randn(B, 1, S, 2 * D, device=device, dtype=dtype)[..., ::2]  # sin with a strided last dim
    sin_s = wide.copy_(sin)
    _check(mk(B, H, S, D), mk(B, 2, S, D), cos, sin_s, "strided sin")
    # Unequal halves (not transformers' tables): the rule is elementwise x * cos + rotate_half(x) * sin.
    cu, su = torch.randn(B, 1, S, D, device=device, dtype=dtype), torch.randn(B, 1, S, D, device=device, dtype=dtype)
    _check(mk(B, H, S, D), mk(B, 2, S, D), cu, su, "unequal halves")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float32_tables_with_half_q(device, dtype):
    """Under autocast with float32 parameters transformers' tables are float32 and q, k half:
    the outputs are float32 (as q * cos promotes), the gradients in q's dtype."""
    torch.manual_seed(6)
    B, S, H, D = 2, 9, 4, 64
    qp = torch.randn(B, S, H * D, device=device, dtype=dtype, requires_grad=True)
    kp = torch.randn(B, S, 2 * D, device=device, dtype=dtype, requires_grad=True)
    q, k = qp.view(B, S, H, D).transpose(1, 2), kp.view(B, S, 2, D).transpose(1, 2)
    cos, sin = cos_sin(B, S, D, device, torch.float32)
    _check(q, k, cos, sin, "fp32 tables", out_dtype=torch.float32)
    oq, _ = gp.rotary(q, k, cos, sin)
    torch.testing.assert_close(oq, reference(q, k, cos, sin)[0])  # as PyTorch computes it


@pytest.mark.parametrize("device", DEVICES)
def test_half_on_cpu_too(device):
    """bf16 and fp16 with tables in q's dtype (bf16 parameters), on every device."""
    for dtype in (torch.bfloat16, torch.float16):
        torch.manual_seed(7)
        q = torch.randn(2, 3, 5, 32, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(2, 1, 5, 32, device=device, dtype=dtype, requires_grad=True)
        cos, sin = cos_sin(2, 5, 32, device, dtype)
        _check(q, k, cos, sin, f"{dtype}")


@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck(device):
    torch.manual_seed(0)
    q = torch.randn(2, 3, 4, 8, device=device, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 1, 4, 8, device=device, dtype=torch.float64, requires_grad=True)
    cos = torch.randn(2, 1, 4, 6, device=device, dtype=torch.float64)
    sin = torch.randn(2, 1, 4, 6, device=device, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda a, b: gp.rotary(a, b, cos, sin), (q, k))


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_unaligned_views_take_the_scalar_path(dtype):
    """q starting one element in and an odd row stride: the element-wise kernel, every output
    element written (poisoned memory)."""
    torch.manual_seed(2)
    base = torch.randn(3, 5, 70, device="cuda", dtype=dtype, requires_grad=True)
    q, k = base[..., 1:65].unsqueeze(1), base[..., 2:66].unsqueeze(1)
    cos, sin = cos_sin(3, 5, 64, "cuda", dtype)
    poison_allocator(1 << 24)
    _check(q, k, cos, sin, "unaligned")


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_many_rows_loop_over_the_grid():
    """More rows than one pass of the grid: every row written (poisoned memory)."""
    torch.manual_seed(3)
    q = torch.randn(4, 32, 2048, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(4, 8, 2048, 64, device="cuda", dtype=torch.bfloat16)
    cos, sin = cos_sin(4, 2048, 64, "cuda", torch.float32)
    poison_allocator(1 << 28)
    _check(q, k, cos, sin, "rows", out_dtype=torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_empty(device):
    cos, sin = torch.randn(0, 8, device=device), torch.randn(0, 8, device=device)
    q = torch.randn(2, 0, 8, device=device, requires_grad=True)
    k = torch.randn(1, 0, 8, device=device, requires_grad=True)
    oq, ok = gp.rotary(q, k, cos, sin)
    assert oq.shape == q.shape and ok.shape == k.shape
    dq, dk = torch.autograd.grad((oq.sum() + ok.sum()), (q, k))
    assert dq.shape == q.shape and dk.shape == k.shape


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck(device, requires_grad):
    q = torch.randn(2, 3, 5, 16, device=device, requires_grad=requires_grad)
    k = torch.randn(2, 1, 5, 16, device=device, requires_grad=requires_grad)
    cos, sin = cos_sin(2, 5, 16, device)
    torch.library.opcheck(torch.ops.gpu_puzzles.rotary.default, (q, k, cos, sin))
    torch.library.opcheck(torch.ops.gpu_puzzles.rotary.default, (q.bfloat16(), k.bfloat16(), cos, sin))
    gq, gk = torch.randn(2, 3, 5, 16, device=device), torch.randn(2, 1, 5, 16, device=device)
    torch.library.opcheck(torch.ops.gpu_puzzles.rotary_backward.default, (gq, gk, cos, sin, torch.bfloat16))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_forward_backward(device):
    def f(qp, kp, cos, sin):
        B, S, _ = qp.shape
        oq, ok = gp.rotary(qp.view(B, S, 4, 16).transpose(1, 2), kp.view(B, S, 2, 16).transpose(1, 2), cos, sin)
        return torch.cat((oq, ok), dim=1)

    cases = []
    for S in (8, 13):
        qp = torch.randn(2, S, 64, device=device, requires_grad=True)
        kp = torch.randn(2, S, 32, device=device, requires_grad=True)
        cases.append(((qp, kp, *cos_sin(2, S, 16, device)), (qp, kp)))
    assert_compiled_matches_eager(f, cases)


def test_double_backward_raises_naming_the_op():
    q = torch.randn(1, 2, 3, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 3, 8, dtype=torch.float64, requires_grad=True)
    cos, sin = cos_sin(1, 3, 8, "cpu", torch.float64)
    oq, ok = gp.rotary(q, k, cos, sin)
    (dq,) = torch.autograd.grad((oq.square().sum() + ok.sum()), q, create_graph=True)
    with pytest.raises(RuntimeError, match="rotary_backward"):
        dq.sum().backward()


def test_tables_requiring_grad_raise():
    q, k = torch.randn(1, 2, 3, 8, requires_grad=True), torch.randn(1, 1, 3, 8)
    cos, sin = cos_sin(1, 3, 8, "cpu")
    with pytest.raises(RuntimeError, match="cos and sin must not require grad"):
        gp.rotary(q, k, cos.requires_grad_(), sin)
    with torch.no_grad():  # nothing to differentiate: allowed
        gp.rotary(q, k, cos, sin)


def _qk(d, D=8, dtype=torch.float32):
    return torch.randn(2, 3, 4, D, device=d, dtype=dtype), torch.randn(2, 1, 4, D, device=d, dtype=dtype)


BAD = [
    (lambda d: (*_qk(d), *cos_sin(2, 4, 6, d)), None),  # partial rotary: fine
    (lambda d: (*_qk(d), *cos_sin(2, 4, 10, d)), "at most q's last dim"),
    (lambda d: (*_qk(d), torch.randn(2, 1, 4, 5, device=d), torch.randn(2, 1, 4, 5, device=d)), "must be even"),
    (lambda d: (*_qk(d), *cos_sin(2, 5, 8, d)), "cos has shape .* does not broadcast over q"),
    (lambda d: (*_qk(d), *cos_sin(3, 4, 8, d)), "does not broadcast"),
    (lambda d: (*_qk(d), torch.randn(2, 1, 4, 8, device=d), torch.randn(2, 1, 4, 6, device=d)), "sin has shape"),
    (lambda d: (_qk(d)[0], torch.randn(2, 1, 4, 6, device=d), *cos_sin(2, 4, 6, d)), "k has 6 elements"),
    (lambda d: (*_qk(d, dtype=torch.float64), *cos_sin(2, 4, 8, d)), "cos must have q's dtype"),
    (lambda d: (_qk(d)[0], _qk(d)[1].double(), *cos_sin(2, 4, 8, d)), "k has dtype"),
    (lambda d: (*_qk(d), cos_sin(2, 4, 8, d)[0], cos_sin(2, 4, 8, d, torch.float64)[1]), "sin has dtype"),
    (lambda d: (torch.randn(1, 2, 3, 4, 8, device=d), _qk(d)[1], *cos_sin(2, 4, 8, d)), "q must have 1 to 4"),
    (lambda d: (torch.randint(0, 3, (2, 3, 4, 8), device=d), _qk(d)[1], *cos_sin(2, 4, 8, d)), "q must be a float"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make,msg", BAD)
def test_bad_input(device, make, msg):
    args = make(device)
    if msg is None:
        gp.rotary(*args)
        return
    with pytest.raises(RuntimeError, match=msg):
        gp.rotary(*args)


def test_backward_op_checks_its_dtypes():
    gq, gk = _qk("cpu")
    cos, sin = cos_sin(2, 4, 8, "cpu")
    with pytest.raises(RuntimeError, match="grad_q must have the forward output's dtype"):
        torch.ops.gpu_puzzles.rotary_backward(gq.bfloat16(), gk.bfloat16(), cos, sin, torch.bfloat16)
    with pytest.raises(RuntimeError, match="dtype must be float32"):
        torch.ops.gpu_puzzles.rotary_backward(gq, gk, cos, sin, torch.int32)


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_mixed_devices_named():
    q, k = _qk("cuda")
    cos, sin = cos_sin(2, 4, 8, "cpu")
    with pytest.raises(RuntimeError, match="cos is on cpu"):
        gp.rotary(q, k, cos, sin)
    with pytest.raises(RuntimeError, match="k is on cpu"):
        gp.rotary(q, k.cpu(), cos.cuda(), sin.cuda())


# ---- property test (hypothesis; profile from GPU_PUZZLES_HYPOTHESIS_PROFILE, see conftest) ----

@pytest.mark.parametrize("device", DEVICES)
@given(data=st.data())
def test_property_forward_backward(device, data):
    """Random rank (1-4), extents, head counts, rotated width R <= D (odd pair counts, partial),
    layouts of q, k, cos and sin (transposed, sliced, misaligned, cos/sin expanded), tables in
    q's dtype or float32 for half q: forward and both gradients against float64."""
    dtype = data.draw(dtypes(device), "dtype")
    nd = data.draw(st.integers(1, 4), "rank")
    D = 2 * data.draw(extents(40), "D/2")
    R = 2 * data.draw(st.integers(1, D // 2), "R/2")
    lead = [data.draw(extents(9), f"dim{i}") for i in range(nd - 1)]
    heads_dim = data.draw(st.integers(0, nd - 2), "heads dim") if nd >= 2 else None
    k_lead = list(lead)
    if heads_dim is not None:
        k_lead[heads_dim] = data.draw(extents(5), "k heads")
    cs_lead = [1 if i == heads_dim else n for i, n in enumerate(lead)]  # cos/sin broadcast over the heads
    cs_lead = cs_lead[data.draw(st.integers(0, len(cs_lead)), "cos drops"):]  # and maybe fewer leading dims
    cs_dtype = data.draw(st.sampled_from([dtype, torch.float32] if dtype in (torch.float16, torch.bfloat16)
                                         else [dtype]), "cos dtype")
    seed = data.draw(seeds(), "seed")
    lay = lambda n, exp=False: data.draw(layouts(n, allow_expanded=exp))  # noqa: E731
    q = make_tensor((*lead, D), dtype, device, lay(nd), seed, requires_grad=True)
    k = make_tensor((*k_lead, D), dtype, device, lay(nd), seed + 1, requires_grad=True)
    cos = make_tensor((*cs_lead, R), cs_dtype, device, lay(len(cs_lead) + 1, True), seed + 2)
    sin = make_tensor((*cs_lead, R), cs_dtype, device, lay(len(cs_lead) + 1, True), seed + 3)
    _check(q, k, cos, sin, "property", out_dtype=torch.promote_types(dtype, cs_dtype))
