#!/bin/bash
# session 26, window 1: P/dS in registers (BwdConfig.pds_in_regs) -- GPU tests
D=$OUT/w1; mkdir -p $D; cp .gpu/b/w1.sh $D/script.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $D/gpu.txt 2>&1
timeout 300 python3 -m pytest -m gpu -n 10 -q -p no:cacheprovider tests/test_bwd_pds_regs_gpu.py > $D/tests.log 2>&1
echo "tests rc=$?" >> $D/rc.txt
grep -E "FAILED|passed|failed|Error" $D/tests.log | tail -14; cat $D/rc.txt
