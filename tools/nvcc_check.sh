#!/usr/bin/env bash
# Compile-checks the CUDA build's files here (no GPU): each given .cu alone for sm_90a (the
# *_sm90.cu files need it; the others build for sm_80/sm_90 in setup.py, and sm_90a catches
# the same errors), and each .cpp with WITH_CUDA defined (a GPU_PUZZLES_NO_CUDA=1 build
# skips those branches). Objects go to a temporary folder and are thrown away.
#   PYTHON=/work/venv/bin/python bash tools/nvcc_check.sh csrc/softmax/softmax_rows.cu csrc/softmax/softmax.cpp
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_INC=$("$PY" -c "from torch.utils.cpp_extension import include_paths; print(' '.join('-I'+p for p in include_paths()))")
CUTLASS_INC=$("$PY" -c "
import importlib.util, os
s = importlib.util.find_spec('cutlass_library') or importlib.util.find_spec('cutlass')
roots = [os.path.join(p, 'source') for p in (s.submodule_search_locations or [])] if s else []
print(' '.join('-I'+os.path.join(r, d) for r in roots for d in ('include', 'tools/util/include') if os.path.isdir(os.path.join(r, d))))" 2>/dev/null || true)
mkdir -p build/generated
[ -f build/generated/gpu_puzzles_build_info.h ] || echo '#pragma once' > build/generated/gpu_puzzles_build_info.h
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for f in "$@"; do
  echo "check: $f"
  if [[ "$f" == *.cpp ]]; then
    ${CXX:-c++} -O0 -std=c++17 -fsyntax-only -DWITH_CUDA -DGPU_PUZZLES_WITH_SM90A -Icsrc -Ibuild/generated \
      $TORCH_INC -I/usr/local/cuda/include "$f"
    continue
  fi
  /usr/local/cuda/bin/nvcc -O1 -std=c++17 --expt-relaxed-constexpr -DWITH_CUDA -DGPU_PUZZLES_WITH_SM90A \
    -gencode arch=compute_90a,code=sm_90a -Icsrc -Ibuild/generated $TORCH_INC $CUTLASS_INC \
    -Xcompiler -fPIC -c "$f" -o "$tmp/$(basename "$f").o"
done
