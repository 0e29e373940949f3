"""Helpers shared by the op modules."""
import torch

FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def check_float(t, name):
    torch._check(t.dtype in FLOAT_DTYPES,
                 lambda: f"{name} must be a float32, float64, float16 or bfloat16 tensor, got {t.dtype}")


def check_same(t, ref, name, ref_name):
    torch._check(t.dtype == ref.dtype,
                 lambda: f"{name} has dtype {t.dtype} but {ref_name} has dtype {ref.dtype}; they must match")
    torch._check(t.device == ref.device,
                 lambda: f"{name} is on {t.device} but {ref_name} is on {ref.device}; they must be on the same device")


def schema_default(op, name):
    """The default of argument ``name`` in ``op``'s schema (defaults are written there only)."""
    return next(a.default_value for a in op._schema.arguments if a.name == name)
