#!/bin/bash
# session 30, window 18: the shipped backward table (d64 causal on 4 warps, d128 causal plain-MHA entry) against
# upstream's SM120 backward on the 8 seed problems, with the same-class GEMM ceiling
D=$OUT/w18; mkdir -p $D; cp .gpu/b/w18.sh $D/script.sh
timeout 330 python3 scripts/prepare.py --set bwd --emulate --reps 10 --references upstream_sm120 \
  --json $D/bwd_table_session30.json > $D/prepare.log 2>&1
echo "prepare rc=$?" >> $D/rc.txt
sed -n '/backward TFLOPS/,$p' $D/prepare.log | cut -c1-250 | tail -26; cat $D/rc.txt
