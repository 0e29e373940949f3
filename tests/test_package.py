"""The package-level helpers: gpu_puzzles.build_info(), the import's torch check and the
kernel-choice knobs."""
import os
import re

import pytest
import torch

import gpu_puzzles as gp


def test_build_info_describes_this_build():
    info = gp.build_info()
    assert set(info) >= {"torch", "cuda", "cuda_archs", "nvcc", "sm90a_sources", "cutlass"}
    assert info["torch"] == torch.__version__  # what the import check compares
    # The CUDA kernels exist iff the library registered CUDA kernels for the ops.
    has_cuda_kernel = torch._C._dispatch_has_kernel_for_dispatch_key("gpu_puzzles::softmax", "CUDA")
    assert info["cuda"] == has_cuda_kernel
    if not info["cuda"]:
        assert info["sm90a_sources"] == [] and info["cuda_archs"] is None and info["nvcc"] is None
    for src in info["sm90a_sources"]:
        assert src.startswith("csrc/") and src.endswith("_sm90.cu")
    # What was compiled, never a path (pip builds in a temporary folder that is gone afterwards).
    assert bool(info["sm90a_sources"]) == (info["cutlass"] is not None)
    if info["cutlass"] is not None:
        assert re.fullmatch(r"\d+\.\d+\.\d+", info["cutlass"]), info["cutlass"]
    assert not any(isinstance(v, str) and os.sep in v for v in info.values()), info


def test_import_checks_the_torch_it_was_built_against(monkeypatch):
    # The library works with the torch it was compiled against only: another one is an ImportError
    # that says how to rebuild, raised before the library is loaded.
    built_with = pytest.importorskip("gpu_puzzles._built_with")
    assert built_with.TORCH_VERSION == gp.build_info()["torch"]
    gp._check_torch()
    monkeypatch.setattr(built_with, "TORCH_VERSION", "2.11.0+cu999")
    with pytest.raises(ImportError, match=r"built against torch 2\.11\.0\+cu999 but torch .* is installed; "
                                          r"rebuild .*pip install --no-build-isolation"):
        gp._check_torch()


def test_knobs_listed_with_their_values():
    knobs = gp.tuning.knobs()
    assert "softmax_rows" in knobs and "attention_fwd" in knobs and "layernorm_linear_evt" in knobs
    for name, (values, current) in knobs.items():
        assert values and all(values), name
        assert current is None, f"{name} is overridden outside any override() block"


def test_knob_values_in_the_order_the_kernels_number_them():
    # C++ reads these knobs by their 1-based position in the table (enums beside each op's plan:
    # softmax_plan.h, attention.h, layernorm_linear_plan.h): a reordered table would pick other kernels.
    numbered = {
        "softmax_rows": ("cluster", "staged", "smem", "bulk"),
        "softmax_cols": ("inner", "staged"),
        "attention_bwd": ("mma", "wgmma", "wgmma_split", "wgmma_turns"),
        "attention_order": ("rows", "longest"),
        "attention_fwd_grid": ("blocks", "persistent"),
        "attention_bwd_grid": ("blocks", "persistent"),
        "layernorm_linear_evt": ("evt", "cublas"),
        "layernorm_linear_pdl": ("pdl", "plain"),
        "layernorm_linear_plan": ("fold", "normalize"),
    }
    knobs = gp.tuning.knobs()
    for name, values in numbered.items():
        assert knobs[name][0] == values, name


def test_override_sets_and_restores():
    name, (values, _) = next(iter(gp.tuning.knobs().items()))
    with gp.tuning.override(**{name: values[-1]}):
        assert gp.tuning.knobs()[name][1] == values[-1]
        with gp.tuning.override(**{name: values[0]}):
            assert gp.tuning.knobs()[name][1] == values[0]
        assert gp.tuning.knobs()[name][1] == values[-1]
        with gp.tuning.override(**{name: None}):
            assert gp.tuning.knobs()[name][1] is None
    assert gp.tuning.knobs()[name][1] is None


def test_override_restores_after_an_exception():
    name, (values, _) = next(iter(gp.tuning.knobs().items()))
    with pytest.raises(ZeroDivisionError):
        with gp.tuning.override(**{name: values[0]}):
            1 / 0
    assert gp.tuning.knobs()[name][1] is None


def test_bad_knobs_name_the_problem():
    with pytest.raises(RuntimeError, match="unknown knob 'no_such_knob'; the knobs are .*softmax_rows"):
        with gp.tuning.override(no_such_knob="x"):
            pass
    values = gp.tuning.knobs()["softmax_rows"][0]
    with pytest.raises(RuntimeError, match="knob softmax_rows takes one of auto, " + ", ".join(values)):
        with gp.tuning.override(softmax_rows="bogus"):
            pass
    # A failed override leaves every knob as it was.
    assert all(cur is None for _, cur in gp.tuning.knobs().values())


def test_python_layer_knobs():
    # Knobs read while torch.compile traces live in Python; listed and overridden like the others.
    values, current = gp.tuning.knobs()["cross_entropy_compiled_backward"]
    assert values == ("inductor", "kernel") and current is None
    assert gp.tuning.py_knob("cross_entropy_compiled_backward") == "inductor"
    with gp.tuning.override(cross_entropy_compiled_backward="kernel"):
        assert gp.tuning.knobs()["cross_entropy_compiled_backward"][1] == "kernel"
        assert gp.tuning.py_knob("cross_entropy_compiled_backward") == "kernel"
    assert gp.tuning.knobs()["cross_entropy_compiled_backward"][1] is None
    with pytest.raises(RuntimeError, match="knob cross_entropy_compiled_backward takes one of auto, inductor, kernel"):
        with gp.tuning.override(cross_entropy_compiled_backward="bogus"):
            pass
