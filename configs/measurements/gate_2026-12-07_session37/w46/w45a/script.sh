#!/bin/bash
# session 36 call 2 (head_scale in the fixed-point kernels: the fixed-point and block-sparse det tests);
# the first window: (1) the turns entries forced on GQA (decides config_bwd.ROTATED_ENTRIES_SERVE_GQA
# for the d96 rotated entry), the deterministic d96 tests, the turns entries' configs; (2) sanitizer on both
# d96 turns entries; (3) the seed problems: table / deterministic / upstream in one run (the det gate with the
# d96 rotated entry); (4) round 16: d64 64x128 tiles in the rotated turns against the table's deterministic row
D=$OUT/w45a; mkdir -p $D; cp .gpu/b/w45a.sh $D/script.sh
nvidia-smi --query-gpu=name --format=csv,noheader > $D/gpu.txt
timeout 120 python3 -m pytest -m gpu -n 8 -q -p no:cacheprovider tests/test_bwd_deterministic_gpu.py tests/test_bwd_gpu.py tests/test_bwd_fixed_point_kernels_gpu.py \
  -k "turns or (deterministic_gpu and 96) or (deterministic_gpu and gqa) or plans_own" > $D/tests.log 2>&1
echo "tests rc=$?" >> $D/rc.txt; grep -E "FAILED|passed|failed" $D/tests.log | cut -c1-250 | tail -8
timeout 130 python3 -m pytest -m gpu -n 8 -q -p no:cacheprovider tests/test_bwd_fixed_point_gpu.py tests/test_bwd_fixed_point_kernels_gpu.py tests/test_block_sparse_gpu.py tests/test_api_parity_gpu.py \
  -k "fixed_point_gpu or dominant or lists_deterministic or parity" > $D/tests_fixed.log 2>&1
echo "tests fixed rc=$?" >> $D/rc.txt; grep -E "FAILED|passed|failed" $D/tests_fixed.log | cut -c1-250 | tail -8
FLASH_ATTN_SM120_FUZZ=deep timeout 80 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_fuzz_gpu.py -k "det028" > $D/fuzz_rotated_entry.log 2>&1
echo "fuzz rc=$?" >> $D/rc.txt; tail -2 $D/fuzz_rotated_entry.log | cut -c1-200
timeout 80 python3 scripts/sanitize.py --shapes bwd-d96-det-causal-turns-entry,bwd-d96-det-none-turns-entry --timeout 35 \
  --log-dir $D/san > $D/sanitize.log 2>&1
echo "sanitize rc=$?" >> $D/rc.txt; tail -6 $D/sanitize.log
cat $D/rc.txt
