#!/bin/bash
# session 29, window 11: the two fastest causal d128 two-CTA tiles of window 7 against the table again (d128 set)
D=$OUT/w11; mkdir -p $D; cp .gpu/b/w11.sh $D/script.sh
timeout 200 python3 scripts/prepare.py --set bwd --subset d128 --emulate --reps 10 --no-ceiling --references upstream_sm120 \
  --bwd-configs configs/measurements/search_bwd/round8_d128_confirm.json --json $D/bwd_d128_confirm.json > $D/prepare.log 2>&1
echo "prepare rc=$?" >> $D/rc.txt
sed -n '/backward TFLOPS/,$p' $D/prepare.log | cut -c1-250 | tail -22; cat $D/rc.txt
