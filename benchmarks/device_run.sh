#!/usr/bin/env bash
# One call on the GPU machine: build, CUDA tests, compute-sanitizer, tour,
# benchmarks, notebooks, in the order STEPS names them
# (default: build tests memcheck racecheck synccheck tour bench notebooks).
# Results are packed into $OUT/results.tar.gz after every step (so a run cut
# short still returns what it did) plus $OUT/bench.json.
# The device copy has no .git: pass the commit in, e.g. GPU_PUZZLES_COMMIT=$(git rev-parse --short HEAD).
# Knobs: TESTS (test files), TESTS_TIMEOUT, PYTEST_ARGS, SANITIZE_FILES (default: every tests/test_*.py, one sanitizer process each,
# concurrently), SANITIZE_K (pytest -k, default below), SANITIZE_TIMEOUT, OPS (bench), NOTEBOOKS.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/r"
STEPS=${STEPS:-"build tests memcheck racecheck synccheck tour bench notebooks"}
log() { echo "== $* ($(date +%T))"; }
pack() { tar -czf "$OUT/results.tar.gz" -C "$OUT" r; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/r/gpu.txt"
echo "CXX=${CXX:-unset}: $(${CXX:-c++} --version | head -1)" >> "$OUT/r/gpu.txt"

# Deselected under the sanitizer: CPU-only tests; CUDA-graph tests (with the caching
# allocator off, capture would have to cudaMalloc, which capture forbids; they run in
# the plain test step); the huge (> 2^31 element), reduce-overhead and multi-GPU tests (too slow).
SANITIZE_K_DEFAULT="not cpu and not graph and not huge and not reduce_overhead and not ddp and not second_gpu"
sanitize() {  # $1 = memcheck | racecheck | synccheck
  # One compute-sanitizer process per test file, all at once: the tool's
  # overhead is mostly host-side, and the whole suite in one process outlasts a
  # device call. No caching allocator: every tensor is its own allocation, so
  # memcheck sees out-of-bounds accesses that the pool would otherwise hide.
  local f name pids=()
  for f in ${SANITIZE_FILES:-tests/test_*.py}; do
    name=$(basename "$f" .py)
    ( PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${SANITIZE_TIMEOUT:-300}" compute-sanitizer --tool "$1" \
        --print-limit 20 --error-exitcode 99 \
        python3 -m pytest -q -p no:cacheprovider "$f" -k "${SANITIZE_K:-$SANITIZE_K_DEFAULT}" \
        > "$OUT/r/sanitizer_$1_$name.log" 2>&1
      echo "exit: $? (99: sanitizer error, 124: timeout)" >> "$OUT/r/sanitizer_$1_$name.log" ) &
    pids+=($!)
  done
  for f in "${pids[@]}"; do wait "$f"; done
  for f in "$OUT"/r/sanitizer_"$1"_*.log; do
    echo "$(basename "$f"): $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$f" | tail -1) | $(grep -E " passed| failed" "$f" | tail -1) | $(tail -1 "$f")"
  done | tee "$OUT/r/sanitizer_$1.summary"
}

for step in $STEPS; do
  log "$step"
  case $step in
    build)
      t0=$(date +%s)
      python3 -m pip install --no-build-isolation -e . > "$OUT/r/build.log" 2>&1 || { tail -50 "$OUT/r/build.log"; pack; exit 1; }
      echo "build seconds: $(( $(date +%s) - t0 ))" | tee -a "$OUT/r/build.log" ;;
    tests)
      timeout "${TESTS_TIMEOUT:-900}" python3 -m pytest -q -p no:cacheprovider -rfEs --durations=10 ${PYTEST_ARGS:-} ${TESTS:-tests} 2>&1 \
        | tee "$OUT/r/pytest.log" | grep -v "^  File" | tail -40 ;;
    memcheck|racecheck|synccheck) sanitize "$step" ;;
    tour) python3 -m gpu_puzzles 2>&1 | tee "$OUT/r/tour.txt" | tail -40 ;;
    bench) python3 -m gpu_puzzles.bench ${OPS:-} --json "$OUT/bench.json" 2>&1 | tee "$OUT/r/bench.txt" | tail -60 ;;
    notebooks) python3 notebooks/execute.py ${NOTEBOOKS:-notebooks/*.ipynb} --out-dir "$OUT/r/notebooks" 2>&1 | tail -20 ;;
    *) echo "unknown step $step" ;;
  esac
  pack
done
log done
