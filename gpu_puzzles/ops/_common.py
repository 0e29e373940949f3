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


def register_fake(qualname):
    """``torch.library.register_fake`` for a ``gpu_puzzles::`` op, with every Tensor argument
    checked first to be on one device, meta included, as the C++ kernels check theirs. A call
    with some arguments on meta and the rest on the CPU or a GPU dispatches to this meta kernel
    (meta outranks the other backends), which would otherwise return uninitialised memory on
    the other device. The message names the argument, as the C++ checks do."""
    import functools

    op = qualname.split("::", 1)[1]
    names = [a.name for a in getattr(torch.ops.gpu_puzzles, op).default._schema.arguments]

    def decorate(fn):
        @functools.wraps(fn)
        def checked(*args, **kwargs):
            first = None
            for name, a in [*zip(names, args), *kwargs.items()]:
                if not isinstance(a, torch.Tensor):
                    continue
                if first is None:
                    first = (name, a.device)
                elif a.device != first[1]:
                    raise RuntimeError(f"{op}: {name} is on {a.device} but {first[0]} is on {first[1]}; they must "
                                       f"be on the same device")
            return fn(*args, **kwargs)

        torch.library.register_fake(qualname)(checked)
        return fn

    return decorate
