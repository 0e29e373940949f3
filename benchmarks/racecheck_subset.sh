python3 -m pip install --no-build-isolation -e . > $OUT/build.log 2>&1 || { tail -20 $OUT/build.log; exit 1; }
declare -A K=(
 [attention]="test_cuda_forward_backward_many_shapes or test_cuda_online_softmax_rescaling or test_cuda_chain_ops_shapes or test_cuda_vector_and_misaligned"
 [softmax]="test_cuda_rows_all_paths or test_cuda_columns_all_paths or test_cuda_fast_cluster_rows or test_cuda_fast_cluster_columns or test_cuda_fast_row_warp_thresholds or test_cuda_fast_kernels_extremes"
 [embedding]="test_cuda_tile_boundaries or test_cuda_misaligned_views or test_cuda_all_same_index or test_cuda_deterministic"
 [layernorm_linear]="test_cuda_misaligned_views or test_cuda_matches_cpu_float64 or test_cuda_backward_deterministic or test_cuda_every_element_written"
)
for op in "${!K[@]}"; do
  ( PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 390 compute-sanitizer --tool racecheck --print-limit 10 --error-exitcode 99 \
      python3 -m pytest -q -p no:cacheprovider tests/test_$op.py -k "${K[$op]}" > $OUT/racecheck_$op.log 2>&1; echo "exit: $?" >> $OUT/racecheck_$op.log ) &
done
wait
for op in "${!K[@]}"; do echo "$op: $(grep -E 'RACECHECK SUMMARY' $OUT/racecheck_$op.log | tail -1) | $(grep -E ' passed| failed' $OUT/racecheck_$op.log | tail -1) | $(tail -1 $OUT/racecheck_$op.log)"; grep -E "Race reported" $OUT/racecheck_$op.log | sort | uniq -c | head -5; done
