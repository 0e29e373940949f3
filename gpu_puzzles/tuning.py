"""Overrides of the per-op kernel heuristics, for tests and tuning sweeps.

Each op picks its kernel from one heuristic in C++; a *knob* overrides one of its
choices for the whole process until reset. The knobs and their values are listed by
:func:`knobs` (the table lives in ``csrc/common/kernel_choice.cpp``)::

    with gpu_puzzles.tuning.override(softmax_rows="smem", softmax_cluster=16):
        y = gpu_puzzles.softmax(x)

Not for production use: the defaults are what the benchmarks measured best.
"""
import contextlib

import torch

__all__ = ["knobs", "override"]


def knobs():
    """``{name: (allowed values, current override or None)}`` for every knob."""
    out = {}
    for row in torch.ops.gpu_puzzles._knobs():
        name, rest = row.split("=", 1)
        values, current = rest.rsplit(":", 1)
        out[name] = (tuple(values.split("|")), current or None)
    return out


@contextlib.contextmanager
def override(**choices):
    """Set knobs (``name=value``; ``None`` or ``"auto"`` leaves the heuristic) for the
    duration of the ``with`` block, then restore the previous settings."""
    previous = {}
    try:
        for name, value in choices.items():
            value = "" if value is None else str(value)
            previous[name] = torch.ops.gpu_puzzles._set_knob(name, value)
        yield
    finally:
        for name, value in previous.items():
            torch.ops.gpu_puzzles._set_knob(name, value)
