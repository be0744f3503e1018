#!/bin/bash
# session 26, window 3: compute-sanitizer on the fixed-point shapes (shipped table) and on the P/dS-in-registers
# kernels (a table of round-6 candidates, rs_table.toml); the deep fuzz profile's deterministic cases
D=$OUT/w3; mkdir -p $D; cp .gpu/b/w3.sh rs_table.toml $D/
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $D/gpu.txt 2>&1
timeout 170 python3 scripts/sanitize.py --shapes bwd-d64-det-local,bs-bwd-d128-causal-det-gqa --timeout 150 \
  --log-dir $D/san_fixed > $D/sanitize_fixed.log 2>&1; echo "sanitize fixed rc=$?" >> $D/rc.txt
tail -8 $D/sanitize_fixed.log
FLASH_ATTN_SM120_BWD_TABLE=rs_table.toml timeout 190 python3 scripts/sanitize.py --timeout 170 \
  --shapes bwd-d64-det-local,bwd-d128-det-causal-gqa,bwd-d64-document-sink,bwd-d128-det-none \
  --log-dir $D/san_rs > $D/sanitize_rs.log 2>&1; echo "sanitize rs rc=$?" >> $D/rc.txt
tail -8 $D/sanitize_rs.log
FLASH_ATTN_SM120_FUZZ=deep timeout 200 python3 -m pytest -m gpu -n 10 -q -p no:cacheprovider -k det \
  tests/test_fuzz_gpu.py > $D/fuzz_deep_det.log 2>&1; echo "fuzz deep det rc=$?" >> $D/rc.txt
grep -E "FAILED|passed|failed" $D/fuzz_deep_det.log | tail -6; cat $D/rc.txt
