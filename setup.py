"""Build script for gpu_puzzles.

CUDA kernels are compiled whenever a CUDA toolkit is found (a GPU is not needed:
CI has none).  With no GPU visible and TORCH_CUDA_ARCH_LIST unset we build for
sm_80 and sm_90 only, which keeps the 2-core build short; TORCH_CUDA_ARCH_LIST
always wins.  With the CUTLASS headers present (CUTLASS_PATH, or the nvidia-cutlass
wheel) and a 9.0 target, the Hopper-only files (csrc/**/*_sm90.cu: wgmma/TMA kernels)
are compiled apart for sm_90a and linked in; GPU_PUZZLES_NO_CUTLASS=1 builds without
them.  What was built is compiled into the library: gpu_puzzles.build_info().
The library only works with the torch it was compiled against (C++ ABI); importing
gpu_puzzles checks that, and says to rebuild (pip install --no-build-isolation) if not.
CPU kernel files that use the run-time SIMD dispatch (csrc/common/cpu_isa.h) are also
compiled for AVX2 and AVX-512 on x86-64; the baseline build runs on every CPU.
"""
import functools
import glob
import json
import os
import platform
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


@functools.lru_cache(maxsize=None)
def _nvcc_version():
    """nvcc's release ("13.0"), or None; asked once (the major check and build_info use it)."""
    try:
        out = subprocess.check_output([os.path.join(CUDA_HOME, "bin", "nvcc"), "--version"], text=True)
    except (OSError, subprocess.CalledProcessError, TypeError):
        return None
    m = re.search(r"release ([\d.]+)", out)
    return m.group(1) if m else None


def _nvcc_major():
    v = _nvcc_version()
    return int(v.split(".")[0]) if v else None


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


@functools.lru_cache(maxsize=None)
def _openmp_flags():
    """["-fopenmp"] where the C++ compiler takes it (Linux), else [].

    at::parallel_for is an inline OpenMP loop in the headers of torch's OpenMP builds
    (every Linux wheel): compiled without -fopenmp it runs on one thread. The
    extension's libgomp.so.1 is the one torch has already loaded (same soname).
    """
    if not sys.platform.startswith("linux"):
        return []
    cxx = os.environ.get("CXX", "c++")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "t.cpp")
        with open(src, "w") as f:
            f.write("#include <omp.h>\nint f() { return omp_get_max_threads(); }\n")
        try:
            subprocess.run(shlex.split(cxx) + ["-fopenmp", "-shared", "-fPIC", src, "-o", os.path.join(d, "t.so")],
                           check=True, capture_output=True)
        except (OSError, subprocess.CalledProcessError):
            print(f"gpu_puzzles: {cxx!r} does not take -fopenmp; the CPU kernels will run on one thread")
            return []
    return ["-fopenmp"]


def _cutlass_include_dirs():
    """CUTLASS 3/4 header dirs (include/, tools/util/include/), or None.

    From CUTLASS_PATH (a CUTLASS checkout), else from an installed nvidia-cutlass
    wheel's cutlass_library package (located, not imported: its __init__ does work).
    """
    roots = []
    if os.environ.get("CUTLASS_PATH"):
        roots.append(os.environ["CUTLASS_PATH"])
    try:
        import importlib.util
        spec = importlib.util.find_spec("cutlass_library")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        roots += [os.path.join(p, "source") for p in spec.submodule_search_locations]
    for root in roots:
        dirs = [os.path.join(root, "include"), os.path.join(root, "tools", "util", "include")]
        if (os.path.isfile(os.path.join(dirs[0], "cutlass", "epilogue", "fusion",
                                        "sm90_visitor_tma_warpspecialized.hpp"))
                and os.path.isfile(os.path.join(dirs[1], "cutlass", "util", "packed_stride.hpp"))):
            return dirs
    return None


