"""Shared test fixtures: the devices under test and dtype tolerances."""
import pytest
import torch

import gpu_puzzles  # noqa: F401  registers the ops

HAS_CUDA = torch.cuda.is_available()

DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
CPU_DTYPES = [torch.float32, torch.float64]
CUDA_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]

# Relative-to-scale tolerance of a result against a float64 reference.
TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}

requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


def device_dtypes():
    """(device, dtype) pairs every op supports."""
    pairs = [("cpu", d) for d in CPU_DTYPES]
    if HAS_CUDA:
        pairs += [("cuda", d) for d in CUDA_DTYPES]
    return pairs


def assert_close_ref(actual, ref, dtype, what=""):
    """Compare with a float64 reference: max error relative to the reference's scale."""
    assert not torch.isnan(actual).any(), f"{what}: NaN in result"
    scale = max(1.0, ref.abs().max().item())
    err = (actual.double() - ref.double()).abs().max().item() if ref.numel() else 0.0
    assert err <= TOL[dtype] * scale * 4, f"{what}: max error {err:.3e} > {TOL[dtype] * scale * 4:.3e} ({dtype})"


def poison(t):
    """Fill with NaN so any element a kernel fails to write shows up."""
    return t.fill_(float("nan"))
