#!/usr/bin/env bash
# One call on the GPU machine: build, CUDA tests, compute-sanitizer, tour,
# benchmarks, notebooks. Everything lands in $OUT (results.tar.gz + bench JSON).
# STEPS (default all): build tests sanitize tour bench notebooks; OPS limits bench/sanitize.
set -uo pipefail
export PYTHONUNBUFFERED=1
# The device copy has no .git: pass the commit in, e.g. GPU_PUZZLES_COMMIT=$(git rev-parse --short HEAD).
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/r"
STEPS=${STEPS:-"build tests sanitize tour bench notebooks"}
OPS=${OPS:-}
log() { echo "== $* ($(date +%T))"; }
has() { [[ " $STEPS " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/r/gpu.txt"

if has build; then
  log build
  t0=$(date +%s)
  python3 -m pip install --no-build-isolation -e . > "$OUT/r/build.log" 2>&1 || { tail -50 "$OUT/r/build.log"; exit 1; }
  echo "build seconds: $(( $(date +%s) - t0 ))" | tee -a "$OUT/r/build.log"
fi

if has tests; then
  log tests
  python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests} 2>&1 | tee "$OUT/r/pytest.log" | tail -15
fi

if has sanitize; then
  # No caching allocator: every tensor is its own allocation, so memcheck sees
  # out-of-bounds accesses that the pool would otherwise hide.
  for tool in memcheck racecheck; do
    log "sanitizer $tool"
    files=${SANITIZE_FILES:-tests/test_*.py}
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout ${SANITIZE_TIMEOUT:-300} compute-sanitizer --tool $tool \
      --print-limit 20 --error-exitcode 99 \
      python3 -m pytest -q -p no:cacheprovider -x $files -k "${SANITIZE_K:-cuda}" \
      > "$OUT/r/sanitizer_$tool.log" 2>&1
    echo "$tool exit: $?" | tee -a "$OUT/r/sanitizer_$tool.log"
    grep -E "ERROR SUMMARY|passed|failed" "$OUT/r/sanitizer_$tool.log" | tail -3
  done
fi

if has tour; then
  log tour
  python3 -m gpu_puzzles 2>&1 | tee "$OUT/r/tour.txt" | tail -40
fi

if has bench; then
  log bench
  python3 -m gpu_puzzles.bench $OPS --json "$OUT/bench.json" 2>&1 | tee "$OUT/r/bench.txt" | tail -60
fi

if has notebooks; then
  log notebooks
  python3 notebooks/execute.py ${NOTEBOOKS:-notebooks/*.ipynb} --out-dir "$OUT/r/notebooks" 2>&1 | tail -20
fi

tar -czf "$OUT/results.tar.gz" -C "$OUT" r && rm -rf "$OUT/r"
log done
