#!/bin/bash
# session 26, window 2: the P/dS-in-registers candidates timed against the table and upstream's SM120 backward,
# one run (emulated)
D=$OUT/w2; mkdir -p $D; cp .gpu/b/w2.sh $D/script.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $D/gpu.txt 2>&1
timeout 520 python3 scripts/prepare.py --set bwd --emulate --reps 10 --no-ceiling --references upstream_sm120 \
  --bwd-configs rs_candidates.json --json $D/bwd_rs.json > $D/prepare.log 2>&1
echo "prepare rc=$?" >> $D/rc.txt
tail -45 $D/prepare.log | cut -c1-170; cat $D/rc.txt
