#!/bin/bash
# session 31, window 23: the backward on training shapes (GQA, the cuDNN benchmark's llama3.1 shape, d64/d192),
# table and deterministic against upstream's SM120 backward; then where a GQA call's time goes
D=$OUT/w23; mkdir -p $D; cp .gpu/b/w23.sh $D/script.sh
timeout 400 python3 scripts/prepare.py --set bwd_real --emulate --reps 5 --no-ceiling --references upstream_sm120 \
  --json $D/bwd_real.json > $D/prepare.log 2>&1
echo "prepare rc=$?" >> $D/rc.txt
sed -n '/backward TFLOPS/,$p' $D/prepare.log | cut -c1-250 | tail -24; grep -i "error\|incorrect" $D/prepare.log | cut -c1-300 | head -8
timeout 150 python3 scripts/bwd_kernel_times.py --emulate --set bwd_real --calls 3 \
  --problems b2s8192h64k8d128-causal,b8s2048h16k4d64-causal,b8s2048h32k8d128-causal --json $D/kernel_times.json > $D/kernel_times.log 2>&1
echo "kernel_times rc=$?" >> $D/rc.txt; cut -c1-170 $D/kernel_times.log | grep -v Warn | tail -40; cat $D/rc.txt
