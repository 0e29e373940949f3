"""The package-level helpers: gpu_puzzles.build_info() and the kernel-choice knobs."""
import pytest
import torch

import gpu_puzzles as gp


def test_build_info_describes_this_build():
    info = gp.build_info()
    assert set(info) >= {"torch", "cuda", "cuda_archs", "nvcc", "sm90a_sources", "cutlass_include"}
    assert info["torch"].split("+")[0] == torch.__version__.split("+")[0]
    # The CUDA kernels exist iff the library registered CUDA kernels for the ops.
    has_cuda_kernel = torch._C._dispatch_has_kernel_for_dispatch_key("gpu_puzzles::softmax", "CUDA")
    assert info["cuda"] == has_cuda_kernel
    if not info["cuda"]:
        assert info["sm90a_sources"] == [] and info["cuda_archs"] is None
    for src in info["sm90a_sources"]:
        assert src.startswith("csrc/") and src.endswith("_sm90.cu")
    assert bool(info["sm90a_sources"]) == (info["cutlass_include"] is not None)


def test_knobs_listed_with_their_values():
    knobs = gp.tuning.knobs()
    assert "softmax_rows" in knobs and "attention_fwd" in knobs and "layernorm_linear_evt" in knobs
    for name, (values, current) in knobs.items():
        assert values and all(values), name
        assert current is None, f"{name} is overridden outside any override() block"


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