def _arch_list_with_sm90a():
    """TORCH_CUDA_ARCH_LIST with 9.0 -> 9.0a, or None if it targets no 9.0 GPU.

    The CUTLASS kernels use wgmma/TMA (sm_90a only); a plain 9.0 image would hold
    CUTLASS's do-nothing stubs. Unset list with a GPU visible: the visible GPUs'
    capabilities, as torch would pick them.
    """
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if not arch or arch == "native":
        caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
        if not caps:
            return None
        arch = ";".join(f"{a}.{b}" for a, b in caps) + "+PTX"
    out = []
    for a in arch.replace(" ", ";").split(";"):
        if not a:
            continue
        base, ptx = (a[:-4], "+PTX") if a.endswith("+PTX") else (a, "")
        out.append(("9.0a" if base == "9.0" else base) + ptx)
    return ";".join(out) if any(a.startswith("9.0a") for a in out) else None

def _cutlass_version(include_dir):
    """"4.2.0" from include/cutlass/version.h, or None."""
    try:
        text = open(os.path.join(include_dir, "cutlass", "version.h")).read()
    except OSError:
        return None
    parts = [re.search(rf"#define CUTLASS_{k}\s+(\d+)", text) for k in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) for m in parts) if all(parts) else None


# Built for sm_90a alone (Sm90aBuildExtension), with the CUTLASS/CuTe headers; left out without them.
_SM90A_SOURCES = tuple(sorted(glob.glob(os.path.join("csrc", "**", "*_sm90.cu"), recursive=True)))
_GENERATED = os.path.join(ROOT, "build", "generated")


# The extra SIMD levels of the CPU kernels (csrc/common/cpu_isa.h): flags, lowest level first
# (that is their link order, which cpu_isa.h relies on). Only x86-64 with GCC/Clang; elsewhere
# the baseline build alone.
_CPU_ISA_FLAGS = (
    ("avx2", ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]),
    ("avx512", ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c",
                "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]),
)


def _cpu_isa_sources(cpp):
    """The .cpp files whose kernels live in `namespace GP_CPU_NS` (compiled once per level), or
    [] where only the baseline is built."""
    if sys.platform == "win32" or platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    def uses_dispatch(path):
        with open(path) as f:
            return re.search(r"namespace\s+GP_CPU_NS\b", f.read()) is not None
    return [f for f in cpp if uses_dispatch(f)]


def _write_build_info(info):
    """csrc sees what was built through build/generated/gpu_puzzles_build_info.h
    (gpu_puzzles.build_info() returns it). Rewritten only when it changes, so ninja
    rebuilds nothing on an unchanged configuration. The torch version also goes to
    gpu_puzzles/_built_with.py, which the package reads before it loads the library (a
    library built against another torch may fail to load or crash as it registers its ops)."""
    built_with = os.path.join(ROOT, "gpu_puzzles", "_built_with.py")
    text = ("# Generated by setup.py: the torch this build of gpu_puzzles was compiled against.\n"
            f"TORCH_VERSION = {info['torch']!r}\n")
    if not os.path.exists(built_with) or open(built_with).read() != text:
        with open(built_with, "w") as f:
            f.write(text)
    os.makedirs(_GENERATED, exist_ok=True)
    text = ("// Generated by setup.py: what this build of gpu_puzzles holds.\n#pragma once\n"
            f"#define GPU_PUZZLES_BUILD_INFO {json.dumps(json.dumps(info, sort_keys=True))}\n")
    path = os.path.join(_GENERATED, "gpu_puzzles_build_info.h")
    if not os.path.exists(path) or open(path).read() != text:
        with open(path, "w") as f:
            f.write(text)


