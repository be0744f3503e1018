#!/bin/bash
# session 29, window 8: the shipped table against upstream, the previous entries and 4-warp d64 V-in-register
# tiles (all problems), then the table's GPU tests
D=$OUT/w8; mkdir -p $D; cp .gpu/b/w8.sh $D/script.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $D/gpu.txt 2>&1
timeout 380 python3 scripts/prepare.py --set bwd --emulate --reps 10 --no-ceiling --references upstream_sm120 \
  --bwd-configs configs/measurements/search_bwd/round7_table_check.json --json $D/bwd_table_check.json > $D/prepare.log 2>&1
echo "prepare rc=$?" >> $D/rc.txt
sed -n '/backward TFLOPS/,$p' $D/prepare.log | cut -c1-250 | tail -30
# (tests: w13)

cat $D/rc.txt
