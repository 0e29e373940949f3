"""Build script for gpu_puzzles.

CUDA kernels are compiled whenever a CUDA toolkit is found (a GPU is not needed:
CI has none).  With no GPU visible and TORCH_CUDA_ARCH_LIST unset we build for
sm_80 and sm_90 only, which keeps the 2-core build short; TORCH_CUDA_ARCH_LIST
always wins.
"""
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def _nvcc_major():
    try:
        out = subprocess.check_output([os.path.join(CUDA_HOME, "bin", "nvcc"), "--version"], text=True)
    except (OSError, subprocess.CalledProcessError, TypeError):
        return None
    m = re.search(r"release (\d+)\.", out)
    return int(m.group(1)) if m else None


def _want_cuda():
    if os.environ.get("GPU_PUZZLES_NO_CUDA", "0") == "1" or CUDA_HOME is None:
        return False
    if torch.version.cuda is None:
        print("gpu_puzzles: this torch has no CUDA support; building CPU kernels only")
        return False
    nvcc = _nvcc_major()
    torch_major = int(torch.version.cuda.split(".")[0])
    if nvcc is not None and nvcc != torch_major:
        # Mixing majors fails at link or load time; say so now, with the fix.
        raise RuntimeError(
            f"gpu_puzzles: nvcc at {CUDA_HOME} is CUDA {nvcc} but torch {torch.__version__} was built "
            f"for CUDA {torch.version.cuda}. Install a torch built for CUDA {nvcc} (the project pins one "
            f"in pyproject.toml), or point CUDA_HOME at a CUDA {torch_major} toolkit."
        )
    return True


def _links_libstdcxx_dynamically(cxx):
    """Whether `cxx -shared` output depends on libstdc++.so (None: cannot tell)."""
    with tempfile.TemporaryDirectory() as d:
        src, lib = os.path.join(d, "t.cpp"), os.path.join(d, "t.so")
        with open(src, "w") as f:
            f.write("#include <sstream>\nint f(int v) { std::ostringstream o; o << v; return (int)o.str().size(); }\n")
        try:
            subprocess.run(shlex.split(cxx) + ["-shared", "-fPIC", src, "-o", lib], check=True, capture_output=True)
            dyn = subprocess.run(["readelf", "-d", lib], check=True, capture_output=True, text=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return None
    return "libstdc++" in dyn


def _check_compiler():
    # A compiler that links its own libstdc++ statically (seen on the H100 machine,
    # where CXX=/opt/gcc/bin/g++) puts a second C++ runtime beside the one torch
    # loads; the two share the locale data, and the first number formatted in an
    # error message then segfaults. Fall back to the system g++ in that case.
    if not sys.platform.startswith("linux"):
        return
    cxx = os.environ.get("CXX", "c++")
    if _links_libstdcxx_dynamically(cxx) is not False:
        return
    for alt_cxx, alt_cc in (("g++", "gcc"), ("c++", "cc")):
        if shutil.which(alt_cxx) and shutil.which(alt_cc) and _links_libstdcxx_dynamically(alt_cxx):
            print(f"gpu_puzzles: the C++ compiler {cxx!r} links libstdc++ statically, which crashes beside "
                  f"torch's shared libstdc++; building with {alt_cxx!r} / {alt_cc!r} instead")
            os.environ["CXX"], os.environ["CC"] = alt_cxx, alt_cc
            os.environ.pop("LDSHARED", None)
            os.environ.pop("LDCXXSHARED", None)
            return
    raise RuntimeError(f"gpu_puzzles: the C++ compiler {cxx!r} links libstdc++ statically and no system g++ "
                       "that links it dynamically was found; set CXX/CC to one that does")


# The Hopper attention forward (csrc/attention/attention_fwd_sm90.cu) needs the CUTLASS/CuTe
# headers: $CUTLASS_PATH/include, or the source/include beside an installed cutlass_library
# package (pip nvidia-cutlass). Without them it is left out (the other kernels do not need it).
_SM90_ATTN = os.path.join("csrc", "attention", "attention_fwd_sm90.cu")


def _cutlass_include():
    cands = []
    if os.environ.get("CUTLASS_PATH"):
        cands.append(os.path.join(os.environ["CUTLASS_PATH"], "include"))
    try:
        import importlib.util
        spec = importlib.util.find_spec("cutlass_library")
        if spec is not None and spec.origin:
            cands.append(os.path.join(os.path.dirname(spec.origin), "source", "include"))
    except (ImportError, ValueError):
        pass
    for c in cands:
        if os.path.isfile(os.path.join(c, "cute", "tensor.hpp")) and os.path.isfile(
                os.path.join(c, "cutlass", "numeric_types.h")):
            return c
    return None


def _map_sm90a():
    # wgmma exists only in the arch-specific sm_90a target: build 9.0 as 9.0a (a superset for
    # H100/H200). Unset list with a GPU visible: the visible devices' archs, as torch would.
    lst = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if not lst or lst == "native":
        caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
        lst = ";".join(f"{a}.{b}" for a, b in caps)
    items = [x for x in lst.replace(" ", ";").split(";") if x]
    items = ["9.0a" + x[3:] if x.split("+")[0] == "9.0" else x for x in items]
    os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(items)


def extensions():
    _check_compiler()
    with_cuda = _want_cuda()
    cpp = sorted(glob.glob("csrc/**/*.cpp", recursive=True))
    cu = sorted(glob.glob("csrc/**/*.cu", recursive=True))
    cxx_flags = ["-O3", "-std=c++17"]
    if not with_cuda:
        return [CppExtension("gpu_puzzles._C", cpp, include_dirs=[os.path.join(ROOT, "csrc")],
                             extra_compile_args={"cxx": cxx_flags})]
    if "TORCH_CUDA_ARCH_LIST" not in os.environ and not torch.cuda.is_available():
        os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0"
    nvcc_flags = ["-O3", "-std=c++17", "-lineinfo", "--expt-relaxed-constexpr"]
    include_dirs = [os.path.join(ROOT, "csrc")]
    cutlass_inc = _cutlass_include()
    if cutlass_inc is None:
        cu = [f for f in cu if os.path.normpath(f) != _SM90_ATTN]
        print("gpu_puzzles: CUTLASS headers not found (CUTLASS_PATH / cutlass_library); "
              "building without the sm_90a wgmma attention forward")
    else:
        _map_sm90a()
        include_dirs.append(cutlass_inc)
        nvcc_flags.append("-DGPU_PUZZLES_WITH_SM90_ATTN")
    return [CUDAExtension(
        "gpu_puzzles._C", cpp + cu,
        include_dirs=include_dirs,
        define_macros=[("WITH_CUDA", None)],
        extra_compile_args={"cxx": cxx_flags + ["-DWITH_CUDA"], "nvcc": nvcc_flags},
    )]


# The extension is built against the torch present at build time; pin that exact
# version at run time so pip never pairs the binary with another torch ABI.
_torch_pin = "torch==" + torch.__version__.split("+")[0]

setup(
    packages=find_packages(include=["gpu_puzzles", "gpu_puzzles.*"]),
    ext_modules=extensions(),
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    install_requires=[_torch_pin, "numpy", "rich"],
)
