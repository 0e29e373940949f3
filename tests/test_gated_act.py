"""gated_act: act(gate) * up against the float64 math, gradients, views, opcheck, compile,
bad input."""
import pytest
import torch
import torch.nn.functional as F
from conftest import (
    CPU_SIMD,
    DEVICES,
    HAS_CUDA,
    assert_close_ref,
    assert_compiled_matches_eager,
    device_dtypes,
    poison_allocator,
)
from hypothesis import given
from hypothesis import strategies as st
from strategies import close_to_eager, dtypes, layouts, make_tensor, seeds, shapes

import gpu_puzzles as gp
from gpu_puzzles.bench.gated_act import reference

ACTS = ["silu", "gelu_tanh", "gelu"]


def _ref64(gate, up, act):
    return reference(gate.double(), up.double(), act)


def test_reference_is_torchs_math():
    g, u = torch.randn(4, 9, dtype=torch.float64), torch.randn(4, 9, dtype=torch.float64)
    torch.testing.assert_close(reference(g, u, "silu"), g * torch.sigmoid(g) * u)
    torch.testing.assert_close(reference(g, u, "gelu"), 0.5 * g * (1 + torch.erf(g / 2 ** 0.5)) * u)
    tanh = 0.5 * g * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (g + 0.044715 * g ** 3)))
    torch.testing.assert_close(reference(g, u, "gelu_tanh"), tanh * u)


# Widths: vectorised (a multiple of 16 bytes), odd, a single element, wider than a block.
SHAPES = [(8, 64), (3, 5, 40), (7, 33), (1, 1), (2, 3000), (130, 8)]


@pytest.mark.parametrize("device,dtype", device_dtypes())
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("act", ACTS)
def test_forward_backward_match_float64(device, dtype, shape, act):
    torch.manual_seed(hash((shape, act)) % 2**31)
    gate = (3 * torch.randn(shape, device=device, dtype=dtype)).requires_grad_()
    up = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(shape, device=device, dtype=dtype)
    if device == "cuda":
        poison_allocator(1 << 24)
    y = gp.gated_act(gate, up, act)
    assert y.shape == gate.shape and y.dtype == dtype and y.is_contiguous()
    g64, u64 = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
    ref = _ref64(g64, u64, act)
    assert_close_ref(y, ref, dtype, "forward")
    dg, du = torch.autograd.grad(y, (gate, up), dy)
    rg, ru = torch.autograd.grad(ref, (g64, u64), dy.double())
    assert_close_ref(dg, rg, dtype, "dgate")
    assert_close_ref(du, ru, dtype, "dup")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("act", ACTS)
def test_gradcheck(device, act):
    torch.manual_seed(0)
    gate = torch.randn(3, 7, device=device, dtype=torch.float64, requires_grad=True)
    up = torch.randn(3, 7, device=device, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda g, u: gp.gated_act(g, u, act), (gate, up))


@pytest.mark.parametrize("device,dtype", device_dtypes())
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_halves_of_one_projection_read_in_place(device, dtype, act):
    """Phi-3's gate_up_proj: the two halves of one output as views (row stride 2 I), and a
    transposed-then-sliced layout whose rows do not collapse (copied): both as the math."""
    torch.manual_seed(1)
    gate_up = torch.randn(2, 6, 2 * 48, device=device, dtype=dtype, requires_grad=True)
    gate, up = gate_up.chunk(2, dim=-1)
    y = gp.gated_act(gate, up, act)
    ref = _ref64(gate.detach(), up.detach(), act)
    assert_close_ref(y, ref, dtype, "halves")
    dy = torch.randn_like(y)
    (d,) = torch.autograd.grad(y, gate_up, dy)
    g64 = gate_up.detach().double().requires_grad_()
    (r,) = torch.autograd.grad(_ref64(*g64.chunk(2, dim=-1), act), g64, dy.double())
    assert_close_ref(d, r, dtype, "d gate_up")
    odd = torch.randn(5, 4, 3, 40, device=device, dtype=dtype).transpose(0, 1)[:, 1:]  # 3 levels of rows
    u = torch.randn(odd.shape, device=device, dtype=dtype)
    assert_close_ref(gp.gated_act(odd, u, act), _ref64(odd, u, act), dtype, "strided rows")


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_unaligned_views_take_the_scalar_path(dtype):
    """A view starting one element in (not 16-byte aligned) and an odd row stride: the
    element-wise kernel, still as the math, every output element written."""
    torch.manual_seed(2)
    base = torch.randn(9, 65, device="cuda", dtype=dtype)
    gate, up = base[:, 1:33], base[:, 33:65]
    poison_allocator(1 << 24)
    y = gp.gated_act(gate, up, "silu")
    assert_close_ref(y, _ref64(gate, up, "silu"), dtype, "unaligned")
    dy = torch.randn(y.shape, device="cuda", dtype=dtype)
    dg, du = torch.ops.gpu_puzzles.gated_act_backward(dy, gate, up, "silu")
    g64, u64 = gate.double().requires_grad_(), up.double().requires_grad_()
    rg, ru = torch.autograd.grad(_ref64(g64, u64, "silu"), (g64, u64), dy.double())
    assert_close_ref(dg, rg, dtype, "dgate")
    assert_close_ref(du, ru, dtype, "dup")


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_many_rows_loop_over_the_grid():
    """More rows than the grid's blocks along y: every row written (poisoned memory)."""
    torch.manual_seed(3)
    gate = torch.randn(70000, 16, device="cuda", dtype=torch.bfloat16)
    up = torch.randn_like(gate)
    poison_allocator(1 << 26)
    y = gp.gated_act(gate, up, "gelu_tanh")
    assert_close_ref(y, _ref64(gate, up, "gelu_tanh"), torch.bfloat16, "rows")


