#!/bin/bash
# session 33, window 30: the fixed-point dQ's new helper kernels (per-head scales in one launch; int64 -> dQ
# postprocess) bit for bit against the torch path; the fixed-point GPU tests; packed documents now deterministic
# in fixed point (the table's deterministic row) against the ascending turns they took before, same run
D=$OUT/w30; mkdir -p $D; cp .gpu/b/w30.sh $D/script.sh
timeout 250 python3 -m pytest -m gpu -n 8 -q -p no:cacheprovider tests/test_bwd_fixed_point_kernels_gpu.py \
  tests/test_bwd_fixed_point_gpu.py > $D/tests.log 2>&1
echo "tests rc=$?" >> $D/rc.txt; grep -E "FAILED|Error|passed|failed" $D/tests.log | cut -c1-250 | tail -14
timeout 200 python3 scripts/prepare.py --set bwd_real --subset varlen --emulate --reps 5 --no-ceiling \
  --references upstream_sm120 --det-variants det_ascending --json $D/bwd_varlen_det.json > $D/prepare.log 2>&1
echo "prepare rc=$?" >> $D/rc.txt
sed -n '/backward TFLOPS/,$p' $D/prepare.log | cut -c1-250 | tail -16; grep -i "error\|incorrect\|mismatch" $D/prepare.log | cut -c1-300 | head -6
timeout 120 python3 scripts/bwd_kernel_times.py --emulate --set bwd_real --calls 3 --det-variants det_ascending \
  --problems b8s0h32k8d128-causal-varlen --json $D/kernel_times_varlen.json > $D/kernel_times.log 2>&1
echo "kernel_times rc=$?" >> $D/rc.txt; cut -c1-150 $D/kernel_times.log | grep -v Warn | tail -30
cat $D/rc.txt
