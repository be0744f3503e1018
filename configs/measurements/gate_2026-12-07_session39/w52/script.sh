#!/bin/bash
# session 39: dense windows without a score_mod now take the descending turns (995e4f4): the window tests through
# the plan, deep fuzz det016/det020 (packed fixed point, dense turns), memcheck+racecheck on bwd-d64-det-local (now
# turns), and bench_det_windows (the plan's turns beside fixed point forced, same calls)
D=$OUT/w52; mkdir -p $D; cp .gpu/b/w52.sh $D/script.sh
nvidia-smi --query-gpu=name --format=csv,noheader > $D/gpu.txt; cat $D/gpu.txt
finish() { tar czf $OUT/w52.tgz -C $OUT w52; }
trap finish EXIT
timeout 150 python3 -m pytest -m gpu -n 8 -q -p no:cacheprovider tests/test_bwd_deterministic_gpu.py -k "windows" > $D/tests_windows.log 2>&1
echo "tests windows rc=$?" >> $D/rc.txt; grep -E "FAILED|passed|failed" $D/tests_windows.log | cut -c1-250 | tail -5
FLASH_ATTN_SM120_FUZZ=deep timeout 100 python3 -m pytest -m gpu -n 4 -q -p no:cacheprovider tests/test_fuzz_gpu.py -k "det016 or det020" > $D/fuzz_det.log 2>&1
echo "fuzz det016/020 rc=$?" >> $D/rc.txt; grep -E "FAILED|passed|failed" $D/fuzz_det.log | cut -c1-250 | tail -4
timeout 100 python3 scripts/sanitize.py --shapes bwd-d64-det-local --timeout 45 --log-dir $D/sanitize > $D/sanitize.log 2>&1
echo "sanitize rc=$?" >> $D/rc.txt; tail -4 $D/sanitize.log | cut -c1-200
FLASH_ATTN_SM120_EMULATE=1 timeout 200 python3 -u scripts/bench_det_windows.py --reps 10 --json $D/det_windows.json > $D/bench.log 2>&1
echo "bench rc=$?" >> $D/rc.txt; grep -a "emulated\]" $D/bench.log | sed 's/.*\[emulated\]/[emulated]/' | cut -c1-220 | tail -8
cat $D/rc.txt
