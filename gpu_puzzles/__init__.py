"""gpu_puzzles: the GPU-puzzles kernels as PyTorch custom ops.

Importing the package loads the compiled library, which registers every op as
``torch.ops.gpu_puzzles.<name>`` (CPU and, when built with CUDA, CUDA kernels),
then adds fake kernels and autograd from :mod:`gpu_puzzles.ops`.
"""
import torch  # noqa: F401  (must be imported before the extension)

_REBUILD = ("rebuild gpu_puzzles against the torch installed here: pip install --no-build-isolation -e . "
            "(from the checkout; without -e for a regular install), or install the torch it was built against")


def _check_torch():
    """The library works with the torch it was compiled against only (C++ ABI): compared before
    it is loaded, since a library built against another torch may fail to load or crash as it
    registers its ops. Builds older than this check have no record: nothing to compare."""
    try:
        from ._built_with import TORCH_VERSION
    except ImportError:
        return
    if TORCH_VERSION != torch.__version__:
        raise ImportError(f"gpu_puzzles was built against torch {TORCH_VERSION} but torch {torch.__version__} is "
                          f"installed; {_REBUILD}")


_check_torch()
try:
    from . import _C  # noqa: F401  registers the ops with the dispatcher
except ImportError as e:  # e.g. an undefined symbol: a library built against another torch
    raise ImportError(f"gpu_puzzles: the compiled library failed to load with torch {torch.__version__} ({e}); "
                      f"{_REBUILD}") from e
# After the library: the ops' Python parts (fakes, autograd glue) register on its schemas.
from . import nn, tuning  # noqa: E402
from .ops import *  # noqa: E402,F401,F403
from .ops import __all__ as _ops_all  # noqa: E402

__all__ = list(_ops_all) + ["nn", "tuning", "build_info"]
__version__ = "0.1.0"


def build_info():
    """What the compiled library holds: ``cuda`` (CUDA kernels built), ``cuda_archs`` (the
    TORCH_CUDA_ARCH_LIST it was compiled for), ``nvcc`` (its release), ``sm90a_sources``
    (the Hopper-only kernels compiled in), ``cutlass`` (the version of the CUTLASS headers
    they were compiled with, None without them) and the ``torch`` it was built against."""
    import json
    return json.loads(torch.ops.gpu_puzzles._build_info())
