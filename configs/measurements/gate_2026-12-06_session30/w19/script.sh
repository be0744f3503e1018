#!/bin/bash
# session 30, window 19: on the causal seed problems, the table with the longest-first launch forced (the
# two-CTA causal tiles have a grid-order tail in a list-scheduling model; the 1-CTA tiles measured -2% with it)
D=$OUT/w19; mkdir -p $D; cp .gpu/b/w19.sh $D/script.sh
timeout 210 python3 scripts/prepare.py --set bwd --subset causal --emulate --reps 10 --no-ceiling --references upstream_sm120 \
  --launch-variants launch_lpt --json $D/bwd_causal_launch.json > $D/prepare.log 2>&1
echo "prepare rc=$?" >> $D/rc.txt
sed -n '/backward TFLOPS/,$p' $D/prepare.log | cut -c1-250 | tail -22; cat $D/rc.txt
