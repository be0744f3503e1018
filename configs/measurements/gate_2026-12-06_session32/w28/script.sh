#!/bin/bash
# session 32, window 28: packed documents (varlen) in the backward. The table now serves cu_seqlens calls with its
# plain_only entry (d128 causal: 8w 32x128, V in registers); against the tile they ran before (c128e, 8w 64x64 q2do1)
# and the plain-MHA 4w tile, same run; GPU tests of the plain and varlen cases; compute-sanitizer on varlen GQA causal
D=$OUT/w28; mkdir -p $D; cp .gpu/b/w28.sh $D/script.sh
timeout 280 python3 scripts/prepare.py --set bwd_real --subset varlen --emulate --reps 5 --no-ceiling --references upstream_sm120 \
  --bwd-configs configs/measurements/search_bwd/round11_varlen.json --json $D/bwd_varlen.json > $D/prepare.log 2>&1
echo "prepare rc=$?" >> $D/rc.txt
sed -n '/backward TFLOPS/,$p' $D/prepare.log | cut -c1-250 | tail -24; grep -i "error\|incorrect\|mismatch" $D/prepare.log | cut -c1-300 | head -8
timeout 150 python3 scripts/bwd_kernel_times.py --emulate --set bwd_real --calls 3 \
  --problems b8s0h32k8d128-causal-varlen,b8s0h16k4d64-causal-varlen --json $D/kernel_times.json > $D/kernel_times.log 2>&1
echo "kernel_times rc=$?" >> $D/rc.txt; cut -c1-170 $D/kernel_times.log | grep -v Warn | tail -24
cat $D/rc.txt
