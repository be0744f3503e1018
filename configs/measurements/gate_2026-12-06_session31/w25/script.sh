#!/bin/bash
# session 31, window 25: the 8w 32x128 V-in-registers tile on causal d128, deterministic too, GQA training shapes and the MHA seed rows
D=$OUT/w25; mkdir -p $D; cp .gpu/b/w25.sh $D/script.sh
C=configs/measurements/search_bwd/round10_gqa_causal_det.json
timeout 250 python3 scripts/prepare.py --set bwd_real --subset d128-causal --emulate --reps 5 --no-ceiling --references upstream_sm120 \
  --bwd-configs $C --json $D/bwd_real_causal.json > $D/prepare_real.log 2>&1
echo "prepare_real rc=$?" >> $D/rc.txt
timeout 250 python3 scripts/prepare.py --set bwd --subset d128-causal --emulate --reps 10 --no-ceiling --references upstream_sm120 \
  --bwd-configs $C --json $D/bwd_seed_causal.json > $D/prepare_seed.log 2>&1
echo "prepare_seed rc=$?" >> $D/rc.txt
for f in real seed; do sed -n '/backward TFLOPS/,/^gpu:/p' $D/prepare_$f.log | cut -c1-250; grep "_geomean" $D/prepare_$f.log; grep -i "error\|incorrect" $D/prepare_$f.log | cut -c1-300 | head -5; done; cat $D/rc.txt
