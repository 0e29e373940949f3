"""embedding, both kernels (algorithm "coalesced" and "2d"): seed size, F.embedding comparison, out-of-range rows,
gradients with heavy repetition, padding_idx, determinism, gradcheck, opcheck, compile, bad input."""
import functools

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    DEVICES,
    assert_close_ref,
    assert_compiled_matches_eager,
    device_dtypes,
    poison_allocator,
    requires_cuda,
)
from hypothesis import given
from hypothesis import strategies as st
from strategies import (
    dtypes,
    extents_or_zero,
    grad_close,
    index_dtypes,
    layouts,
    make_indices,
    make_tensor,
    seeds,
    shapes,
)

import gpu_puzzles as gp
from gpu_puzzles.bench.embedding import reference, reference_grad

# One entry per CUDA kernel, keyed by its algorithm name.
FNS = {k: functools.partial(gp.embedding, algorithm=k) for k in ("coalesced", "2d")}
OP = torch.ops.gpu_puzzles.embedding.default
BWD_OP = torch.ops.gpu_puzzles.embedding_backward.default


def _grad_close(actual, ref, dtype, what):
    # Rows sum up to n terms: compare on the scale of the largest reference entry.
    assert actual.shape == ref.shape, what
    assert_close_ref(actual, ref, dtype, what)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernel", FNS)
def test_seed_size(device, kernel):
    # The seed: B=8, L=512, V=10000, E=512, int32 indices, float32.
    torch.manual_seed(0)
    idx = torch.randint(0, 10000, (8, 512), device=device, dtype=torch.int32)
    w = torch.randn(10000, 512, device=device)
    y = FNS[kernel](idx, w)
    assert y.shape == (8, 512, 512) and y.dtype == torch.float32
    assert torch.equal(y, F.embedding(idx, w))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernel", FNS)
def test_seed_example(device, kernel):
    w = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0.7, 0.8], [0.9, 1.0, 1.1, 1.2]], device=device)
    idx = torch.tensor([[1, 0, 2], [2, 1, 7]], device=device, dtype=torch.int32)  # 7: out of range
    y = FNS[kernel](idx, w)
    assert torch.equal(y[0, 0], w[1]) and torch.equal(y[1, 0], w[2])
    assert torch.equal(y[1, 2], torch.zeros(4, device=device))


# (index shape, V, E): odd E exercises the scalar path, small E several rows per warp,
# E = 4096 / 1000 the multi-chunk rows.
SHAPES = [((7,), 5, 3), ((2, 9), 11, 8), ((3, 5, 4), 40, 64), ((100,), 300, 1000), ((33,), 17, 4096),
          ((1,), 1, 1), ((257,), 1000, 130)]


@pytest.mark.parametrize("device,dtype", device_dtypes())
@pytest.mark.parametrize("shape,V,E", SHAPES)
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("kernel", FNS)
def test_forward_matches_reference(device, dtype, shape, V, E, idx_dtype, kernel):
    torch.manual_seed(hash((shape, V, E)) % 2**31)
    idx = torch.randint(-2, V + 2, shape, device=device, dtype=idx_dtype)  # some out of range
    w = torch.randn(V, E, device=device, dtype=dtype)
    y = FNS[kernel](idx, w)
    assert y.shape == (*shape, E) and y.dtype == dtype
    assert torch.equal(y, reference(idx, w))  # a copy: bit-exact
    bad = (idx < 0) | (idx >= V)
    assert (y[bad] == 0).all()


