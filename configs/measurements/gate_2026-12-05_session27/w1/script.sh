#!/bin/bash
# session 27, window 1: the wide dQ adds (launch plan's dq_wide_adds) against fp32 autograd, then timed
# against the table (plain adds) and upstream's SM120 backward, one run (emulated)
D=$OUT/w1; mkdir -p $D; cp .gpu/b/w1.sh $D/script.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $D/gpu.txt 2>&1
timeout 230 python3 -m pytest -m gpu -n 10 -q -p no:cacheprovider tests/test_bwd_dq_wide_gpu.py > $D/tests.log 2>&1
echo "tests rc=$?" >> $D/rc.txt
grep -E "FAILED|Error|passed|failed" $D/tests.log | tail -12
timeout 330 python3 scripts/prepare.py --set bwd --emulate --reps 10 --no-ceiling --references upstream_sm120 \
  --launch-variants launch_dq_wide --json $D/bwd_dq_wide.json > $D/prepare.log 2>&1
echo "prepare rc=$?" >> $D/rc.txt
grep -E "^\[emulated\]|geomean|ratio|occupancy_verified" $D/prepare.log | cut -c1-150 | tail -45; cat $D/rc.txt
