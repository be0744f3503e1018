#!/bin/bash
# session 35, call 2: (1) the turns entry's GPU tests (MHA via the table, GQA forced: decides
# config_bwd.TURNS_ENTRIES_SERVE_GQA) and the fixed-point tests (the fresh epilogue tid); (2) round 15: d96
# 64x128 fixed-point tiles (a144 masked every tile: spill-free) and rotated turns, against the table's
# deterministic row; (3) sanitizer on the turns entry
D=$OUT/w43a; mkdir -p $D; cp .gpu/b/w43a.sh $D/script.sh
nvidia-smi --query-gpu=name --format=csv,noheader > $D/gpu.txt
timeout 150 python3 -m pytest -m gpu -n 8 -q -p no:cacheprovider tests/test_bwd_deterministic_gpu.py tests/test_bwd_gpu.py \
  tests/test_bwd_fixed_point_gpu.py -k "turns or (dense_bitwise and 96) or fixed" > $D/tests.log 2>&1
echo "tests rc=$?" >> $D/rc.txt; grep -E "FAILED|passed|failed" $D/tests.log | cut -c1-250 | tail -8
timeout 170 python3 scripts/prepare.py --set bwd --subset h16d96 --emulate --reps 10 --no-ceiling --references upstream_sm120 \
  --bwd-configs configs/measurements/search_bwd/round15_d96_fixed.json --json $D/bwd_d96_fixed.json > $D/prepare_d96.log 2>&1
echo "prepare d96 rc=$?" >> $D/rc.txt
sed -n '/backward TFLOPS/,$p' $D/prepare_d96.log | cut -c1-200 | grep -v "^fwd\|nan$" | tail -16
timeout 100 python3 scripts/sanitize.py --shapes bwd-d96-det-causal-turns-entry --timeout 45 --log-dir $D/san > $D/sanitize.log 2>&1
echo "sanitize rc=$?" >> $D/rc.txt; tail -5 $D/sanitize.log
cat $D/rc.txt
