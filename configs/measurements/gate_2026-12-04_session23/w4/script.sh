# session 23 w4: block-sparse forward with the dynamic persistent order (graph kernel times)
mkdir -p $OUT/w4
timeout 150 python scripts/bench_block_sparse.py --graph --head-dims 128 --reps 10 --sparse-configs tma-w4-64x64-s2-pers-q2-dyn,tma-w4-64x64-s2-pers-q2 --json $OUT/w4/bs_d128.json > $OUT/w4/bs_d128.log 2>&1
tail -6 $OUT/w4/bs_d128.log
timeout 120 python scripts/bench_block_sparse.py --graph --head-dims 64 --reps 10 --sparse-configs tma-w8-128x64-s3-pers-q2-dyn,tma-w8-128x64-s3-pers-q2 --json $OUT/w4/bs_d64.json > $OUT/w4/bs_d64.log 2>&1
tail -6 $OUT/w4/bs_d64.log
timeout 100 python scripts/bench_block_sparse.py --graph --head-dims 96 --reps 10 --sparse-configs tma-w4-64x64-s2-pers-q2-dyn --json $OUT/w4/bs_d96.json > $OUT/w4/bs_d96.log 2>&1
tail -6 $OUT/w4/bs_d96.log
