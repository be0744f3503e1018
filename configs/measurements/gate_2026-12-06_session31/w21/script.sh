#!/bin/bash
# session 31, window 21: why causal loses more than upstream does. Nsight Compute on the same backward tile,
# causal against its non-causal twin (d96: one tile serves both; d64: each mask's entry on the other's problem),
# then per-kernel times of every seed problem (pre/postprocess share)
D=$OUT/w21; mkdir -p $D; cp .gpu/b/w21.sh $D/script.sh
export FLASH_ATTN_SM120_EMULATE=1
run() { local name=$1; shift; timeout 150 python3 scripts/ncu_compare.py "$@" > $D/$name.log 2>&1; echo "$name rc=$?" >> $D/rc.txt; tail -32 $D/$name.log; }
run ncu_d96_causal --problem b2s4096h16d96 --causal --candidate bwd:table --reference bwd:upstream
run ncu_d96 --problem b2s4096h16d96 --candidate bwd:table --reference bwd:upstream
run ncu_d64_causal --problem b4s2048h32d64 --causal --candidate bwd:table --reference bwd:config:bwd-w8-64x128-q2do2-a244
run ncu_d64 --problem b4s2048h32d64 --candidate bwd:config:bwd-w4-64x64-q1do1-a242-vreg --reference bwd:table
timeout 150 python3 scripts/bwd_kernel_times.py --emulate --calls 5 --json $D/kernel_times.json > $D/kernel_times.log 2>&1
echo "kernel_times rc=$?" >> $D/rc.txt; tail -60 $D/kernel_times.log | cut -c1-200; cat $D/rc.txt