def extensions():
    _check_compiler()
    with_cuda = _want_cuda()
    cpp = sorted(glob.glob("csrc/**/*.cpp", recursive=True))
    cu = sorted(glob.glob("csrc/**/*.cu", recursive=True))
    cxx_flags = ["-O3", "-std=c++17"] + _openmp_flags()
    link_flags = _openmp_flags()
    cpu_isa_sources = _cpu_isa_sources(cpp)
    if cpu_isa_sources:
        cxx_flags.append("-DGP_CPU_MULTI_ISA")
    info = {"torch": torch.__version__, "cuda": with_cuda, "cuda_archs": None, "nvcc": None,
            "sm90a_sources": [], "cutlass": None}
    if not with_cuda:
        _write_build_info(info)
        ext = CppExtension("gpu_puzzles._C", cpp, include_dirs=[os.path.join(ROOT, "csrc"), _GENERATED],
                           extra_compile_args={"cxx": cxx_flags}, extra_link_args=link_flags)
        ext.cpu_isa_sources = cpu_isa_sources
        return [ext]
    if "TORCH_CUDA_ARCH_LIST" not in os.environ and not torch.cuda.is_available():
        os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0"
    nvcc_flags = ["-O3", "-std=c++17", "-lineinfo", "--expt-relaxed-constexpr"]
    include_dirs = [os.path.join(ROOT, "csrc"), _GENERATED]
    # The *_sm90.cu files (wgmma/TMA kernels, CUTLASS/CuTe headers) need an sm_90a image.
    # torch applies one arch list to every .cu file, so they are not in the extension's
    # sources: Sm90aBuildExtension compiles them alone for sm_90a and links the objects
    # in, and every other kernel keeps its sm_80/sm_90 build. Without them the ops take
    # their portable kernels (cuBLAS + epilogue pass, mma.sync attention).
    cu = [f for f in cu if os.path.normpath(f) not in _SM90A_SOURCES]
    cutlass_dirs = None
    if os.environ.get("GPU_PUZZLES_NO_CUTLASS", "0") != "1":
        cutlass_dirs = _cutlass_include_dirs()
        if not cutlass_dirs:
            print("gpu_puzzles: CUTLASS headers not found (set CUTLASS_PATH or pip install nvidia-cutlass); "
                  "building without the sm_90a kernels (LayerNorm+Linear GEMM, wgmma attention)")
        elif not _arch_list_with_sm90a():
            print("gpu_puzzles: TORCH_CUDA_ARCH_LIST has no 9.0 target; building without the sm_90a kernels "
                  "(LayerNorm+Linear GEMM, wgmma attention)")
            cutlass_dirs = None
    macros = ["-DGPU_PUZZLES_WITH_SM90A"] if cutlass_dirs else []
    info.update(cuda_archs=os.environ.get("TORCH_CUDA_ARCH_LIST") or "the visible GPUs", nvcc=_nvcc_version(),
                sm90a_sources=[f.replace(os.sep, "/") for f in _SM90A_SOURCES] if cutlass_dirs else [],
                cutlass=_cutlass_version(cutlass_dirs[0]) if cutlass_dirs else None)
    _write_build_info(info)
    ext = CUDAExtension(
        "gpu_puzzles._C", cpp + cu,
        include_dirs=include_dirs,
        define_macros=[("WITH_CUDA", None)],
        extra_compile_args={"cxx": cxx_flags + ["-DWITH_CUDA"] + macros, "nvcc": nvcc_flags + macros},
        extra_link_args=link_flags,
    )
    ext.cpu_isa_sources = cpu_isa_sources
    if cutlass_dirs:
        ext.sm90a_sources = list(_SM90A_SOURCES)
        ext.sm90a_flags = nvcc_flags + macros + ["-I" + d for d in include_dirs + cutlass_dirs]
    return [ext]


def _sm90a_up_to_date(obj, cmd):
    """obj was built by the same command and is newer than its source and every header nvcc
    listed for it (obj.d), as ninja decides for the other files: the sm_90a files are the
    slowest of the build, so an unchanged one is not compiled again."""
    try:
        with open(obj + ".cmd") as f:
            if f.read() != " ".join(cmd):
                return False
        with open(obj + ".d") as f:
            deps = f.read().replace("\\\n", " ").split(":", 1)[1].split()
        built = os.path.getmtime(obj)
        return all(os.path.getmtime(d) < built for d in deps)
    except (OSError, IndexError):
        return False


