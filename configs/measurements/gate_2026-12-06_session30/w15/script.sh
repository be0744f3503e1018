#!/bin/bash
# session 30, window 15: the two 4-warp d64 V-in-register tiles that led d64 causal in window 8, against the table again
D=$OUT/w15; mkdir -p $D; cp .gpu/b/w15.sh $D/script.sh
timeout 300 python3 scripts/prepare.py --set bwd --subset d64 --emulate --reps 20 --no-ceiling --references upstream_sm120 \
  --bwd-configs configs/measurements/search_bwd/round9_d64_causal_confirm.json --json $D/bwd_d64_confirm.json > $D/prepare.log 2>&1
echo "prepare rc=$?" >> $D/rc.txt
sed -n '/backward TFLOPS/,$p' $D/prepare.log | cut -c1-250 | tail -22; cat $D/rc.txt
