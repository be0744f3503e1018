#!/bin/bash
# session 33, window 31: the seed problems deterministic: the table's plan (turns) against fixed point forced, now
# that fixed point's scales take one launch and its dequantize rides in the postprocess; kernel times of both
D=$OUT/w31; mkdir -p $D; cp .gpu/b/w31.sh $D/script.sh
timeout 420 python3 scripts/prepare.py --set bwd --emulate --reps 10 --no-ceiling --references upstream_sm120 \
  --det-variants det_fixed_point --json $D/bwd_seed_det.json > $D/prepare.log 2>&1
echo "prepare rc=$?" >> $D/rc.txt
sed -n '/backward TFLOPS/,$p' $D/prepare.log | cut -c1-250 | tail -18; grep -i "error\|incorrect\|mismatch" $D/prepare.log | cut -c1-300 | head -6
timeout 150 python3 scripts/bwd_kernel_times.py --emulate --calls 3 --det-variants det_fixed_point \
  --problems b4s2048h32d64-causal,b1s8192h16d128 --json $D/kernel_times_seed.json > $D/kernel_times.log 2>&1
echo "kernel_times rc=$?" >> $D/rc.txt; cut -c1-150 $D/kernel_times.log | grep -v Warn | tail -40
cat $D/rc.txt