class Sm90aBuildExtension(BuildExtension):
    """BuildExtension that first compiles an extension's ``sm90a_sources`` with nvcc for
    sm_90a only (wgmma/TMA need the arch-specific target) and links the objects in; and
    its ``cpu_isa_sources`` once more per extra SIMD level (csrc/common/cpu_isa.h)."""

    def build_extension(self, ext):
        # Here BuildExtension has added its flags and its ninja compile: each level is
        # one more incremental ninja build, in its own folder.
        srcs = getattr(ext, "cpu_isa_sources", None)
        if srcs:
            args = ext.extra_compile_args
            base = args["cxx"] if isinstance(args, dict) else list(args)
            objs = []
            for isa, flags in _CPU_ISA_FLAGS:
                out_dir = os.path.join(os.path.abspath(self.build_temp), "cpu_" + isa)
                objs += self.compiler.compile(srcs, output_dir=out_dir, macros=ext.define_macros,
                                              include_dirs=ext.include_dirs, extra_postargs={"cxx": base + flags})
            ext.extra_objects = [o for o in (ext.extra_objects or []) if o not in objs] + objs
        super().build_extension(ext)

    def build_extensions(self):
        for ext in self.extensions:
            srcs = getattr(ext, "sm90a_sources", None)
            if not srcs:
                continue
            out_dir = os.path.join(os.path.abspath(self.build_temp), "sm90a")
            os.makedirs(out_dir, exist_ok=True)
            from torch.utils.cpp_extension import COMMON_NVCC_FLAGS
            nvcc = [os.path.join(CUDA_HOME, "bin", "nvcc")]
            if os.environ.get("CC"):  # the host compiler torch's own nvcc calls get
                nvcc += ["-ccbin", os.environ["CC"]]
            procs, objs = [], []
            for src in srcs:
                obj = os.path.join(out_dir, os.path.splitext(os.path.basename(src))[0] + ".o")
                cmd = nvcc + ["-c", os.path.join(ROOT, src), "-o", obj, "-Xcompiler", "-fPIC",
                              "-gencode=arch=compute_90a,code=sm_90a"] + COMMON_NVCC_FLAGS + ext.sm90a_flags
                objs.append(obj)
                if _sm90a_up_to_date(obj, cmd):
                    print("gpu_puzzles: sm_90a: up to date: " + obj)
                    continue
                print("gpu_puzzles: sm_90a: " + " ".join(cmd))
                # -MD/-MF: nvcc lists the headers the object depends on, for the check above.
                procs.append((subprocess.Popen(cmd + ["-MD", "-MF", obj + ".d"]), obj, cmd))  # side by side
            for p, obj, cmd in procs:
                if p.wait() != 0:
                    raise RuntimeError("gpu_puzzles: nvcc failed on an sm_90a source (command above)")
                with open(obj + ".cmd", "w") as f:  # only once built: a failed build is never up to date
                    f.write(" ".join(cmd))
            ext.extra_objects = list(ext.extra_objects or []) + objs
        super().build_extensions()


# The oldest torch the sources build against (the one the project is tested with).
TORCH_MIN = "2.11"


def _torch_requirement():
    """The run-time torch requirement. The library works with the torch it was compiled
    against only (C++ ABI), which gpu_puzzles checks as it is imported. A torch already in
    the environment being installed into is kept: the requirement is then the range
    ``torch>=TORCH_MIN``, so pip never replaces it; built against it (pip install
    --no-build-isolation) the library matches it, built in pip's isolated build environment
    against another version the import says to rebuild. With no torch there (a fresh
    machine), the build's own version is pinned, so pip installs the torch the library was
    compiled against."""
    import importlib.metadata
    import sysconfig
    paths = sorted({sysconfig.get_paths()[k] for k in ("purelib", "platlib")})
    if any(True for _ in importlib.metadata.distributions(name="torch", path=paths)):
        return f"torch>={TORCH_MIN}"
    return "torch==" + torch.__version__.split("+")[0]


setup(
    packages=find_packages(include=["gpu_puzzles", "gpu_puzzles.*"]),
    ext_modules=extensions(),
    cmdclass={"build_ext": Sm90aBuildExtension.with_options(use_ninja=True)},
    install_requires=[_torch_requirement(), "numpy", "rich"],
)