@pytest.mark.parametrize("device", DEVICES)
def test_matches_torch_functional(device):
    """The module-level meaning: F.silu(g) * u and F.gelu(g, approximate=...) * u."""
    torch.manual_seed(4)
    g, u = torch.randn(4, 32, device=device), torch.randn(4, 32, device=device)
    torch.testing.assert_close(gp.gated_act(g, u), F.silu(g) * u)
    torch.testing.assert_close(gp.gated_act(g, u, "gelu_tanh"), F.gelu(g, approximate="tanh") * u)
    torch.testing.assert_close(gp.gated_act(g, u, "gelu"), F.gelu(g) * u)


@pytest.mark.parametrize("device", DEVICES)
def test_empty(device):
    for shape in [(0, 8), (4, 0), (2, 0, 3)]:
        g = torch.randn(shape, device=device, requires_grad=True)
        u = torch.randn(shape, device=device, requires_grad=True)
        y = gp.gated_act(g, u)
        assert y.shape == shape
        dg, du = torch.autograd.grad(y.sum(), (g, u))
        assert dg.shape == du.shape == shape


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck(device, requires_grad):
    g = torch.randn(3, 5, 16, device=device, requires_grad=requires_grad)
    u = torch.randn(3, 5, 16, device=device, requires_grad=requires_grad)
    for act in ACTS:
        torch.library.opcheck(torch.ops.gpu_puzzles.gated_act.default, (g, u, act))
    dy = torch.randn(3, 5, 16, device=device)
    torch.library.opcheck(torch.ops.gpu_puzzles.gated_act_backward.default, (dy, g.detach(), u.detach(), "silu"))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_forward_backward(device):
    def f(gu):
        g, u = gu.chunk(2, dim=-1)
        return gp.gated_act(g, u, "silu")

    xs = [torch.randn(2, L, 64, device=device, requires_grad=True) for L in (16, 23)]
    assert_compiled_matches_eager(f, [((x,), (x,)) for x in xs])


def test_double_backward_raises_naming_the_op():
    g = torch.randn(2, 8, dtype=torch.float64, requires_grad=True)
    u = torch.randn(2, 8, dtype=torch.float64, requires_grad=True)
    (dg,) = torch.autograd.grad(gp.gated_act(g, u).sum(), g, create_graph=True)
    with pytest.raises(RuntimeError, match="gated_act_backward"):
        dg.sum().backward()


