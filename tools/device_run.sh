#!/usr/bin/env bash
# One call on the GPU machine: build, CUDA tests, compute-sanitizer, tour,
# benchmarks, notebooks, in the order STEPS names them
# (default: build tests selfcheck memcheck racecheck synccheck tour bench notebooks;
# a step written a+b runs a and b concurrently).
# Results are packed into $OUT/results.tar.gz after every step (so a run cut
# short still returns what it did) plus $OUT/bench.json.
# The device copy has no .git: pass the commit in, e.g. GPU_PUZZLES_COMMIT=$(git rev-parse --short HEAD).
# The build step uses a carried .prebuilt/ (tools/prebuild.sh) when its stamp (python,
# torch, source hash) matches, else pip-installs; `device_run.sh --stamp PY` prints the stamp.
# Knobs: TESTS (test files), TESTS_TIMEOUT, PYTEST_ARGS, TEST_WORKERS (xdist processes where
# pytest-xdist is there or carried as wheels in .whl/: pip download -d .whl pytest-xdist execnet),
# OPS (bench), NOTEBOOKS; for the sanitizer
# steps (tools/sanitize_queue.py, results in $OUT/r/sanitizer/<tool>/): SANITIZE_FILES (default
# every tests/test_*.py), SANITIZE_K (pytest -k, default below), SANITIZE_KERNELS, SANITIZE_UNFILTERED,
# SANITIZE_TIMEOUT (deadline of each sanitizer step, s, default 480), SANITIZE_WORKERS (processes
# per GPU, default 4, split between steps run as a+b) (12 per H200 ran out of GPU memory; 8 per GPU made
# a 150-s test run past 480 s: on 8 GPUs 1 per tool per GPU is faster overall), SANITIZE_COSTS (costs.json of an earlier run),
# SANITIZE_KERNELS_EXCLUDE (--kernel-name-exclude for racecheck/synccheck, every file, e.g. kns=nvjet),
# SANITIZE_FOREIGN (racecheck: kernel-name substrings whose own reports are counted apart, default nvjet:
# cuBLAS, see tools/cublas_racecheck_repro.py), SANITIZE_CHUNK (most tests per process, default 25),
# SANITIZE_SKIP (summary.json files of earlier calls, "{tool}" replaced by the tool: their clean tests are not rerun);
# SANITIZE_FILES_<tool> and SANITIZE_WORKERS_<tool> override the two for one tool; SANITIZE_ONLY
# (a file of test ids: only those), set by the step "record" to the tests whose launches cover the suite's;
# RECORD_SKIP (earlier records: the step "record" runs only the tests they lack, and covers them all).
set -uo pipefail
export PYTHONUNBUFFERED=1
# What a prebuilt .so (tools/prebuild.sh) must match: python, torch, the sources.
stamp() {
  "$1" -c "import sys, torch; print(f'py={sys.version_info[0]}.{sys.version_info[1]} torch={torch.__version__}', end=' ')"
  echo "src=$(find csrc setup.py -type f | LC_ALL=C sort | xargs sha1sum | sha1sum | cut -c1-16)"
}
if [ "${1:-}" = "--stamp" ]; then stamp "$2"; exit 0; fi
# The repo root on the path: a prebuilt .so is used in place, without pip.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
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
# Filtered, racecheck dies with an internal sanitizer error inside the fused LayerNorm+Linear
# forward, RMSNorm+Linear and the fused linear cross-entropy (around the uninstrumented cuBLAS GEMMs): these files run racecheck/synccheck unfiltered.
SANITIZE_UNFILTERED=${SANITIZE_UNFILTERED-"tests/test_layernorm_linear.py tests/test_rmsnorm_linear.py tests/test_cross_entropy.py tests/test_reliability.py"}
sanitize() {  # $1 = memcheck | racecheck | synccheck; $2 = sanitizer steps running at once
  # tools/sanitize_queue.py: the selected test ids in small chunks (one sanitizer process
  # each, expensive tests first and spread over chunks) from one queue, SANITIZE_WORKERS
  # processes per visible GPU (more starved each other), all stopped by the SANITIZE_TIMEOUT
  # deadline so the summary is written; a killed chunk still records which tests finished.
  # No caching allocator: every tensor is its own allocation, so memcheck sees out-of-bounds
  # accesses that the pool would otherwise hide. Steps run at once (a+b) share the workers.
  # SANITIZE_FILES_<tool> / SANITIZE_WORKERS_<tool> set one tool's files / processes per GPU apart
  # from the others (e.g. STEPS=memcheck+racecheck over different files in one call)
  local fv="SANITIZE_FILES_$1" wv="SANITIZE_WORKERS_$1"
  local files=${!fv:-${SANITIZE_FILES:-tests/test_*.py}}
  local w=$(( ${SANITIZE_WORKERS:-4} / ${2:-1} )) costs=()
  [ -n "${!wv:-}" ] && w=${!wv}
  [ "$w" -ge 1 ] || w=1
  # per-test seconds of an earlier run (its $OUT/r/sanitizer/<tool>/costs.json) order the queue
  local c=${SANITIZE_COSTS:-benchmarks/results/sanitizer_costs_$1.json}
  [ -f "$c" ] && costs=(--costs "$c")
  # summary.json files of earlier calls on the same sources (carried): their clean tests are skipped
  local skip=()
  # shellcheck disable=SC2206
  [ -n "${SANITIZE_SKIP:-}" ] && skip=(--skip ${SANITIZE_SKIP//\{tool\}/$1})
  # a test list (the record step's cover, or SANITIZE_ONLY): only those tests
  local only=(); [ -n "${SANITIZE_ONLY:-}" ] && only=(--only "$SANITIZE_ONLY")
  # shellcheck disable=SC2086  # file lists split on spaces on purpose
  python3 tools/sanitize_queue.py --tool "$1" --files $files \
    -k "${SANITIZE_K:-$SANITIZE_K_DEFAULT}" --kernels "$SANITIZE_KERNELS" --exclude-kernels "${SANITIZE_KERNELS_EXCLUDE:-}" --foreign-kernels "${SANITIZE_FOREIGN-nvjet}" --chunk "${SANITIZE_CHUNK:-25}" --unfiltered-files $SANITIZE_UNFILTERED \
    --workers-per-gpu "$w" --deadline "${SANITIZE_TIMEOUT:-480}" "${costs[@]}" "${skip[@]}" "${only[@]}" --out "$OUT/r/sanitizer" 2>&1 | tail -80
}

# pytest's "-n TEST_WORKERS" where pytest-xdist is there (or its wheels carried in .whl/: the machine
# has no internet), else nothing: `tests -k cuda` took 283 s serially on an H200, more than a call can spare.
xdist_args() {
  [ -d .whl ] && ! python3 -c "import xdist" 2>/dev/null && python3 -m pip install -q --no-index --no-deps .whl/*.whl >&2
  python3 -c "import xdist" 2>/dev/null && echo "-n ${TEST_WORKERS:-6}"
}

run_step() {
  case $1 in
    build)
      t0=$(date +%s)
      if [ -f .prebuilt/stamp.txt ] && [ "$(cat .prebuilt/stamp.txt)" = "$(stamp python3)" ]; then
        cp .prebuilt/*.so gpu_puzzles/ && { cp .prebuilt/_built_with.py gpu_puzzles/ 2>/dev/null || true; } && echo "prebuilt .so used: $(cat .prebuilt/stamp.txt)" | tee "$OUT/r/build.log"
      else
        [ -f .prebuilt/stamp.txt ] && echo "prebuilt .so stale ($(cat .prebuilt/stamp.txt) vs $(stamp python3)): building"
        python3 -m pip install --no-build-isolation -e . > "$OUT/r/build.log" 2>&1 || { tail -50 "$OUT/r/build.log"; pack; exit 1; }
      fi
      echo "build seconds: $(( $(date +%s) - t0 ))" | tee -a "$OUT/r/build.log" ;;
    tests)
      local n; n=$(xdist_args)
      # shellcheck disable=SC2086  # $n and PYTEST_ARGS split on spaces on purpose
      timeout "${TESTS_TIMEOUT:-900}" python3 -m pytest -q -p no:cacheprovider -rfEs --durations=10 $n ${PYTEST_ARGS:-} ${TESTS:-tests} 2>&1 \
        | tee "$OUT/r/pytest.log" | grep -v "^  File" | tail -40 ;;
    record)
      # The sanitizer's selection run plainly, as the sanitizer runs it (its smaller repeat counts,
      # no caching allocator), each test's launches of our kernels recorded; the tests that
      # together make all of them (tools/sanitize_cover.py) become the sanitizer steps' list.
      local n; n=$(xdist_args)
      # RECORD_SKIP: records of earlier calls (e.g. benchmarks/results/sanitizer_launches_h100.jsonl.gz):
      # their tests are not run again, and the cover is chosen from them and this call's together
      # shellcheck disable=SC2086
      GPU_PUZZLES_SANITIZE=1 PYTORCH_NO_CUDA_MEMORY_CACHING=1 GPU_PUZZLES_RECORD_TEST_LAUNCHES="$OUT/r/launches.jsonl" \
        GPU_PUZZLES_RECORD_SKIP="${RECORD_SKIP:-}" \
        timeout "${TESTS_TIMEOUT:-900}" python3 -m pytest -q -p no:cacheprovider -rfE $n -k "${SANITIZE_K:-$SANITIZE_K_DEFAULT}" \
        ${SANITIZE_FILES:-tests/test_*.py} 2>&1 | tee "$OUT/r/record.log" | grep -v "^  File" | tail -25
      # A record cut by TESTS_TIMEOUT (124) lacks the tests it did not reach: its cover covers only the
      # recorded ones. Said loudly; finish it with RECORD_SKIP in the next call.
      local rc=${PIPESTATUS[0]}
      [ "$rc" = 124 ] && echo "RECORD INCOMPLETE: cut by TESTS_TIMEOUT; the cover below covers only the tests recorded" \
        | tee -a "$OUT/r/record.log"
      # the ids the selection has now (as the sanitizer names them: GPU_PUZZLES_SANITIZE=1), so the cover
      # never lists a test an earlier record knew under an old name
      # shellcheck disable=SC2086
      GPU_PUZZLES_SANITIZE=1 python3 -m pytest -q -p no:cacheprovider --collect-only -k "${SANITIZE_K:-$SANITIZE_K_DEFAULT}" \
        ${SANITIZE_FILES:-tests/test_*.py} 2>/dev/null | grep "::" > "$OUT/r/collected.txt"
      # shellcheck disable=SC2086
      python3 tools/sanitize_cover.py ${RECORD_SKIP:-} "$OUT/r/launches.jsonl" --collected "$OUT/r/collected.txt" \
        --out "$OUT/r/cover.txt" | tee -a "$OUT/r/record.log" \
        && export SANITIZE_ONLY=${SANITIZE_ONLY:-$OUT/r/cover.txt} ;;
    selfcheck)  # each line must report an error, else the sanitizer runs below prove nothing
      nvcc -arch=sm_90 -o /tmp/selfcheck tools/sanitizer_selfcheck.cu
      { compute-sanitizer --tool racecheck --kernel-name "$SANITIZE_KERNELS" /tmp/selfcheck 2>&1 | grep -E "RACECHECK SUMMARY|unfiltered|selfcheck_race" | sort | uniq -c
        compute-sanitizer --tool synccheck --kernel-name "$SANITIZE_KERNELS" /tmp/selfcheck sync 2>&1 | grep -E "ERROR SUMMARY|Invalid|Barrier" | sort | uniq -c
      } | tee "$OUT/r/sanitizer_selfcheck.txt" ;;
    memcheck|racecheck|synccheck) sanitize "$1" "${2:-1}" ;;
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
    pids=(); IFS=+ read -ra parts <<< "$step"
    for part in "${parts[@]}"; do run_step "$part" "${#parts[@]}" & pids+=($!); done
    for p in "${pids[@]}"; do wait "$p"; done
  else
    run_step "$step"  # in the foreground, so a failed build stops the run
  fi
  pack
done
log done
