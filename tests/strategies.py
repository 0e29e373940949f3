"""Hypothesis building blocks shared by the property tests in tests/test_<op>.py and by
tests/test_reliability.py: extents (size 1, primes, powers of two +-1), shapes (empty and
0-d where the op allows), dtypes per device, and layouts that give a tensor odd strides
(transposed, sliced with a step, a misaligned storage offset, expanded with stride 0).

Tensor *values* come from a torch.Generator seeded by a drawn integer, not element by
element from hypothesis: that keeps examples cheap, and a failing example still replays
exactly from its seed.

Typical use::

    @given(data=st.data())
    def test_op_property(device, data):
        dtype = data.draw(dtypes(device))
        shape = data.draw(shapes(min_dims=1, max_dims=3, allow_empty=True))
        x = make_tensor(shape, dtype, device, data.draw(layouts(len(shape))), data.draw(seeds()))
"""
import math
from dataclasses import dataclass

import torch
from conftest import CPU_DTYPES, CUDA_DTYPES
from hypothesis import strategies as st

# Extents that break kernels: 1, small primes, warp/vector boundaries and their neighbours.
SPECIAL_EXTENTS = (1, 2, 3, 5, 7, 8, 13, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 257, 1023, 1024, 1025)


def extents(max_value, min_value=1):
    """An extent in [min_value, max_value], half the time one of SPECIAL_EXTENTS."""
    special = [v for v in SPECIAL_EXTENTS if min_value <= v <= max_value]
    plain = st.integers(min_value, max_value)
    return st.one_of(st.sampled_from(special), plain) if special else plain


def extents_or_zero(max_value):
    """Like extents(max_value), but 0 about one time in eight (an empty tensor)."""
    return st.integers(0, 7).flatmap(lambda r: st.just(0) if r == 0 else extents(max_value))


