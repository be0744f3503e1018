#!/bin/bash
# session 30, window 14: the rest of round 7 (V in registers: d64 8w 64x128 q2do2, d96 4w q2do1 / swaps,
# d128 a141, 64x64 q2do2, swaps) against the table and upstream
D=$OUT/w14; mkdir -p $D; cp .gpu/b/w14.sh $D/script.sh
timeout 450 python3 scripts/prepare.py --set bwd --emulate --reps 10 --no-ceiling --references upstream_sm120 \
  --bwd-configs configs/measurements/search_bwd/round7_vreg_rest.json --json $D/bwd_vreg_rest.json > $D/prepare.log 2>&1
echo "prepare rc=$?" >> $D/rc.txt
sed -n '/backward TFLOPS/,$p' $D/prepare.log | cut -c1-250 | tail -30; cat $D/rc.txt
