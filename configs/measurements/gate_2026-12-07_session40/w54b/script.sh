#!/bin/bash
# session 40: the varlen block-sparse walk's speed (w53 of session 39) and the deterministic block-sparse GPU tests (helper refactor a84cb2b)
D=$OUT/w54b; mkdir -p $D; cp .gpu/b/w54b.sh $D/script.sh
nvidia-smi --query-gpu=name --format=csv,noheader > $D/gpu.txt; cat $D/gpu.txt
finish() { tar czf $OUT/w54b.tgz -C $OUT w54b; }
trap finish EXIT
FLASH_ATTN_SM120_EMULATE=1 timeout 150 python3 -u scripts/bench_block_sparse_varlen.py --bwd --reps 10 --json $D/bs_varlen_bwd.json > $D/bwd.log 2>&1
echo "bwd rc=$?" >> $D/rc.txt; grep -a "emulated\]" $D/bwd.log | cut -c1-220
FLASH_ATTN_SM120_EMULATE=1 timeout 90 python3 -u scripts/bench_block_sparse_varlen.py --reps 10 --json $D/bs_varlen_fwd.json > $D/fwd.log 2>&1
echo "fwd rc=$?" >> $D/rc.txt; grep -a "emulated\]" $D/fwd.log | cut -c1-220
timeout 200 python3 -m pytest -m gpu -n 8 -q -p no:cacheprovider tests/test_block_sparse_gpu.py tests/test_block_sparse_bwd_varlen_gpu.py -k "deterministic" > $D/tests_det.log 2>&1
echo "tests det rc=$?" >> $D/rc.txt; grep -E "FAILED|passed|failed" $D/tests_det.log | cut -c1-250 | tail -8
tail -n 3 $D/bwd.log $D/fwd.log | cut -c1-200
cat $D/rc.txt
