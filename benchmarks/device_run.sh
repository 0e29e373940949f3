#!/usr/bin/env bash
# One call on the GPU machine: build, CUDA tests, compute-sanitizer, tour,
# benchmarks, notebooks, in the order STEPS names them
# (default: build tests selfcheck memcheck racecheck synccheck tour bench notebooks;
# a step written a+b runs a and b concurrently).
# Results are packed into $OUT/results.tar.gz after every step (so a run cut
# short still returns what it did) plus $OUT/bench.json.
# The device copy has no .git: pass the commit in, e.g. GPU_PUZZLES_COMMIT=$(git rev-parse --short HEAD).
# Knobs: TESTS (test files), TESTS_TIMEOUT, PYTEST_ARGS, SANITIZE_FILES (default: every tests/test_*.py, one sanitizer process each,
# concurrently), SANITIZE_K (pytest -k, default below), SANITIZE_TIMEOUT, OPS (bench), NOTEBOOKS.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/r"
STEPS=${STEPS:-"build tests selfcheck memcheck racecheck synccheck tour bench notebooks"}
log() { echo "== $* ($(date +%T))"; }
pack() { tar -czf "$OUT/results.tar.gz" -C "$OUT" r; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/r/gpu.txt"
echo "CXX=${CXX:-unset}: $(${CXX:-c++} --version | head -1)" >> "$OUT/r/gpu.txt"

# Deselected under the sanitizer: CPU-only tests; CUDA-graph tests (with the caching
# allocator off, capture would have to cudaMalloc, which capture forbids; they run in
# the plain test step); the huge (> 2^31 element), reduce-overhead and multi-GPU tests (too slow).
SANITIZE_K_DEFAULT="not cpu and not graph and not huge and not reduce_overhead and not ddp and not second_gpu"
# racecheck and synccheck instrument only our kernels (all live in namespace
# gpu_puzzles): instrumenting PyTorch's own reference kernels (float64 sums,
# randn) made those runs 100x slower and timed out. memcheck keeps every kernel.
# The selfcheck step proves the filter still catches a deliberate race/bad barrier.
SANITIZE_KERNELS=${SANITIZE_KERNELS-kns=gpu_puzzles}  # set empty to instrument every kernel
sanitize() {  # $1 = memcheck | racecheck | synccheck
  local filt=()
  [ "$1" != memcheck ] && [ -n "$SANITIZE_KERNELS" ] && filt=(--kernel-name "$SANITIZE_KERNELS")
  # One compute-sanitizer process per test file (SANITIZE_SHARDS > 1: per shard of a
  # file's tests), all at once: the tool's overhead is mostly host-side, and the
  # whole suite in one process outlasts a device call. No caching allocator: every
  # tensor is its own allocation, so memcheck sees out-of-bounds accesses that the
  # pool would otherwise hide.
  local f name i ids pids=()
  local shards=${SANITIZE_SHARDS:-1}
  for f in ${SANITIZE_FILES:-tests/test_*.py}; do
    name=$(basename "$f" .py)
    python3 -m pytest --collect-only -q -p no:cacheprovider "$f" -k "${SANITIZE_K:-$SANITIZE_K_DEFAULT}" 2>/dev/null \
      | grep '::' > "$OUT/r/ids_$1_$name.txt"
    [ -s "$OUT/r/ids_$1_$name.txt" ] || continue
    for ((i = 0; i < shards; i++)); do
      # round-robin split: neighbouring (similar-cost) tests land in different shards
      mapfile -t ids < <(awk -v n="$shards" -v i="$i" '(NR - 1) % n == i' "$OUT/r/ids_$1_$name.txt")
      [ ${#ids[@]} -gt 0 ] || continue
      ( PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${SANITIZE_TIMEOUT:-300}" compute-sanitizer --tool "$1" "${filt[@]}" \
          --print-limit 20 --error-exitcode 99 \
          python3 -m pytest -v -p no:cacheprovider --durations=5 "${ids[@]}" > "$OUT/r/sanitizer_$1_$name.$i.log" 2>&1
        echo "exit: $? (99: sanitizer error, 124: timeout)" >> "$OUT/r/sanitizer_$1_$name.$i.log" ) &
      pids+=($!)
    done
  done
  for f in "${pids[@]}"; do wait "$f"; done
  for f in "$OUT"/r/sanitizer_"$1"_*.log; do
    echo "$(basename "$f"): $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$f" | tail -1) | $(grep -E " passed| failed" "$f" | tail -1) | $(tail -1 "$f")"
  done | tee "$OUT/r/sanitizer_$1.summary"
}

run_step() {
  case $1 in
    build)
      t0=$(date +%s)
      python3 -m pip install --no-build-isolation -e . > "$OUT/r/build.log" 2>&1 || { tail -50 "$OUT/r/build.log"; pack; exit 1; }
      echo "build seconds: $(( $(date +%s) - t0 ))" | tee -a "$OUT/r/build.log" ;;
    tests)
      timeout "${TESTS_TIMEOUT:-900}" python3 -m pytest -q -p no:cacheprovider -rfEs --durations=10 ${PYTEST_ARGS:-} ${TESTS:-tests} 2>&1 \
        | tee "$OUT/r/pytest.log" | grep -v "^  File" | tail -40 ;;
    selfcheck)  # each line must report an error, else the sanitizer runs below prove nothing
      nvcc -arch=sm_90 -o /tmp/selfcheck benchmarks/sanitizer_selfcheck.cu
      { compute-sanitizer --tool racecheck --kernel-name "$SANITIZE_KERNELS" /tmp/selfcheck 2>&1 | grep -E "RACECHECK SUMMARY|unfiltered|selfcheck_race" | sort | uniq -c
        compute-sanitizer --tool synccheck --kernel-name "$SANITIZE_KERNELS" /tmp/selfcheck sync 2>&1 | grep -E "ERROR SUMMARY|Invalid|Barrier" | sort | uniq -c
      } | tee "$OUT/r/sanitizer_selfcheck.txt" ;;
    memcheck|racecheck|synccheck) sanitize "$1" ;;
    tour) python3 -m gpu_puzzles 2>&1 | tee "$OUT/r/tour.txt" | tail -40 ;;
    bench) python3 -m gpu_puzzles.bench ${OPS:-} --json "$OUT/bench.json" 2>&1 | tee "$OUT/r/bench.txt" | tail -60 ;;
    notebooks) python3 notebooks/execute.py ${NOTEBOOKS:-notebooks/*.ipynb} --out-dir "$OUT/r/notebooks" 2>&1 | tail -20 ;;
    *) echo "unknown step $1" ;;
  esac
}
# A step written a+b runs a and b concurrently (e.g. racecheck+synccheck).
for step in $STEPS; do
  log "$step"
  if [[ $step == *+* ]]; then
    pids=()
    for part in ${step//+/ }; do run_step "$part" & pids+=($!); done
    for p in "${pids[@]}"; do wait "$p"; done
  else
    run_step "$step"  # in the foreground, so a failed build stops the run
  fi
  pack
done
log done
