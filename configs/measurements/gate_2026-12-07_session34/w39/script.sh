#!/bin/bash
# session 34, window 39: sanitizer on the fixed-point shapes (the scales kernel now reads five tensors), deterministic
# varlen/seqused GPU tests, the deep fuzz profile's deterministic cases, and packed documents deterministic
D=$OUT/w39; mkdir -p $D; cp .gpu/b/w39.sh $D/script.sh
nvidia-smi --query-gpu=name --format=csv,noheader > $D/gpu.txt
timeout 200 python3 scripts/sanitize.py --shapes bwd-d128-det-varlen-gqa,bwd-d128-det-none --timeout 90 --log-dir $D/san > $D/sanitize.log 2>&1
echo "sanitize rc=$?" >> $D/rc.txt; tail -6 $D/sanitize.log
timeout 150 python3 -m pytest -m gpu -n 8 -q -p no:cacheprovider tests/test_bwd_deterministic_gpu.py > $D/det_tests.log 2>&1
echo "det tests rc=$?" >> $D/rc.txt; grep -E "FAILED|passed|failed" $D/det_tests.log | cut -c1-250 | tail -8
FLASH_ATTN_SM120_FUZZ=deep timeout 120 python3 -m pytest -m gpu -n 8 -q -p no:cacheprovider tests/test_fuzz_gpu.py -k "det" > $D/fuzz_deep.log 2>&1
echo "fuzz rc=$?" >> $D/rc.txt; grep -E "FAILED|passed|failed" $D/fuzz_deep.log | cut -c1-250 | tail -8
timeout 110 python3 scripts/prepare.py --set bwd_real --subset varlen --emulate --reps 5 --no-ceiling \
  --references upstream_sm120 --json $D/bwd_varlen_det.json > $D/prepare_varlen.log 2>&1
echo "prepare varlen rc=$?" >> $D/rc.txt
sed -n '/backward TFLOPS/,$p' $D/prepare_varlen.log | cut -c1-250 | grep -v "^fwd\|nan$" | tail -10
cat $D/rc.txt
