#!/bin/bash
# session 38, window 2: deterministic=True on sliding windows, with a score_mod (turns from the window's edges,
# new) and without (fixed point), against the default backward, same process
D=$OUT/w49; mkdir -p $D; cp .gpu/b/w49.sh $D/script.sh
nvidia-smi --query-gpu=name --format=csv,noheader > $D/gpu.txt; cat $D/gpu.txt
finish() { tar czf $OUT/w49.tgz -C $OUT w49; }
trap finish EXIT
timeout 110 python3 -m pytest -m gpu -n 6 -q -p no:cacheprovider tests/test_bwd_deterministic_gpu.py -k "windows_with_a_score_mod or test_dense_bitwise_and_correct" > $D/tests_windows.log 2>&1
echo "tests windows rc=$?" >> $D/rc.txt; grep -E "FAILED|passed|failed" $D/tests_windows.log | cut -c1-250 | tail -5
FLASH_ATTN_SM120_EMULATE=1 timeout 300 python3 -u scripts/bench_det_windows.py --reps 10 --json $D/det_windows.json > $D/bench.log 2>&1
echo "bench rc=$?" >> $D/rc.txt; grep "emulated\]" $D/bench.log | cut -c1-160 | tail -12; tail -3 $D/bench.log | cut -c1-300
cat $D/rc.txt