BAD = [
    (lambda d: (torch.randn(2, 8, device=d), torch.randn(2, 9, device=d), "silu"), "up has shape"),
    (lambda d: (torch.randn(2, 8, device=d), torch.randn(2, 8, device=d, dtype=torch.float64), "silu"),
     "up has dtype"),
    (lambda d: (torch.randint(0, 3, (2, 8), device=d), torch.randint(0, 3, (2, 8), device=d), "silu"), "gate must be"),
    (lambda d: (torch.randn(2, 8, device=d), torch.randn(2, 8, device=d), "relu"), "activation must be one of"),
    (lambda d: (torch.tensor(1.0, device=d), torch.tensor(1.0, device=d), "silu"), "gate must have at least one"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make,msg", BAD)
def test_bad_input(device, make, msg):
    with pytest.raises(RuntimeError, match=msg):
        gp.gated_act(*make(device))


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_mixed_devices_named():
    with pytest.raises(RuntimeError, match="up is on cpu"):
        gp.gated_act(torch.randn(2, 8, device="cuda"), torch.randn(2, 8))
    dy = torch.randn(2, 8, device="cuda")
    with pytest.raises(RuntimeError, match="grad_out has dtype"):
        torch.ops.gpu_puzzles.gated_act_backward(dy.double(), dy, dy, "silu")


# ---- property test (hypothesis; profile from GPU_PUZZLES_HYPOTHESIS_PROFILE, see conftest) ----

@pytest.mark.parametrize("device", DEVICES)
@given(data=st.data())
def test_property_gated_act(device, data):
    """Random shape (empty too), dtype, activation and strides of gate and up (each its own:
    halves of one projection, transposed, sliced, misaligned, stride 0) against float64, within
    twice eager PyTorch's own error on top of the tolerance."""
    dtype = data.draw(dtypes(device), "dtype")
    shape = data.draw(shapes(1, 3, max_side=300, allow_empty=True, max_numel=3000), "shape")
    act = data.draw(st.sampled_from(ACTS), "activation")
    seed = data.draw(seeds(), "seed")
    if data.draw(st.booleans(), "halves of one projection"):
        gate_up = make_tensor((*shape[:-1], 2 * shape[-1]), dtype, device, seed=seed, scale=3.0)
        gate, up = (t.detach().requires_grad_() for t in gate_up.chunk(2, dim=-1))
    else:
        gate = make_tensor(shape, dtype, device, data.draw(layouts(len(shape)), "gate layout"), seed, scale=3.0,
                           requires_grad=True)
        up = make_tensor(shape, dtype, device, data.draw(layouts(len(shape)), "up layout"), seed + 1,
                         requires_grad=True)
    y = gp.gated_act(gate, up, act)
    assert y.shape == gate.shape and y.dtype == dtype
    leaves = [t.detach().double().requires_grad_() for t in (gate, up)]
    ref = _ref64(*leaves, act)
    eager_in = [t.detach().requires_grad_() for t in (gate, up)]
    eager = reference(*eager_in, act)
    dy = make_tensor(shape, dtype, device, seed=seed + 2)
    grads = torch.autograd.grad(y, (gate, up), dy)
    refs = torch.autograd.grad(ref, leaves, dy.double())
    eagers = torch.autograd.grad(eager, eager_in, dy)
    for name, a, r, e in zip(("output", "dgate", "dup"), (y, *grads), (ref, *refs), (eager, *eagers)):
        close_to_eager(a, r, e, dtype, name)


# ---- CPU kernels at every SIMD level (csrc/common/cpu_isa.h) ---------------------------


@pytest.mark.parametrize("level", CPU_SIMD)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_cpu_every_simd_level(level, dtype):
    """Rows around the vector widths (8 / 16 floats, 4 / 8 doubles: a partial last vector) as
    the halves of one projection (read in place), large gates and NaN, forward and backward."""
    torch.manual_seed(6)
    with gp.tuning.override(cpu_simd=level):
        for act in ACTS:
            for width in (1, 3, 4, 7, 8, 9, 15, 16, 17, 33, 100):
                gate_up = (3 * torch.randn(5, 2 * width, dtype=torch.float64)).to(dtype)
                if width >= 8:
                    gate_up[0, :8] = torch.tensor([-100.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 100.0, 5.0])
                gate_up.requires_grad_()
                gate, up = gate_up.chunk(2, dim=-1)
                y = gp.gated_act(gate, up, act)
                what = f"{act} I={width} {dtype} {level}"
                assert_close_ref(y, _ref64(gate.detach(), up.detach(), act), dtype, what)
                dy = torch.randn(y.shape, dtype=torch.float64).to(dtype)
                (d,) = torch.autograd.grad(y, gate_up, dy)
                g64 = gate_up.detach().double().requires_grad_()
                (r,) = torch.autograd.grad(_ref64(*g64.chunk(2, dim=-1), act), g64, dy.double())
                assert_close_ref(d, r, dtype, what + " backward")
            g = torch.randn(2, 19, dtype=dtype)
            g[0, 3] = g[1, 17] = float("nan")
            u = torch.randn(2, 19, dtype=dtype)
            y = gp.gated_act(g, u, act)
            dg, du = torch.ops.gpu_puzzles.gated_act_backward(torch.ones_like(y), g, u, act)
            for out in (y, dg, du):
                assert torch.equal(torch.isnan(out), torch.isnan(g)), (act, level, out)
