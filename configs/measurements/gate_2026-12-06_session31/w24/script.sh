#!/bin/bash
# session 31, window 24: GQA d128 causal backward on the V-in-registers tiles (the plain-MHA causal entry, which
# spills 16 B with GQA, and the non-causal entry, spill-free with GQA) against the table's 8w 64x64 q2do1
D=$OUT/w24; mkdir -p $D; cp .gpu/b/w24.sh $D/script.sh
timeout 300 python3 scripts/prepare.py --set bwd_real --subset d128-causal --emulate --reps 5 --no-ceiling --references upstream_sm120 \
  --bwd-configs configs/measurements/search_bwd/round10_gqa_causal.json --json $D/bwd_gqa_causal.json > $D/prepare.log 2>&1
echo "prepare rc=$?" >> $D/rc.txt
sed -n '/backward TFLOPS/,$p' $D/prepare.log | cut -c1-250 | tail -24; grep -i "error\|incorrect" $D/prepare.log | cut -c1-300 | head -8; cat $D/rc.txt
