#!/bin/bash
# usage: build_epilogue_cost.sh CUTLASS_ROOT OUTBIN  (the nvidia-cutlass wheel: .../cutlass_library/source)
set -e
I=$1; D=$(dirname $0)
for v in 0 1 2 3; do
  nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 --expt-relaxed-constexpr -DEVTV=$v -I$D/../../csrc -I$I/include -I$I/tools/util/include -c $D/epilogue_cost_cfg.cu -o ${TMPDIR:-/tmp}/evt_epi$v.o
done
nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -o $2 $D/epilogue_cost.cu ${TMPDIR:-/tmp}/evt_epi?.o -lcublas
