#!/bin/bash
# session 33, window 33: the deterministic plan after the routing change (fixed point for every call but a dense causal
# one): the seed problems, the table's deterministic row (new plan) against det_fused (the previous plan: rotated
# turns without a mask, descending with), same run; the plan's own fixed-point calls on the GPU; deterministic tests
D=$OUT/w33; mkdir -p $D; cp .gpu/b/w33.sh $D/script.sh
timeout 300 python3 scripts/prepare.py --set bwd --emulate --reps 10 --no-ceiling --references upstream_sm120 \
  --det-variants det_fused --json $D/bwd_seed_det.json > $D/prepare.log 2>&1
echo "prepare rc=$?" >> $D/rc.txt
sed -n '/backward TFLOPS/,$p' $D/prepare.log | cut -c1-250 | grep -v "^fwd\|nan$" | tail -16; grep -i "error\|incorrect\|mismatch" $D/prepare.log | cut -c1-300 | head -6
timeout 230 python3 -m pytest -m gpu -n 8 -q -p no:cacheprovider tests/test_bwd_fixed_point_kernels_gpu.py \
  tests/test_bwd_deterministic_gpu.py > $D/tests.log 2>&1
echo "tests rc=$?" >> $D/rc.txt; grep -E "FAILED|Error|passed|failed" $D/tests.log | cut -c1-250 | tail -10

timeout 60 python3 scripts/bwd_kernel_times.py --emulate --set bwd_real --calls 3 --problems b8s0h32k8d128-causal-varlen \
  --json $D/kernel_times_varlen.json > $D/kernel_times.log 2>&1
echo "kernel_times rc=$?" >> $D/rc.txt; cut -c1-150 $D/kernel_times.log | grep -v Warn | grep -A8 deterministic
cat $D/rc.txt
