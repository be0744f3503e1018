#!/bin/bash
# session 39: w50's check: dense windows without a score_mod, the forced descending turns vs the plan's fixed point
# on the same calls (bench_det_windows), and the windows tests
D=$OUT/w51b; mkdir -p $D; cp .gpu/b/w51b.sh $D/script.sh
nvidia-smi --query-gpu=name --format=csv,noheader > $D/gpu.txt; cat $D/gpu.txt
finish() { tar czf $OUT/w51b.tgz -C $OUT w51b; }
trap finish EXIT
timeout 200 python3 -m pytest -m gpu -n 8 -q -p no:cacheprovider tests/test_bwd_deterministic_gpu.py -k "windows" > $D/tests_windows.log 2>&1
echo "tests windows rc=$?" >> $D/rc.txt; grep -E "FAILED|passed|failed" $D/tests_windows.log | cut -c1-250 | tail -5
FLASH_ATTN_SM120_EMULATE=1 timeout 330 python3 -u scripts/bench_det_windows.py --reps 10 --json $D/det_windows.json > $D/bench.log 2>&1
echo "bench rc=$?" >> $D/rc.txt; grep -a "emulated\]" $D/bench.log | sed 's/.*\[emulated\]/[emulated]/' | cut -c1-220 | tail -8
cat $D/rc.txt
