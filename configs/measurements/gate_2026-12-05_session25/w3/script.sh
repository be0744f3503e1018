#!/bin/bash
# session 25, window 3: GPU tests of the fixes and of the block-sparse walk's fixed point / list turns; then fixed
# point (forced, lighter scales/dequantize) vs the turns now default for dense calls, same run
D=$OUT/w3; mkdir -p $D; cp .gpu/b/w3.sh $D/script.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $D/gpu.txt 2>&1
timeout 170 python3 -m pytest -m gpu -n 8 -q -p no:cacheprovider tests/test_bwd_fixed_point_gpu.py \
  "tests/test_compile_gpu.py::test_compiled_matches_eager_deterministic" \
  tests/test_block_sparse_gpu.py::test_backward_lists_deterministic \
  tests/test_block_sparse_gpu.py::test_backward_lists_deterministic_turns_with_score_mod > $D/tests.log 2>&1; echo "tests rc=$?" >> $D/rc.txt
grep -E "FAILED|passed|failed" $D/tests.log | tail -8
timeout 190 python3 scripts/prepare.py --set bwd --emulate --reps 10 --no-ceiling --references upstream_sm120 \
  --det-variants det_fixed_point --json $D/bwd_fixed_point.json > $D/prepare.log 2>&1; echo "prepare rc=$?" >> $D/rc.txt
grep -E "geomean|verified" $D/prepare.log; cat $D/rc.txt
