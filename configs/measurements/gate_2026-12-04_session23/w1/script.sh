# session 23 w1: two-slot Q ring: GPU tests, then block-sparse forward kernel times (graph) per head dim
mkdir -p $OUT/w1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/w1/gpu.txt
timeout 240 python -m pytest tests/test_fwd_tma_persistent_gpu.py -n 8 -q -x -p no:cacheprovider -k "q2 or small_wave" > $OUT/w1/gpu_tests.log 2>&1; echo rc=$? >> $OUT/w1/gpu_tests.log
tail -3 $OUT/w1/gpu_tests.log
if grep -q "rc=0" $OUT/w1/gpu_tests.log; then
  timeout 150 python scripts/bench_block_sparse.py --graph --head-dims 128 --reps 10 --sparse-configs tma-w4-64x64-s2-pers-q2,tma-w4-64x64-s2-pers,tma-w4-64x128-s1-pers-q2,tma-w8-128x64-s1-pers-q2 --json $OUT/w1/bs_d128.json > $OUT/w1/bs_d128.log 2>&1
  tail -12 $OUT/w1/bs_d128.log
  timeout 120 python scripts/bench_block_sparse.py --graph --head-dims 64 --reps 10 --sparse-configs tma-w8-128x64-s3-pers-q2,tma-w8-128x64-s3-pers,tma-w4-128x64-s1-pers-q2 --json $OUT/w1/bs_d64.json > $OUT/w1/bs_d64.log 2>&1
  tail -12 $OUT/w1/bs_d64.log
  timeout 90 python scripts/bench_block_sparse.py --graph --head-dims 96 --reps 10 --sparse-configs tma-w4-64x64-s2-pers-q2 --json $OUT/w1/bs_d96.json > $OUT/w1/bs_d96.log 2>&1
  tail -12 $OUT/w1/bs_d96.log
fi
