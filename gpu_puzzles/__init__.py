"""gpu_puzzles: the GPU-puzzles kernels as PyTorch custom ops.

Importing the package loads the compiled library, which registers every op as
``torch.ops.gpu_puzzles.<name>`` (CPU and, when built with CUDA, CUDA kernels),
then adds fake kernels and autograd from :mod:`gpu_puzzles.ops`.
"""
import torch  # noqa: F401  (must be imported before the extension)

from . import _C  # noqa: F401  registers the ops with the dispatcher
from .ops import *  # noqa: F401,F403
from .ops import __all__ as _ops_all
from . import nn, tuning  # noqa: E402

__all__ = list(_ops_all) + ["nn", "tuning", "build_info"]
__version__ = "0.1.0"


def build_info():
    """What the compiled library holds: ``cuda`` (CUDA kernels built), ``cuda_archs``,
    ``nvcc``, ``sm90a_sources`` (the Hopper-only kernels compiled in), ``cutlass_include``
    and the ``torch`` it was built against."""
    import json
    return json.loads(torch.ops.gpu_puzzles._build_info())
