#!/bin/bash
# usage: build.sh CUTLASS_ROOT OUTBIN  (the nvidia-cutlass wheel: .../cutlass_library/source)
set -e
I=$1; D=$(dirname $0)
pids=()
for c in 0 1 2 3 4 5 6 7 8 9; do
  nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 --expt-relaxed-constexpr -DCFG=$c -I$D/../../csrc -I$I/include -I$I/tools/util/include -c $D/cfg.cu -o ${TMPDIR:-/tmp}/evt_cfg$c.o &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done  # set -e: a failed configuration stops here
nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -o $2 $D/main.cu ${TMPDIR:-/tmp}/evt_cfg?.o -lcublas
