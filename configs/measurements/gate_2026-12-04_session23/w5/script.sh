# session 23 w5: persistent producer at 32 registers; the 8-warp d128 block-sparse tile, dynamic + two Q slots
mkdir -p $OUT/w5
timeout 300 python -m pytest tests/test_fwd_tma_persistent_gpu.py -n 8 -q -x -p no:cacheprovider > $OUT/w5/gpu_tests.log 2>&1; echo rc=$? >> $OUT/w5/gpu_tests.log
tail -3 $OUT/w5/gpu_tests.log
if grep -q "rc=0" $OUT/w5/gpu_tests.log; then
  timeout 200 python scripts/bench_block_sparse.py --graph --head-dims 128 --reps 10 --masks all --sparse-configs tma-w8-128x64-s1-pers-q2-dyn,tma-w4-64x64-s2-pers-q2-dyn --json $OUT/w5/bs_d128.json > $OUT/w5/bs_d128.log 2>&1
  grep -v "^\s*$" $OUT/w5/bs_d128.log | tail -20
fi
