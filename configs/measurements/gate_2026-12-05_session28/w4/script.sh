#!/bin/bash
# session 28, window 4: V in registers on this package's step against fp32 autograd, then the first
# round-7 candidates timed against the table and upstream's SM120 backward, one run (emulated)
D=$OUT/w4; mkdir -p $D; cp .gpu/b/w4.sh $D/script.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $D/gpu.txt 2>&1
git log -1 --format=%H > $D/commit.txt 2>/dev/null
timeout 170 python3 -m pytest -m gpu -n 10 -q -p no:cacheprovider tests/test_bwd_vreg_gpu.py tests/test_bwd_gpu.py -k "vreg" > $D/tests.log 2>&1
echo "tests rc=$?" >> $D/rc.txt
grep -E "FAILED|Error|passed|failed" $D/tests.log | tail -15
timeout 380 python3 scripts/prepare.py --set bwd --emulate --reps 10 --no-ceiling --references upstream_sm120 \
  --bwd-configs configs/measurements/search_bwd/round7_vreg_first.json --json $D/bwd_vreg.json > $D/prepare.log 2>&1
echo "prepare rc=$?" >> $D/rc.txt
grep -E "^problem|^b[0-9]|geomean|ratio|vs_|occupancy_verified|correct" $D/prepare.log | cut -c1-200 | tail -40; cat $D/rc.txt
