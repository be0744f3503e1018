#!/bin/bash
# session 38, call A: deterministic windows with a user score_mod (turns from the window's edges, new), their deep
# fuzz rows, the compiled-backward layout test (session 37, not run yet)
D=$OUT/w48a; mkdir -p $D; cp .gpu/b/w48a.sh $D/script.sh
nvidia-smi --query-gpu=name --format=csv,noheader > $D/gpu.txt; cat $D/gpu.txt
finish() { tar czf $OUT/w48a.tgz -C $OUT w48a; }
trap finish EXIT
timeout 260 python3 -m pytest -m gpu -n 6 -q -p no:cacheprovider tests/test_bwd_deterministic_gpu.py -k "windows_with_a_score_mod" > $D/tests_windows.log 2>&1
echo "tests windows rc=$?" >> $D/rc.txt; grep -E "FAILED|passed|failed|Error" $D/tests_windows.log | cut -c1-250 | tail -8
FLASH_ATTN_SM120_FUZZ=deep timeout 150 python3 -m pytest -m gpu -n 2 -q -p no:cacheprovider tests/test_fuzz_gpu.py -k "det029 or det030" > $D/fuzz_windows.log 2>&1
echo "fuzz rc=$?" >> $D/rc.txt; grep -E "FAILED|passed|failed" $D/fuzz_windows.log | cut -c1-250 | tail -4
timeout 100 python3 -m pytest -m gpu -n 4 -q -p no:cacheprovider tests/test_api_parity_gpu.py > $D/tests_parity.log 2>&1
echo "tests parity rc=$?" >> $D/rc.txt; grep -E "FAILED|passed|failed" $D/tests_parity.log | cut -c1-250 | tail -5
cat $D/rc.txt
