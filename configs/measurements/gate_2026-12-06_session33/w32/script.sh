#!/bin/bash
# session 33, window 32: compute-sanitizer memcheck + racecheck on packed GQA documents, deterministic (fixed point:
# the scales kernel, the main kernel's 64-bit adds, the int64 postprocess); the deterministic GPU tests and the
# deterministic fast fuzz (varlen cases now in fixed point)
D=$OUT/w32; mkdir -p $D; cp .gpu/b/w32.sh $D/script.sh
timeout 220 python3 scripts/sanitize.py --shapes bwd-d128-det-varlen-gqa,bwd-d64-det-local --timeout 100 --log-dir $D/san > $D/sanitize.log 2>&1
echo "sanitize rc=$?" >> $D/rc.txt; tail -8 $D/sanitize.log
timeout 200 python3 -m pytest -m gpu -n 8 -q -p no:cacheprovider tests/test_bwd_deterministic_gpu.py -k "varlen or seqused" > $D/det_tests.log 2>&1
echo "det tests rc=$?" >> $D/rc.txt; grep -E "FAILED|passed|failed" $D/det_tests.log | cut -c1-250 | tail -8
FLASH_ATTN_SM120_FUZZ=fast timeout 150 python3 -m pytest -m gpu -n 8 -q -p no:cacheprovider tests/test_fuzz_gpu.py -k "det" > $D/fuzz_fast.log 2>&1
echo "fuzz rc=$?" >> $D/rc.txt; grep -E "FAILED|passed|failed" $D/fuzz_fast.log | cut -c1-250 | tail -8
cat $D/rc.txt