@st.composite
def shapes(draw, min_dims=1, max_dims=3, max_side=64, min_side=1, allow_empty=False, max_numel=4096):
    """A shape of min_dims..max_dims extents, numel capped at max_numel (later sides shrink to fit).
    allow_empty: each side may be 0 (with probability ~1/8). min_dims=0 allows the 0-d shape ()."""
    ndim = draw(st.integers(min_dims, max_dims))
    shape, prod = [], 1
    for _ in range(ndim):
        if allow_empty and draw(st.integers(0, 7)) == 0:
            shape.append(0)
            continue
        hi = max(min_side, min(max_side, max_numel // max(prod, 1)))
        side = draw(extents(hi, min_side))
        shape.append(side)
        prod *= side
    return tuple(shape)


def dtypes(device):
    """A floating dtype: every one of CUDA_DTYPES on either device. The CPU kernels promise
    float32/float64 (CPU_DTYPES) but accept the half types too, so those must be right as well."""
    return st.sampled_from(CPU_DTYPES + [t for t in CUDA_DTYPES if t not in CPU_DTYPES])


def index_dtypes():
    return st.sampled_from([torch.int32, torch.int64])


def seeds():
    return st.integers(0, 2**31 - 1)


@dataclass(frozen=True)
class Layout:
    """How a tensor's strides are made; `dim` is the dimension that is expanded."""
    kind: str = "contiguous"  # contiguous | transposed | sliced | offset | expanded
    dim: int = 0

    def __repr__(self):
        return f"Layout({self.kind}{', dim=%d' % self.dim if self.kind == 'expanded' else ''})"


CONTIGUOUS = Layout()
OFFSET = Layout("offset")  # contiguous, storage one element past an allocation: misaligned


@st.composite
def layouts(draw, ndim, allow_expanded=True, expand_dims=None):
    """A Layout valid for an ndim tensor. Expanded (stride 0) only where the op allows it:
    pass allow_expanded=False for tensors that are written or must hold distinct values,
    or expand_dims to restrict which dimension may have stride 0."""
    kinds = ["contiguous", "sliced", "offset"]
    if ndim >= 2:
        kinds.append("transposed")
    dims = list(range(ndim)) if expand_dims is None else [d % ndim for d in expand_dims] if ndim else []
    if allow_expanded and dims:
        kinds.append("expanded")
    kind = draw(st.sampled_from(kinds))
    dim = draw(st.sampled_from(dims)) if kind == "expanded" else 0
    return Layout(kind, dim)


def randn_sampler(dtype, device, seed, scale=1.0, shift=0.0):
    """sample(shape) -> contiguous float tensor: N(shift, scale^2) drawn in float64 on the
    CPU from a seeded generator (same values on every device), then cast."""
    g = torch.Generator().manual_seed(seed)

    def sample(shape):
        return (torch.randn(shape, generator=g, dtype=torch.float64) * scale + shift).to(device, dtype)
    return sample


def randint_sampler(low, high, dtype, device, seed):
    """sample(shape) -> contiguous integer tensor, uniform in [low, high)."""
    g = torch.Generator().manual_seed(seed)

    def sample(shape):
        return torch.randint(low, high, shape, generator=g, dtype=torch.int64).to(device, dtype)
    return sample


def with_layout(shape, layout, sample):
    """A tensor of `shape` with `layout`'s strides, values from sample(shape) (contiguous)."""
    shape = tuple(shape)
    kind = layout.kind
    if kind == "transposed" and len(shape) >= 2:
        # stored with the last two dims swapped: the last dim has a stride > 1
        return sample((*shape[:-2], shape[-1], shape[-2])).transpose(-1, -2)
    if kind == "sliced" and len(shape) >= 1:
        # step 2 in the last dim, step 3 in the first (when there are two or more)
        big = list(shape)
        big[-1] = 2 * shape[-1]
        if len(shape) >= 2:
            big[0] = 3 * shape[0]
        t = sample(tuple(big))[..., ::2]
        return t[::3] if len(shape) >= 2 else t
    if kind == "offset":
        # storage offset 1 element: breaks 16-byte alignment of every vector load
        n = math.prod(shape)
        return sample((n + 1,))[1:].view(shape)
    if kind == "expanded" and len(shape) >= 1:
        d = layout.dim % len(shape)
        small = list(shape)
        small[d] = 1 if shape[d] > 0 else 0
        return sample(tuple(small)).expand(shape)
    return sample(shape)


def make_tensor(shape, dtype, device, layout=CONTIGUOUS, seed=0, *, scale=1.0, shift=0.0, requires_grad=False):
    """A float tensor with the given layout, as a leaf (requires_grad keeps its strides)."""
    t = with_layout(shape, layout, randn_sampler(dtype, device, seed, scale, shift))
    return t.detach().requires_grad_(requires_grad)


def make_indices(shape, low, high, dtype, device, layout=CONTIGUOUS, seed=0):
    """An integer tensor uniform in [low, high) with the given layout."""
    return with_layout(shape, layout, randint_sampler(low, high, dtype, device, seed))


def grad_close(actual, ref, dtype, what, reduction=1, slack=0.0):
    """assert_close_ref for a gradient that sums `reduction` products per element: rounding
    errors grow like sqrt(reduction), so compare on that scale (``slack`` in the gradient's units)."""
    from conftest import assert_close_ref
    assert actual.shape == ref.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(ref.shape)}"
    assert actual.dtype == dtype, f"{what}: dtype {actual.dtype} != {dtype}"
    k = max(1.0, reduction) ** 0.5
    assert_close_ref(actual.double() / k, ref.double() / k, dtype, what, slack / k)


def close_to_eager(actual, ref, eager, dtype, what, reduction=1, factor=2):
    """grad_close, allowing ``factor`` times eager PyTorch's own error on the same inputs
    (``eager``: its result in the same dtype) on top of the tolerance: our kernels may round
    differently from float64, never systematically worse than eager."""
    slack = factor * (eager.double() - ref.double()).abs().max().item() if ref.numel() else 0.0
    grad_close(actual, ref.detach(), dtype, what, reduction, slack)


def norm_input(device, data, max_H):
    """(x, dtype, seed) for the norm property tests: x (..., H) with a random leading shape (none,
    empty), H, dtype and strides, and an offset mean (which makes the centring matter, and the
    fused ops' large-mean guard)."""
    dtype = data.draw(dtypes(device), "dtype")
    lead = data.draw(shapes(min_dims=0, max_dims=3, max_side=40, allow_empty=True, max_numel=200), "leading shape")
    H = data.draw(extents(max_H), "H")
    seed = data.draw(seeds(), "seed")
    shift = data.draw(st.sampled_from([0.0, 0.3, 20.0]), "mean")
    x = make_tensor((*lead, H), dtype, device, data.draw(layouts(len(lead) + 1), "x layout"), seed,
                    shift=shift, requires_grad=True)
    return x, dtype, seed
