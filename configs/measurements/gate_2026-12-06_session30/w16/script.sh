#!/bin/bash
# session 30, window 16: the table with d64 causal on 4 warps (V in registers): its GPU tests, the d64 rows
# against the entry it replaced (both deterministic too), the backward fast fuzz
D=$OUT/w16; mkdir -p $D; cp .gpu/b/w16.sh $D/script.sh
timeout 150 python3 -m pytest -m gpu -n 10 -q -p no:cacheprovider tests/test_bwd_gpu.py -k "table" > $D/tests.log 2>&1
echo "tests rc=$?" >> $D/rc.txt
grep -E "FAILED|passed|failed" $D/tests.log | tail -8
timeout 170 python3 scripts/prepare.py --set bwd --subset d64 --emulate --reps 20 --no-ceiling --references upstream_sm120 \
  --bwd-configs configs/measurements/search_bwd/round9_d64_prev.json --json $D/bwd_d64_table.json > $D/prepare.log 2>&1
echo "prepare rc=$?" >> $D/rc.txt
sed -n '/backward TFLOPS/,$p' $D/prepare.log | cut -c1-250 | tail -22
FLASH_ATTN_SM120_FUZZ=fast timeout 200 python3 -m pytest -m gpu -n 10 -q -p no:cacheprovider tests/test_fuzz_gpu.py -k "bwd or det" > $D/fuzz_fast.log 2>&1
echo "fuzz rc=$?" >> $D/rc.txt
grep -E "FAILED|passed|failed" $D/fuzz_fast.log | tail -8; cat $D/rc.txt
