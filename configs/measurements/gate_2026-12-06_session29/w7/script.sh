#!/bin/bash
# session 29, window 7: V in registers with V's prologue copy running from sQ into sdO (GPU tests against fp32
# autograd, incl. d128 on 4 warps at 2 CTAs/SM), then those d128 tiles against the table and upstream (d128 set)
D=$OUT/w7; mkdir -p $D; cp .gpu/b/w7.sh $D/script.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $D/gpu.txt 2>&1
timeout 210 python3 -m pytest -m gpu -n 10 -q -p no:cacheprovider tests/test_bwd_vreg_gpu.py > $D/tests.log 2>&1
echo "tests rc=$?" >> $D/rc.txt
grep -E "FAILED|Error|passed|failed" $D/tests.log | tail -15
timeout 370 python3 scripts/prepare.py --set bwd --subset d128 --emulate --reps 10 --no-ceiling --references upstream_sm120 \
  --bwd-configs configs/measurements/search_bwd/round8_d128_two_cta.json --json $D/bwd_d128_two_cta.json > $D/prepare.log 2>&1
echo "prepare rc=$?" >> $D/rc.txt
sed -n '/backward TFLOPS/,$p' $D/prepare.log | cut -c1-250 | tail -30; cat $D/rc.txt
