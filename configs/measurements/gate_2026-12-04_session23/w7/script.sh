# session 23 w7: the block-sparse backward's own d128 config (a282): GPU tests, then kernel time
mkdir -p $OUT/w7
timeout 200 python -m pytest tests/test_block_sparse_gpu.py -n 8 -q -x -p no:cacheprovider -k "backward" > $OUT/w7/gpu_tests.log 2>&1; echo rc=$? >> $OUT/w7/gpu_tests.log
tail -3 $OUT/w7/gpu_tests.log
if grep -q "rc=0" $OUT/w7/gpu_tests.log; then
  timeout 100 python scripts/bench_block_sparse.py --bwd --graph --head-dims 128 --reps 5 --bwd-configs bwd-w8-64x64-q1do1-a242 --json $OUT/w7/bs_bwd_d128.json > $OUT/w7/bs_bwd_d128.log 2>&1
  grep -v "^\s*$" $OUT/w7/bs_bwd_d128.log | tail -6
fi
