#!/usr/bin/env bash
# Build the extension here (no GPU needed) for the device machine, so a device call skips its
# 65-110 s build: Python 3.12 + the device's torch, sm_90 only (the full sm_80+sm_90 .so is
# ~64 MB, past what a call may carry). Writes .prebuilt/ (git-ignored): the .so and a stamp
# (python, torch, hash of csrc/ + setup.py). Carry it: run(carry=[".prebuilt"], ...);
# tools/device_run.sh's build step uses it only when the stamp matches there, else builds.
#   PREBUILD_PYTHON=/path/to/python3.12 (with torch==<device torch>) bash tools/prebuild.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PREBUILD_PYTHON:?set PREBUILD_PYTHON to a python3.12 with the device torch}
TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=${MAX_JOBS:-2} "$PY" setup.py build_ext --inplace -q
mkdir -p .prebuilt
rm -f .prebuilt/*.so
so=$("$PY" -c "import sysconfig; print('gpu_puzzles/_C' + sysconfig.get_config_var('EXT_SUFFIX'))")
cp "$so" .prebuilt/
cp gpu_puzzles/_built_with.py .prebuilt/  # the torch it was built against, checked at import
strip --strip-debug .prebuilt/*.so  # host debug info: 46 MB -> 14 MB; device code untouched
bash tools/device_run.sh --stamp "$PY" > .prebuilt/stamp.txt
echo "prebuilt: $(cat .prebuilt/stamp.txt), $(du -h .prebuilt/*.so | cut -f1)"
