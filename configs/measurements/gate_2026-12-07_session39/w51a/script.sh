#!/bin/bash
# session 39: the varlen block-sparse backward (new GPU tests, deep fuzz det031/det032) and the block-sparse GPU
# suite's backward tests (regression of the walk's rows_end change)
D=$OUT/w51a; mkdir -p $D; cp .gpu/b/w51a.sh $D/script.sh
nvidia-smi --query-gpu=name --format=csv,noheader > $D/gpu.txt; cat $D/gpu.txt
finish() { tar czf $OUT/w51a.tgz -C $OUT w51a; }
trap finish EXIT
timeout 200 python3 -m pytest -m gpu -n 8 -q -p no:cacheprovider tests/test_block_sparse_bwd_varlen_gpu.py > $D/tests_varlen.log 2>&1
echo "tests varlen rc=$?" >> $D/rc.txt; grep -E "FAILED|Error|passed|failed" $D/tests_varlen.log | cut -c1-300 | tail -12
timeout 160 python3 -m pytest -m gpu -n 8 -q -p no:cacheprovider tests/test_block_sparse_gpu.py -k "backward" > $D/tests_bs_bwd.log 2>&1
echo "tests bs bwd rc=$?" >> $D/rc.txt; grep -E "FAILED|passed|failed" $D/tests_bs_bwd.log | cut -c1-250 | tail -8
FLASH_ATTN_SM120_FUZZ=deep timeout 100 python3 -m pytest -m gpu -n 4 -q -p no:cacheprovider tests/test_fuzz_gpu.py -k "det031 or det032" > $D/fuzz_det.log 2>&1
echo "fuzz det031/032 rc=$?" >> $D/rc.txt; grep -E "FAILED|passed|failed" $D/fuzz_det.log | cut -c1-250 | tail -4
timeout 110 python3 scripts/sanitize.py --shapes bs-bwd-d128-varlen-prefix-gqa --timeout 50 --log-dir $D/sanitize > $D/sanitize.log 2>&1
echo "sanitize rc=$?" >> $D/rc.txt; tail -4 $D/sanitize.log | cut -c1-200
cat $D/rc.txt
