# session 23 w3: dynamic persistent order: GPU tests, then dense causal and block-sparse kernel times
mkdir -p $OUT/w3
timeout 300 python -m pytest tests/test_fwd_tma_persistent_gpu.py -n 8 -q -x -p no:cacheprovider -k "dyn or small_wave or graph" > $OUT/w3/gpu_tests.log 2>&1; echo rc=$? >> $OUT/w3/gpu_tests.log
tail -3 $OUT/w3/gpu_tests.log
if grep -q "rc=0" $OUT/w3/gpu_tests.log; then
  timeout 280 python scripts/bench_configs.py --group 64:causal=tma-w8-256x64-s3-qreg-pers,tma-w8-256x64-s3-qreg-pers-dyn,tma-w8-256x64-s2-pers-q2-dyn,tma-w4-128x64-s1-pers-dyn,tma-w8-128x64-s3-pers-q2-dyn --group 96:causal=tma-w8-128x64-s2-pers-q2-dyn --group 128:causal=tma-w8-128x64-s1-pers-q2-dyn,tma-w4-128x32-s2-pers-dyn,tma-w4-128x32-s2 --reps 10 --no-ceiling --json $OUT/w3/dense_dyn.json > $OUT/w3/dense_dyn.log 2>&1
  grep "^\[emulated\]" $OUT/w3/dense_dyn.log | cut -c1-130
fi
