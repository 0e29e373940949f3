"""Overrides of the per-op kernel heuristics, for tests and tuning sweeps.

Each op picks its kernel from one heuristic in C++; a *knob* overrides one of its
choices for the whole process until reset. The knobs and their values are listed by
:func:`knobs` (the table lives in ``csrc/common/kernel_choice.cpp``)::

    with gpu_puzzles.tuning.override(softmax_rows="smem", softmax_cluster=16):
        y = gpu_puzzles.softmax(x)

Not for production use: the defaults are what the benchmarks measured best.

A few knobs belong to the Python layer (``PY_KNOBS``): they choose how an op is traced
under ``torch.compile``, where a call into the C++ table cannot be traced; dynamo guards
on their values, so changing one recompiles.
"""
import contextlib

import torch

__all__ = ["knobs", "override"]

# name -> allowed values, first the default.
PY_KNOBS = {
    # cross_entropy's backward under torch.compile: "inductor" (ATen math that inductor
    # fuses with what surrounds it, e.g. the logits' own gradient when the model also
    # returns them) or "kernel" (our backward op, as in eager mode).
    "cross_entropy_compiled_backward": ("inductor", "kernel"),
}
_py_values = {name: None for name in PY_KNOBS}


def py_knob(name: str) -> str:
    """The value a Python-layer knob is set to, else its default."""
    return _py_values[name] or PY_KNOBS[name][0]


def knobs():
    """``{name: (allowed values, current override or None)}`` for every knob."""
    out = {}
    for row in torch.ops.gpu_puzzles._knobs():
        name, rest = row.split("=", 1)
        values, current = rest.rsplit(":", 1)
        out[name] = (tuple(values.split("|")), current or None)
    for name, values in PY_KNOBS.items():
        out[name] = (values, _py_values[name])
    return out


def _set(name: str, value: str) -> str:
    """Sets one knob ("" = auto); returns its previous value as a string."""
    if name not in PY_KNOBS:
        return torch.ops.gpu_puzzles._set_knob(name, value)
    if value not in ("", "auto") and value not in PY_KNOBS[name]:
        raise RuntimeError(f"knob {name} takes one of auto, {', '.join(PY_KNOBS[name])}; got '{value}'")
    before = _py_values[name] or ""
    _py_values[name] = None if value in ("", "auto") else value
    return before


@contextlib.contextmanager
def override(**choices):
    """Set knobs (``name=value``; ``None`` or ``"auto"`` leaves the heuristic) for the
    duration of the ``with`` block, then restore the previous settings."""
    previous = {}
    try:
        for name, value in choices.items():
            value = "" if value is None else str(value)
            previous[name] = _set(name, value)
        yield
    finally:
        for name, value in previous.items():
            _set(name, value)
