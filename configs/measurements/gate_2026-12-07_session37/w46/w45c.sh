#!/bin/bash
# session 36, call 3: round 17: d128 tiles in the rotated turns (det_fused: rotated without a mask) against the
# table's deterministic row (fixed point on 8w 32x128), b1 s8192 / b2 s4096 h16 d128; the causal rows ride along
D=$OUT/w45c; mkdir -p $D; cp .gpu/b/w45c.sh $D/script.sh
nvidia-smi --query-gpu=name --format=csv,noheader > $D/gpu.txt
timeout 100 python3 scripts/prepare.py --set bwd --subset h32d64 --emulate --reps 10 --no-ceiling --references upstream_sm120 \
  --bwd-configs configs/measurements/search_bwd/round16_d64_rotated.json --json $D/bwd_d64_rotated.json > $D/prepare_d64.log 2>&1
echo "prepare d64 rc=$?" >> $D/rc.txt
sed -n '/backward TFLOPS/,/^gpu/p' $D/prepare_d64.log | cut -c1-220
timeout 180 python3 scripts/prepare.py --set bwd --subset h16d128 --emulate --reps 10 --no-ceiling --references upstream_sm120 \
  --bwd-configs configs/measurements/search_bwd/round17_d128_rotated.json --json $D/bwd_d128_rotated.json > $D/prepare_d128.log 2>&1
echo "prepare d128 rc=$?" >> $D/rc.txt
sed -n '/backward TFLOPS/,/^gpu/p' $D/prepare_d128.log | cut -c1-240
cat $D/rc.txt
