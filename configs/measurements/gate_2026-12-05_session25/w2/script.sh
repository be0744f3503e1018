#!/bin/bash
# session 25, window 2: GPU tests of fixed-point dQ (dense, varlen, block-sparse) and the turn orders
D=$OUT/w2; mkdir -p $D; cp .gpu/b/w2.sh $D/script.sh
timeout 540 python3 -m pytest -m gpu -n 8 -q -p no:cacheprovider tests/test_bwd_fixed_point_gpu.py \
  tests/test_bwd_deterministic_gpu.py "tests/test_block_sparse_gpu.py::test_backward_lists_deterministic" \
  tests/test_block_sparse_gpu.py::test_backward_lists_deterministic_turns_with_score_mod \
  > $D/det_tests.log 2>&1; echo "det tests rc=$?" >> $D/rc.txt
grep -E "FAILED|ERROR|passed|failed" $D/det_tests.log | tail -20; cat $D/rc.txt
