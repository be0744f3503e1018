#!/bin/bash
# session 34, window 38: (1) the fixed-point GPU tests (nothing after 0e4fd09 has run on a GPU: the seqused fix, dLSE,
# the O/Q reads of the scales kernel); (2) the seed problems per head dim: table, table deterministic, upstream, and the
# round-13 deterministic-only tiles (n_block 128 at d64/d96/d128; "-fixed": fixed point forced with a causal mask)
D=$OUT/w38; mkdir -p $D; cp .gpu/b/w38.sh $D/script.sh
nvidia-smi --query-gpu=name --format=csv,noheader > $D/gpu.txt
timeout 110 python3 -m pytest -m gpu -n 8 -q -p no:cacheprovider tests/test_bwd_fixed_point_kernels_gpu.py \
  tests/test_bwd_fixed_point_gpu.py > $D/tests.log 2>&1
echo "tests rc=$?" >> $D/rc.txt; grep -E "FAILED|Error|passed|failed" $D/tests.log | cut -c1-250 | tail -14
for s in d128:205 h16d96:115 h32d64:135; do
  sub=${s%:*}; t=${s#*:}
  timeout $t python3 scripts/prepare.py --set bwd --subset $sub --emulate --reps 10 --no-ceiling --references upstream_sm120 \
    --bwd-configs configs/measurements/search_bwd/round13_det_tiles.json --json $D/bwd_det_$sub.json > $D/prepare_$sub.log 2>&1
  echo "prepare $sub rc=$?" >> $D/rc.txt
  sed -n '/backward TFLOPS/,$p' $D/prepare_$sub.log | cut -c1-250 | grep -v "^fwd\|nan$" | tail -14
  grep -i "error\|incorrect\|mismatch" $D/prepare_$sub.log | cut -c1-300 | head -4
done
cat $D/rc.txt
