"""Fingerprint every kernel's SASS in a checkout, to show that a refactor left the
device code unchanged (then earlier sanitizer and benchmark records still hold).

Compiles each csrc/**/*.cu for one arch (the *_sm90.cu files for sm_90a with the
CUTLASS headers), disassembles with cuobjdump, and writes {kernel: sha1 of its SASS}
with the file-specific parts of the names (anonymous namespaces) and the line
info normalised away. Compare two checkouts with --compare A.json B.json.
cuobjdump: from PATH, else $CUDA_HOME/bin, else the copy triton ships (a toolkit
without it, as on the development machines, still fingerprints).

    python tools/sass_fingerprint.py --root . --out new.json [--arch sm_90] [--jobs 2] [--only 'softmax/*']
    python tools/sass_fingerprint.py --compare old.json new.json
"""
import argparse
import concurrent.futures as cf
import fnmatch
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile


def _cutlass_includes():
    import cutlass_library
    root = os.path.join(os.path.dirname(cutlass_library.__file__), "source")
    return ["-I" + os.path.join(root, "include"), "-I" + os.path.join(root, "tools", "util", "include")]


def _cuobjdump():
    """The cuobjdump to run: PATH's, the CUDA toolkit's, or triton's bundled copy."""
    found = shutil.which("cuobjdump")
    candidates = [os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "cuobjdump")]
    try:
        import triton
        candidates.append(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"))
    except ImportError:
        pass
    found = found or next((c for c in candidates if os.access(c, os.X_OK)), None)
    if found is None:
        raise SystemExit(f"sass_fingerprint: no cuobjdump on PATH nor at {', '.join(candidates)}")
    return found


def _compile(src, root, arch, gen_dir, tmp):
    sm90a = src.endswith("_sm90.cu")
    target = "sm_90a" if sm90a else arch
    cubin = os.path.join(tmp, re.sub(r"\W", "_", src) + ".cubin")
    cmd = ["nvcc", "-cubin", "-std=c++17", "-O3", "--expt-relaxed-constexpr", "-DWITH_CUDA",
           f"-arch={target}", "-I" + os.path.join(root, "csrc"), "-I" + gen_dir, src, "-o", cubin]
    if sm90a:  # the two older macro names too, so checkouts before their merge compare as built
        cmd[1:1] = ["-DGPU_PUZZLES_WITH_SM90A", "-DGPU_PUZZLES_WITH_CUTLASS=1", "-DGPU_PUZZLES_WITH_SM90_ATTN"] + \
            _cutlass_includes()
    subprocess.run(cmd, check=True, cwd=root)
    return subprocess.run([_cuobjdump(), "-sass", cubin], check=True, capture_output=True, text=True).stdout


# Anonymous namespaces are mangled with the file's name and a hash (length-prefixed).
_ANON = re.compile(r"\d+_GLOBAL__N__[0-9a-f]+_\d+_[A-Za-z0-9_]+?_cu_[0-9a-f]{8}")


def _split(sass):
    out, name, body = {}, None, []
    for line in sass.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            if name:
                out[name] = body
            name, body = _ANON.sub("ANON", m.group(1)), []
        elif name and re.match(r"\s*/\*[0-9a-f]{4}\*/", line):
            # cuobjdump pads columns by the longest name in the file: compare without spaces
            body.append("".join(_ANON.sub("ANON", re.sub(r"/\*[0-9a-f]{4}\*/", "", line)).split()))
    if name:
        out[name] = body
    return {k: hashlib.sha1("\n".join(v).encode()).hexdigest()[:16] for k, v in out.items()}


def fingerprint(root, arch, jobs, only=()):
    root = os.path.abspath(root)
    srcs = sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "csrc", "**", "*.cu"), recursive=True))
    if only:  # globs relative to csrc/, e.g. "softmax/*": a refactor's files, not the whole build
        srcs = [s for s in srcs if any(fnmatch.fnmatch(os.path.relpath(s, "csrc"), g) for g in only)]
    gen = os.path.join(root, "build", "generated")
    os.makedirs(gen, exist_ok=True)
    hdr = os.path.join(gen, "gpu_puzzles_build_info.h")
    if not os.path.exists(hdr):
        open(hdr, "w").write('#pragma once\n#define GPU_PUZZLES_BUILD_INFO "{}"\n')
    kernels = {}
    with tempfile.TemporaryDirectory() as tmp, cf.ThreadPoolExecutor(jobs) as ex:
        for src, sass in zip(srcs, ex.map(lambda s: _compile(s, root, arch, gen, tmp), srcs)):
            for k, h in _split(sass).items():
                kernels.setdefault(k, []).append(h)
            print(f"{src}: done", file=sys.stderr)
    return {k: sorted(v) for k, v in kernels.items()}


def compare(a_path, b_path):
    """A kernel counts as unchanged when its SASS occurs in the other build under any
    name (a move to another file or namespace renames it)."""
    a, b = json.load(open(a_path)), json.load(open(b_path))
    hb = {h for v in b.values() for h in v}
    ha = {h for v in a.values() for h in v}
    same = [k for k in a if k in b and a[k] == b[k]]
    moved = sorted(k for k in a if k not in same and set(a[k]) <= hb)
    changed = sorted(k for k in a if k not in same and k not in moved)
    new = sorted(k for k in b if not set(b[k]) <= ha)
    print(f"{len(a)} kernels in {a_path}: {len(same)} identical, {len(moved)} identical under another name, "
          f"{len(changed)} with no identical kernel in {b_path}; {len(new)} kernels of {b_path} new or changed")
    for title, names in (("changed or gone", changed), ("new or changed", new)):
        for n in names:
            print(f"  {title}: {n}")
    return 0 if not (changed or new) else 1


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default=".")
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out")
    p.add_argument("--only", nargs="*", default=(), help="globs of .cu files relative to csrc/ (default: all)")
    p.add_argument("--compare", nargs=2)
    a = p.parse_args()
    if a.compare:
        sys.exit(compare(*a.compare))
    json.dump(fingerprint(a.root, a.arch, a.jobs, a.only), open(a.out, "w"), indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