@pytest.mark.parametrize("device,dtype", device_dtypes())
@pytest.mark.parametrize("kernel", FNS)
@pytest.mark.parametrize("padding_idx", [None, 3, -1])
def test_backward_heavy_repetition(device, dtype, kernel, padding_idx):
    # Few distinct rows, many tokens: runs far longer than a tile, runs cut by tile
    # edges, out-of-range indices and padding mixed in.
    torch.manual_seed(1)
    V, E, T = 13, 40, 700
    idx = torch.randint(-1, V + 1, (T,), device=device)
    idx[:200] = 5  # one very long run
    w = torch.randn(V, E, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(T, E, device=device, dtype=dtype)
    (gw,) = torch.autograd.grad(FNS[kernel](idx, w, padding_idx), (w,), g)
    assert gw.dtype == dtype
    ref = reference_grad(g, idx, V, padding_idx)
    _grad_close(gw, ref, dtype, "grad")
    if padding_idx is not None:
        assert (gw[padding_idx] == 0).all()
    # vs F.embedding on the valid tokens only
    keep = (idx >= 0) & (idx < V)
    w2 = w.detach().clone().requires_grad_()
    (gf,) = torch.autograd.grad(F.embedding(idx[keep], w2, padding_idx), (w2,), g[keep])
    _grad_close(gw, gf.double(), dtype, "vs F.embedding")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernel", FNS)
def test_backward_index_shape_and_int32(device, kernel):
    torch.manual_seed(2)
    idx = torch.randint(0, 9, (3, 4, 5), device=device, dtype=torch.int32)
    w = torch.randn(9, 6, device=device, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 4, 5, 6, device=device, dtype=torch.float64)
    (gw,) = torch.autograd.grad(FNS[kernel](idx, w), (w,), g)
    torch.testing.assert_close(gw, reference_grad(g, idx, 9))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernel", FNS)
def test_gradcheck(device, kernel):
    torch.manual_seed(0)
    idx = torch.tensor([[0, 2, 2, 9], [4, -1, 2, 0]], device=device)
    w = torch.randn(6, 5, device=device, dtype=torch.float64, requires_grad=True)
    # (no padding_idx here: its row is returned but gets no gradient by definition)
    assert torch.autograd.gradcheck(lambda w: FNS[kernel](idx, w), (w,))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernel", FNS)
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck(device, kernel, requires_grad):
    idx = torch.randint(0, 10, (3, 7), device=device)
    w = torch.randn(10, 8, device=device, requires_grad=requires_grad)
    torch.library.opcheck(OP, (idx, w, None, kernel))
    torch.library.opcheck(OP, (idx.int(), w, 4, kernel))
    g = torch.randn(3, 7, 8, device=device)
    torch.library.opcheck(BWD_OP, (g, idx, 10, None, False, kernel))
    torch.library.opcheck(BWD_OP, (g, idx, 10, -2, True, kernel))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_forward_backward(device):
    mod = gp.nn.Embedding(50, 16, padding_idx=0, device=device)
    idxs = [torch.randint(0, 50, shape, device=device) for shape in ((2, 9), (3, 14))]
    assert_compiled_matches_eager(mod, [((idx,), (mod.weight,)) for idx in idxs])


def test_module():
    m = gp.nn.Embedding(7, 3, padding_idx=-2)
    assert m.padding_idx == 5 and (m.weight[5] == 0).all() and m.weight.std() > 0
    assert m(torch.tensor([[1, 5]])).shape == (1, 2, 3)
    m2 = gp.nn.Embedding(7, 3, algorithm="2d")
    idx = torch.tensor([0, 6, 3])
    assert torch.equal(m2(idx), m2.weight[idx])
    with pytest.raises(RuntimeError, match="algorithm must be one of"):
        gp.nn.Embedding(7, 3, algorithm="fast")(idx)
    with pytest.raises(ValueError, match="padding_idx"):
        gp.nn.Embedding(7, 3, padding_idx=7)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernel", FNS)
def test_empty(device, kernel):
    w = torch.randn(5, 4, device=device, requires_grad=True)
    idx = torch.zeros(2, 0, dtype=torch.long, device=device)
    y = FNS[kernel](idx, w)
    assert y.shape == (2, 0, 4)
    (gw,) = torch.autograd.grad(y.sum(), (w,))
    assert gw.shape == (5, 4) and (gw == 0).all()
    w0 = torch.randn(5, 0, device=device)
    assert FNS[kernel](torch.tensor([1, 2], device=device), w0).shape == (2, 0)


BAD = [
    (lambda d: (torch.randn(3, device=d), torch.randn(5, 4, device=d), None), "indices must be an int32 or int64"),
    (lambda d: (torch.tensor([1], dtype=torch.int16, device=d), torch.randn(5, 4, device=d), None), "indices must be"),
    (lambda d: (torch.tensor([1], device=d), torch.randn(5, device=d), None), "weight must be 2-D"),
    (lambda d: (torch.tensor([1], device=d), torch.randint(0, 3, (5, 4), device=d), None), "weight must be a float"),
    (lambda d: (torch.tensor([1], device=d), torch.randn(5, 4, device=d), 5), "padding_idx"),
    (lambda d: (torch.tensor([1], device=d), torch.randn(5, 4, device=d), -6), "padding_idx"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernel", FNS)
@pytest.mark.parametrize("make,msg", BAD)
def test_bad_input(device, kernel, make, msg):
    idx, w, p = make(device)
    with pytest.raises((RuntimeError, ValueError), match=msg):
        FNS[kernel](idx, w, p)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_algorithm(device):
    idx, w = torch.tensor([1], device=device), torch.randn(5, 4, device=device)
    with pytest.raises(RuntimeError, match="embedding: algorithm must be one of 'auto', 'coalesced', '2d', got 'fast'"):
        gp.embedding(idx, w, algorithm="fast")
    with pytest.raises(RuntimeError, match="embedding_backward: algorithm must be one of"):
        BWD_OP(torch.randn(1, 4, device=device), idx, 5, None, False, "tiled")


@pytest.mark.parametrize("kernel", FNS)
def test_bad_backward_input(kernel):
    idx = torch.tensor([[1, 2]])
    with pytest.raises(RuntimeError, match="grad_out must have shape"):
        BWD_OP(torch.randn(2, 4), idx, 5, None, False, kernel)
    with pytest.raises(RuntimeError, match="num_weights"):
        BWD_OP(torch.randn(1, 2, 4), idx, -1, None, False, kernel)


@pytest.mark.parametrize("kernel", FNS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backward_same_for_any_thread_count(kernel, dtype):
    # The CPU backward groups tokens by row and sums each row in token order, rows
    # spread over threads: every thread count gives the same bits, and every row is
    # written (zeros where no token points).
    torch.manual_seed(4)
    V, E, T = 3000, 96, 5000
    idx = torch.randint(-2, V + 2, (T,))
    idx[::7] = 11  # one row with many tokens
    g = torch.randn(T, E, dtype=dtype)
    prev = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(BWD_OP(g, idx, V, 5, False, kernel))
    finally:
        torch.set_num_threads(prev)
    for other in results[1:]:
        assert torch.equal(results[0], other)
    _grad_close(results[0], reference_grad(g, idx, V, 5), dtype, "grad")
    untouched = torch.ones(V, dtype=torch.bool)
    untouched[idx[(idx >= 0) & (idx < V)]] = False
    assert (results[0][untouched] == 0).all() and (results[0][5] == 0).all()


# ---- CUDA only -----------------------------------------------------------------


@requires_cuda
@pytest.mark.parametrize("kernel", FNS)
def test_mixed_devices(kernel):
    with pytest.raises(RuntimeError, match="indices is on"):
        FNS[kernel](torch.tensor([1]), torch.randn(5, 4, device="cuda"))
    with pytest.raises(RuntimeError, match="indices is on"):
        FNS[kernel](torch.tensor([1], device="cuda"), torch.randn(5, 4))
    assert FNS[kernel](torch.tensor([1], device="cuda"), torch.ones(5, 4, device="cuda")).sum().item() == 4


def _poison_allocator(numel, dtype):
    # A freed block of this many elements' bytes, NaN-filled: the next allocation of that size reuses it.
    poison_allocator(numel * torch.empty((), dtype=dtype).element_size())


CUDA_SHAPES = [(1, 1, 1), (5, 3, 7), (1000, 50, 8), (333, 1000, 130), (4096, 10000, 512), (64, 300, 4096),
               (77, 20, 4100), (2048, 7, 2), (17, 100000, 24), (3000, 3, 1)]


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T,V,E", CUDA_SHAPES)
@pytest.mark.parametrize("kernel", FNS)
def test_cuda_forward_backward_many_shapes(dtype, T, V, E, kernel):
    torch.manual_seed(T * 31 + V * 7 + E)
    idx = torch.randint(-1, V + 1, (T,), device="cuda")
    if T > 20:
        idx[: T // 4] = V // 2  # a long run spanning many tiles
    w = torch.randn(V, E, device="cuda", dtype=dtype, requires_grad=True)
    g = torch.randn(T, E, device="cuda", dtype=dtype)
    _poison_allocator(T * E, dtype)
    y = FNS[kernel](idx, w, 0)
    assert torch.equal(y, reference(idx, w.detach(), 0))
    _poison_allocator(V * E, dtype)
    (gw,) = torch.autograd.grad(FNS[kernel](idx, w, 0), (w,), g)
    assert not torch.isnan(gw).any()
    _grad_close(gw, reference_grad(g, idx, V, 0), dtype, f"grad {kernel}")


@requires_cuda
@pytest.mark.parametrize("kernel", FNS)
@pytest.mark.parametrize("offset", [1, 2, 3])
def test_cuda_misaligned_views(kernel, offset):
    # Weight and grad views off a 16-byte boundary: the scalar fallback.
    V, E, T = 64, 32, 500
    base = torch.randn(V * E + offset, device="cuda", dtype=torch.float16)
    w = base[offset:].view(V, E).requires_grad_()
    idx = torch.randint(0, V, (T,), device="cuda", dtype=torch.int32)
    y = FNS[kernel](idx, w)
    assert torch.equal(y, w.detach()[idx.long()])
    gbase = torch.randn(T * E + offset, device="cuda", dtype=torch.float16)
    g = gbase[offset:].view(T, E)
    (gw,) = torch.autograd.grad(FNS[kernel](idx, w), (w,), g)
    _grad_close(gw, reference_grad(g, idx, V), torch.float16, "grad")


def _strided_views(kind, device, dtype, idx_dtype=torch.int64):
    """indices, weight and grad_out as views a model hands over."""
    V, E, B, S = 97, 64, 3, 41
    ids = torch.randint(-2, V + 2, (B, S + 1), device=device, dtype=idx_dtype)
    if kind == "shift":  # input_ids[:, :-1]: rows of the index tensor strided
        idx = ids[:, :-1]
        w = torch.randn(V, E, device=device, dtype=dtype)
        g = torch.randn(B, S, 2 * E, device=device, dtype=dtype)[..., E:]
    elif kind == "transposed":  # (S, B) view of a (B, S) batch: two levels of strides
        idx = ids[:, 1:].t()
        w = torch.randn(V, E + 8, device=device, dtype=dtype)[:, 8:]  # rows every E + 8
        g = torch.randn(B, S, E, device=device, dtype=dtype).transpose(0, 1)
    else:  # three uncollapsible levels: copied, still right
        idx = torch.randint(-2, V + 2, (2, 5, 3, 7), device=device, dtype=idx_dtype)[:, ::2, :, :6]
        w = torch.randn(V, E, device=device, dtype=dtype)
        g = torch.randn(2, 3, 3, 6, E + 1, device=device, dtype=dtype)[..., 1:]
    return idx, w, g


@pytest.mark.parametrize("device,dtype", device_dtypes())
@pytest.mark.parametrize("kernel", FNS)
@pytest.mark.parametrize("kind", ["shift", "transposed", "three_levels"])
def test_strided_views(device, dtype, kernel, kind):
    torch.manual_seed(5)
    idx, w, g = _strided_views(kind, device, dtype)
    assert not idx.is_contiguous() and not g.is_contiguous()
    y = FNS[kernel](idx, w)
    assert torch.equal(y, reference(idx, w))
    gw = BWD_OP(g, idx, w.shape[0], None, True, kernel)
    _grad_close(gw, reference_grad(g, idx, w.shape[0]), dtype, f"grad {kernel}")


@requires_cuda
@pytest.mark.parametrize("kind", ["shift", "transposed"])
def test_strided_views_launch_no_copy(kind):
    from conftest import copy_kernels
    idx, w, g = _strided_views(kind, "cuda", torch.bfloat16)
    _, fwd = copy_kernels(OP, idx, w, None, "coalesced")
    assert fwd == [], fwd
    # The backward reads the grad rows in place: no copy beyond those of contiguous inputs
    # (the index sort may copy its keys internally either way).
    ic = idx.contiguous()
    _, bwd = copy_kernels(BWD_OP, g, ic, w.shape[0], None, True, "coalesced")
    _, base = copy_kernels(BWD_OP, g.contiguous(), ic, w.shape[0], None, True, "coalesced")
    assert bwd == base, (bwd, base)


@requires_cuda
@pytest.mark.parametrize("run", [1, 15, 16, 17, 31, 32, 33, 100])
def test_cuda_tile_boundaries(run):
    # Runs of every length around the tile size (16), at every offset in a tile.
    # 7 out-of-range tokens sort first and shift every segment off the tile edges;
    # the token order is shuffled (the sort must bring the runs back together).
    V, E = 50, 24
    torch.manual_seed(run)
    idx = torch.cat([torch.full((7,), -1, dtype=torch.long)] +
                    [torch.full((run,), v, dtype=torch.long) for v in range(40)])
    idx = idx[torch.randperm(idx.numel())].cuda()
    w = torch.randn(V, E, device="cuda", requires_grad=True)
    g = torch.randn(idx.numel(), E, device="cuda")
    for kernel in FNS:
        (gw,) = torch.autograd.grad(FNS[kernel](idx, w), (w,), g)
        _grad_close(gw, reference_grad(g, idx, V), torch.float32, f"run {run} {kernel}")


@requires_cuda
def test_cuda_all_same_index():
    V, E, T = 100, 256, 20000
    idx = torch.full((T,), 42, device="cuda")
    w = torch.randn(V, E, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(T, E, device="cuda", dtype=torch.bfloat16)
    (gw,) = torch.autograd.grad(gp.embedding(idx, w), (w,), g)
    _grad_close(gw, reference_grad(g, idx, V), torch.bfloat16, "grad")
    assert (gw[:42] == 0).all() and (gw[43:] == 0).all()


@requires_cuda
@pytest.mark.parametrize("kernel", FNS)
def test_cuda_deterministic(kernel):
    torch.manual_seed(4)
    V, E, T = 1000, 256, 30000
    idx = torch.randint(0, 50, (T,), device="cuda")  # heavy repetition
    w = torch.randn(V, E, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(T, E, device="cuda", dtype=torch.bfloat16)
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        first = torch.autograd.grad(FNS[kernel](idx, w), (w,), g)[0]
        for _ in range(3):
            assert torch.equal(first, torch.autograd.grad(FNS[kernel](idx, w), (w,), g)[0])
        # both ops take the same deterministic path
        other = FNS["coalesced" if kernel == "2d" else "2d"]
        assert torch.equal(first, torch.autograd.grad(other(idx, w), (w,), g)[0])
        # deterministic mode fills torch.empty with NaN: every element was written
        _grad_close(first, reference_grad(g, idx, V), torch.bfloat16, "grad")
    finally:
        torch.use_deterministic_algorithms(prev)
    # the coalesced op is deterministic without the flag too
    if kernel == "coalesced":
        assert torch.equal(first, torch.autograd.grad(gp.embedding(idx, w), (w,), g)[0])


@requires_cuda
def test_cuda_large_bf16_matches_f_embedding():
    # A slice of the benchmark shape: real vocabulary, wide rows.
    torch.manual_seed(5)
    V, E, T = 128256, 4096, 2048
    idx = torch.randint(0, V, (T,), device="cuda")
    idx[::3] = idx[0]
    w = torch.randn(V, E, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(T, E, device="cuda", dtype=torch.bfloat16)
    y = gp.embedding(idx, w)
    assert torch.equal(y, F.embedding(idx, w))
    (gw,) = torch.autograd.grad(y, (w,), g)
    _grad_close(gw, reference_grad(g, idx, V), torch.bfloat16, "grad")



# ---- property tests (hypothesis; profile from GPU_PUZZLES_HYPOTHESIS_PROFILE, see conftest) ----



@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernel", FNS)
@given(data=st.data())
def test_property_forward_backward(device, kernel, data):
    """Random index shape (0-d, empty, primes), V and E (0 included), int32/int64, indices
    partly out of range, padding_idx, dtype and strides of both inputs (stride 0: repeated
    indices, or rows shared in the table) against F.embedding (bit-exact) and a float64 weight gradient."""
    dtype = data.draw(dtypes(device), "dtype")
    ishape = data.draw(shapes(min_dims=0, max_dims=3, max_side=40, allow_empty=True, max_numel=600), "index shape")
    V = data.draw(extents_or_zero(300), "V")
    E = data.draw(extents_or_zero(260 if device == "cpu" else 1100), "E")
    padding_idx = data.draw(st.none() | st.integers(-V, V - 1), "padding_idx") if V > 0 else None
    seed = data.draw(seeds(), "seed")
    idx = make_indices(ishape, -3, V + 3, data.draw(index_dtypes(), "index dtype"), device,
                       data.draw(layouts(len(ishape)), "index layout"), seed)
    w = make_tensor((V, E), dtype, device, data.draw(layouts(2), "w layout"), seed + 1,
                    requires_grad=True)
    y = FNS[kernel](idx, w, padding_idx)
    assert y.shape == (*ishape, E) and y.dtype == dtype
    g = make_tensor(y.shape, dtype, device, seed=seed + 2)
    (gw,) = torch.autograd.grad(y, (w,), g)
    if V == 0 or E == 0:  # (F.embedding cannot take an empty table) all rows are zero
        assert (y == 0).all() and gw.shape == (V, E)
        return
    assert torch.equal(y, reference(idx, w.detach(), padding_idx))  # a copy: bit-exact
    ref = reference_grad(g, idx, V, padding_idx)
    flat = idx.reshape(-1).long().cpu()
    counts = torch.bincount(flat[(flat >= 0) & (flat < V)], minlength=V)
    grad_close(gw, ref, dtype, "dweight", counts.max().item())
