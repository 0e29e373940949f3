"""conv1d: seed example, F.conv1d comparison, gradients, opcheck, compile, bad input."""
import pytest
import torch
from conftest import DEVICES, assert_close_ref, assert_compiled_matches_eager, device_dtypes, requires_cuda
from hypothesis import given
from hypothesis import strategies as st
from strategies import dtypes, extents, extents_or_zero, grad_close, layouts, make_tensor, seeds

import gpu_puzzles as gp
from gpu_puzzles.bench.conv1d import reference

SEED_IN = list(range(15))
SEED_W = [0.0, 1.0, 2.0, 3.0]
SEED_OUT = [14, 20, 26, 32, 38, 44, 50, 56, 62, 68, 74, 80, 41, 14, 0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algorithm", ["auto", "fast", "tiled", "naive"])
def test_seed_example(device, algorithm):
    x = torch.tensor(SEED_IN, dtype=torch.float32, device=device)
    w = torch.tensor(SEED_W, device=device)
    y = gp.conv1d(x, w, algorithm=algorithm)
    assert y.shape == (15,)
    assert y.cpu().tolist() == SEED_OUT


def _ref64(x, w, b, causal):
    return reference(x.double(), w.double(), None if b is None else b.double(), causal)


SHAPES = [(15,), (3, 100), (2, 5, 64), (4, 7, 333), (1, 3, 1), (2, 16, 2048)]


@pytest.mark.parametrize("device,dtype", device_dtypes())
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("K", [1, 2, 4, 9, 13])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_matches_reference(device, dtype, shape, K, causal):
    torch.manual_seed(hash((shape, K, causal)) % 2**31)
    x = torch.randn(shape, device=device, dtype=dtype)
    C = 1 if len(shape) == 1 else shape[-2]
    w = torch.randn((K,) if len(shape) == 1 else (C, K), device=device, dtype=dtype)
    b = torch.randn(C, device=device, dtype=dtype) if len(shape) > 1 else None
    y = gp.conv1d(x, w, b, causal=causal)
    assert y.shape == x.shape and y.dtype == dtype
    assert_close_ref(y, _ref64(x, w, b, causal), dtype, "forward")


@pytest.mark.parametrize("device,dtype", device_dtypes())
@pytest.mark.parametrize("algorithm", ["fast", "tiled", "naive"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape,K", [((3, 6, 257), 3), ((2, 4, 1024), 4), ((1, 2, 40), 9), ((2, 3, 50), 8)])
def test_backward_matches_reference(device, dtype, algorithm, causal, shape, K):
    torch.manual_seed(7)
    B, C, L = shape
    x = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(C, K, device=device, dtype=dtype, requires_grad=True)
    b = torch.randn(C, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(shape, device=device, dtype=dtype)
    y = gp.conv1d(x, w, b, causal=causal, algorithm=algorithm)
    grads = torch.autograd.grad(y, (x, w, b), g)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    refs = torch.autograd.grad(_ref64(x64, w64, b64, causal), (x64, w64, b64), g.double())
    # dw sums B*L products: scale the tolerance by sqrt of the reduction length.
    for name, a, r in zip(("dx", "dw", "dbias"), grads, refs):
        assert a.shape == r.shape
        assert_close_ref(a, r, dtype, name) if name == "dx" else assert_close_ref(
            a / (B * L) ** 0.5, r / (B * L) ** 0.5, dtype, name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck(device, causal):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 17, device=device, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, device=device, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, device=device, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b: gp.conv1d(x, w, b, causal=causal), (x, w, b))
    x1 = torch.randn(11, device=device, dtype=torch.float64, requires_grad=True)
    w1 = torch.randn(3, device=device, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: gp.conv1d(x, w, causal=causal), (x1, w1))


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_input(device):
    x = torch.randn(2, 40, 6, device=device).transpose(1, 2)  # (2, 6, 40), strided
    w = torch.randn(6, 3, device=device)
    assert not x.is_contiguous()
    assert_close_ref(gp.conv1d(x, w, causal=True), _ref64(x, w, None, True), torch.float32, "strided")


def _strided_views(kind, B, C, L, K, device, dtype):
    """x, grad_out and weight as views a model hands over, each row contiguous."""
    if kind == "chunk":  # one half of xz.chunk(2, dim=1), as Mamba's block makes it
        x = torch.randn(B, 2 * C, L, device=device, dtype=dtype).chunk(2, dim=1)[0]
        g = torch.randn(B, 2 * C, L, device=device, dtype=dtype).chunk(2, dim=1)[1]
        w = torch.randn(C, 1, K, device=device, dtype=dtype)[:, 0]
    else:  # rows cut out of longer ones: row strides and a base off the 16-byte grid
        x = torch.randn(B, C, L + 5, device=device, dtype=dtype)[:, :, 1:L + 1]
        g = torch.randn(B, C + 1, L + 3, device=device, dtype=dtype)[:, 1:, :L]
        w = torch.randn(C, K + 2, device=device, dtype=dtype)[:, 1:K + 1]
    return x, g, w


@pytest.mark.parametrize("device,dtype", device_dtypes())
@pytest.mark.parametrize("algorithm", ["auto", "tiled", "naive"])
@pytest.mark.parametrize("kind", ["chunk", "cut"])
@pytest.mark.parametrize("causal", [False, True])
def test_strided_views_match_reference(device, dtype, algorithm, kind, causal):
    torch.manual_seed(11)
    B, C, L, K = 2, 6, 136, 4
    x, g, w = _strided_views(kind, B, C, L, K, device, dtype)
    assert not x.is_contiguous() and not g.is_contiguous()
    b = torch.randn(C, device=device, dtype=dtype)
    xr, wr, br = (t.detach().clone().requires_grad_() for t in (x, w, b))
    y = gp.conv1d(xr, wr, br, causal=causal, algorithm=algorithm)
    assert y.is_contiguous()
    assert_close_ref(y, _ref64(x, w, b, causal), dtype, "forward")
    grads = torch.autograd.grad(y, (xr, wr, br), g)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    refs = torch.autograd.grad(_ref64(x64, w64, b64, causal), (x64, w64, b64), g.double())
    for name, a, r in zip(("dx", "dw", "dbias"), grads, refs):
        n = 1 if name == "dx" else (B * L) ** 0.5
        assert_close_ref(a / n, r / n, dtype, name)
    # The op itself on the views (the autograd wrapper above may hand it copies).
    dx, dw, db = torch.ops.gpu_puzzles.conv1d_backward(g, x, w, causal, algorithm)
    for name, a, r in zip(("dx", "dw", "dbias"), (dx, dw, db), refs):
        n = 1 if name == "dx" else (B * L) ** 0.5
        assert_close_ref(a / n, r / n, dtype, "op " + name)


@requires_cuda
@pytest.mark.parametrize("kind", ["chunk", "cut"])
def test_strided_views_launch_no_copy(kind):
    from conftest import copy_kernels
    x, g, w = _strided_views(kind, 2, 64, 1024, 4, "cuda", torch.bfloat16)
    b = torch.randn(64, device="cuda", dtype=torch.bfloat16)
    _, fwd = copy_kernels(torch.ops.gpu_puzzles.conv1d, x, w, b, True, "auto")
    _, bwd = copy_kernels(torch.ops.gpu_puzzles.conv1d_backward, g, x, w, True, "auto")
    assert fwd == [] and bwd == [], (fwd, bwd)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck(device, requires_grad):
    x = torch.randn(2, 3, 20, device=device, requires_grad=requires_grad)
    w = torch.randn(3, 4, device=device, requires_grad=requires_grad)
    b = torch.randn(3, device=device, requires_grad=requires_grad)
    torch.library.opcheck(torch.ops.gpu_puzzles.conv1d.default, (x, w, b, True, "auto"))
    torch.library.opcheck(torch.ops.gpu_puzzles.conv1d.default, (x, w, None, False, "auto"))
    g = torch.randn(2, 3, 20, device=device)
    torch.library.opcheck(torch.ops.gpu_puzzles.conv1d_backward.default, (g, x.detach(), w.detach(), True, "auto"))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_forward_backward(device):
    mod = gp.nn.Conv1d(channels=8, kernel_size=4, causal=True, device=device)
    xs = [torch.randn(2, 8, L, device=device, requires_grad=True) for L in (32, 45)]
    assert_compiled_matches_eager(mod, [((x,), (x, mod.weight, mod.bias)) for x in xs])


def test_module_init_and_shapes():
    m = gp.nn.Conv1d(channels=5, kernel_size=3, bias=True)
    assert m.weight.shape == (5, 3) and m.bias.shape == (5,)
    assert m.weight.abs().max() <= 1 / 3 ** 0.5 and m.weight.std() > 0
    assert m(torch.randn(2, 5, 9)).shape == (2, 5, 9)
    assert m(torch.randn(5, 9)).shape == (5, 9)
    with pytest.raises(ValueError, match="kernel_size"):
        gp.nn.Conv1d(channels=5, kernel_size=0)


def test_module_sizes_keyword_only():
    # Conv1d(4096, 4) would read as nn.Conv1d's (in_channels, out_channels): refused, naming the keywords.
    for args in ((4096, 4), (4096,), (8, 8, 3)):
        with pytest.raises(TypeError, match="channels= and kernel_size= by keyword"):
            gp.nn.Conv1d(*args)
    m = gp.nn.Conv1d(channels=4096, kernel_size=4)
    assert m.weight.shape == (4096, 4) and "channels=4096, kernel_size=4" in repr(m)
    # The same numbers as nn.Conv1d(C, C, K, groups=C) on the input padded at the end (the seed's form).
    m = gp.nn.Conv1d(channels=3, kernel_size=4, dtype=torch.float64)
    ref = torch.nn.Conv1d(3, 3, 4, groups=3, dtype=torch.float64)
    with torch.no_grad():
        ref.weight.copy_(m.weight.unsqueeze(1))
        ref.bias.copy_(m.bias)
    x = torch.randn(2, 3, 11, dtype=torch.float64)
    torch.testing.assert_close(m(x), ref(torch.nn.functional.pad(x, (0, 3))))


@pytest.mark.parametrize("device", DEVICES)
def test_empty_sequence(device):
    x = torch.randn(2, 3, 0, device=device, requires_grad=True)
    w = torch.randn(3, 4, device=device, requires_grad=True)
    y = gp.conv1d(x, w)
    assert y.shape == (2, 3, 0)
    (dw,) = torch.autograd.grad(y.sum(), (w,))
    assert dw.shape == (3, 4) and (dw == 0).all()


BAD = [
    (lambda d: (torch.randn(2, 3, 8, device=d), torch.randn(4, 2, device=d), None), "channels"),
    (lambda d: (torch.randn(2, 3, 8, device=d), torch.randn(3, 2, device=d, dtype=torch.float64), None),
     "weight has dtype"),
    (lambda d: (torch.randn(2, 2, 3, 8, device=d), torch.randn(3, 2, device=d), None), "x must"),
    (lambda d: (torch.randn(2, 3, 8, device=d), torch.randn(3, device=d), None), "weight must be 2-D"),
    (lambda d: (torch.randn(2, 3, 8, device=d), torch.randn(3, 2, device=d), torch.randn(4, device=d)),
     "bias must have shape"),
    (lambda d: (torch.randn(2, 3, 8, device=d), torch.randn(3, 0, device=d), None), "at least one tap"),
    (lambda d: (torch.randint(0, 4, (2, 3, 8), device=d), torch.randn(3, 2, device=d), None), "x must be a float"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make,msg", BAD)
def test_bad_input(device, make, msg):
    x, w, b = make(device)
    with pytest.raises((RuntimeError, ValueError), match=msg):
        gp.conv1d(x, w, b)


def test_bad_algorithm():
    with pytest.raises(RuntimeError, match="algorithm"):
        gp.conv1d(torch.randn(3, 8), torch.randn(3, 2), algorithm="fastest")


@requires_cuda
def test_mixed_devices():
    with pytest.raises(RuntimeError, match="weight is on"):
        gp.conv1d(torch.randn(3, 8, device="cuda"), torch.randn(3, 2))
    with pytest.raises(RuntimeError, match="on the same device"):
        gp.conv1d(torch.randn(3, 8), torch.randn(3, 2, device="cuda"))
    # the context is still usable afterwards
    assert gp.conv1d(torch.ones(1, 8, device="cuda"), torch.ones(1, 2, device="cuda")).sum().item() == 15


@requires_cuda
@pytest.mark.parametrize("algorithm", ["fast", "tiled", "naive"])
def test_cuda_matches_cpu_and_writes_every_element(algorithm):
    # Odd length, misaligned view: exercises the scalar (non-vector) path and the tails.
    torch.manual_seed(3)
    base = torch.randn(3 * 5 * 1001 + 1, device="cuda")
    x = base[1:].view(3, 5, 1001)
    w = torch.randn(5, 5, device="cuda")
    for causal in (False, True):
        y = gp.conv1d(x, w, causal=causal, algorithm=algorithm)
        assert torch.isfinite(y).all()
        torch.testing.assert_close(y.cpu(), gp.conv1d(x.cpu(), w.cpu(), causal=causal), rtol=1e-5, atol=1e-5)


@requires_cuda
def test_cuda_backward_deterministic():
    x = torch.randn(4, 64, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(64, 4, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    first = torch.autograd.grad(gp.conv1d(x, w, causal=True), (x, w), g)
    for _ in range(3):
        again = torch.autograd.grad(gp.conv1d(x, w, causal=True), (x, w), g)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


@pytest.mark.parametrize("K", range(1, 12))
@pytest.mark.parametrize("causal", [False, True])
def test_cpu_every_tap_count_near_length(K, causal):
    # The CPU kernel unrolls K up to 8 and splits each row into edges and an interior:
    # lengths around K give rows that are all edge, or have a one-element interior.
    torch.manual_seed(K)
    for L in sorted({1, max(1, K - 1), K, K + 1, 2 * K + 1, 37}):
        x = torch.randn(3, 2, L, dtype=torch.float64, requires_grad=True)
        w = torch.randn(2, K, dtype=torch.float64, requires_grad=True)
        b = torch.randn(2, dtype=torch.float64, requires_grad=True)
        g = torch.randn(3, 2, L, dtype=torch.float64)
        y = gp.conv1d(x, w, b, causal=causal)
        grads = torch.autograd.grad(y, (x, w, b), g)
        leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
        y_ref = reference(*leaves, causal=causal)
        refs = torch.autograd.grad(y_ref, leaves, g)
        assert_close_ref(y, y_ref, torch.float64, f"forward L={L}")
        for name, a, r in zip(("dx", "dw", "dbias"), grads, refs):
            assert_close_ref(a, r, torch.float64, f"{name} L={L}")


@pytest.mark.parametrize("K", [4, 11])
def test_cpu_same_result_for_any_thread_count(K):
    # Rows are spread over threads and dw/dbias summed per row, then over the batch in
    # order: every thread count gives the same bits.
    torch.manual_seed(5)
    x = torch.randn(6, 40, 700, requires_grad=True)
    w = torch.randn(40, K, requires_grad=True)
    b = torch.randn(40, requires_grad=True)
    g = torch.randn_like(x)
    prev = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            y = gp.conv1d(x, w, b, causal=True)
            results.append((y, *torch.autograd.grad(y, (x, w, b), g)))
    finally:
        torch.set_num_threads(prev)
    for other in results[1:]:
        for a, o in zip(results[0], other):
            assert torch.equal(a, o)


# ---- property tests (hypothesis; profile from GPU_PUZZLES_HYPOTHESIS_PROFILE, see conftest) ----



@pytest.mark.parametrize("device", DEVICES)
@given(data=st.data())
def test_property_forward_backward(device, data):
    """Random rank (1-3), extents (0, 1, primes; K past L), causal, bias, dtype and strides
    (transposed, sliced, misaligned, stride 0) against float64, forward and all grads."""
    dtype = data.draw(dtypes(device), "dtype")
    rank = data.draw(st.integers(1, 3), "rank")
    B = data.draw(extents_or_zero(4), "B")
    C = data.draw(extents_or_zero(9), "C") if rank > 1 else 1
    L = data.draw(extents_or_zero(300 if device == "cpu" else 3000), "L")
    K = data.draw(extents(13), "K")
    causal = data.draw(st.booleans(), "causal")
    algorithm = data.draw(st.sampled_from(["auto", "fast", "tiled", "naive"]), "algorithm")
    shape = {1: (L,), 2: (C, L), 3: (B, C, L)}[rank]
    wshape = (K,) if rank == 1 else (C, K)
    seed = data.draw(seeds(), "seed")
    x = make_tensor(shape, dtype, device, data.draw(layouts(rank), "x layout"), seed, requires_grad=True)
    w = make_tensor(wshape, dtype, device, data.draw(layouts(len(wshape)), "w layout"), seed + 1,
                    requires_grad=True)
    b = None
    if data.draw(st.booleans(), "bias"):
        b = make_tensor((C,), dtype, device, data.draw(layouts(1), "b layout"), seed + 2, requires_grad=True)
    y = gp.conv1d(x, w, b, causal=causal, algorithm=algorithm)
    assert y.shape == x.shape and y.dtype == dtype
    leaves = [t for t in (x, w, b) if t is not None]
    g = make_tensor(shape, dtype, device, seed=seed + 3)
    grads = torch.autograd.grad(y, leaves, g)
    if x.numel() == 0:  # (the F.conv1d reference cannot take it) nothing to sum: zero grads
        assert grads[0].shape == x.shape and all((t == 0).all() for t in grads[1:])
        return
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    y_ref = reference(leaves64[0], leaves64[1], leaves64[2] if b is not None else None, causal)
    assert_close_ref(y, y_ref, dtype, "forward")
    refs = torch.autograd.grad(y_ref, leaves64, g.double())
    n_rows = x.numel() // max(1, C * L) if rank > 1 else 1
    for name, a, r in zip(("dx", "dw", "dbias"), grads, refs):
        # dx sums K products; dw and dbias sum over every (batch, position)
        grad_close(a, r, dtype, name, K if name == "dx" else n_rows * L)
