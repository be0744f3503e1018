#!/bin/bash
# session 40: why a sparse block costs more than a dense one: launch orders (grid, head groups) at s8192 / s32768, and ncu (L2 hit rate)
D=$OUT/w55; mkdir -p $D; cp .gpu/b/w55.sh $D/script.sh
nvidia-smi --query-gpu=name --format=csv,noheader > $D/gpu.txt; cat $D/gpu.txt
finish() { tar czf $OUT/w55.tgz -C $OUT w55; }
trap finish EXIT
FLASH_ATTN_SM120_EMULATE=1 timeout 170 python3 -u scripts/bench_block_sparse.py --graph --grid-order --head-groups 1,2,4 --seqlens 8192,32768 --head-dims 128,64 --masks random10,window+global --reps 5 --json $D/bs_fwd_orders.json > $D/fwd.log 2>&1
echo "fwd rc=$?" >> $D/rc.txt; grep -a "emulated\]\|order\|groups" $D/fwd.log | cut -c1-200
FLASH_ATTN_SM120_EMULATE=1 timeout 140 python3 -u scripts/bench_block_sparse.py --bwd --grid-order --head-groups 1,4 --seqlens 8192,32768 --head-dims 128 --masks random10 --reps 5 --json $D/bs_bwd_orders.json > $D/bwd.log 2>&1
echo "bwd rc=$?" >> $D/rc.txt; grep -a "emulated\]\|order\|groups" $D/bwd.log | cut -c1-200
FLASH_ATTN_SM120_EMULATE=1 timeout 90 python3 -u scripts/ncu_compare.py --problem b1s32768h16d128 --candidate sparse:0.1 --reference table > $D/ncu_s32k.log 2>&1
echo "ncu s32k rc=$?" >> $D/rc.txt; cat $D/ncu_s32k.log | grep -v "^==" | head -40
FLASH_ATTN_SM120_EMULATE=1 timeout 60 python3 -u scripts/ncu_compare.py --problem b1s8192h16d128 --candidate sparse:0.1 --reference table > $D/ncu_s8k.log 2>&1
echo "ncu s8k rc=$?" >> $D/rc.txt; cat $D/ncu_s8k.log | grep -v "^==" | head -20
FLASH_ATTN_SM120_EMULATE=1 timeout 90 python3 -u scripts/ncu_compare.py --problem b1s8192h16d128 --candidate bwd:sparse:0.1 --reference bwd:table > $D/ncu_bwd_s8k.log 2>&1
echo "ncu bwd rc=$?" >> $D/rc.txt; cat $D/ncu_bwd_s8k.log | grep -v "^==" | head -40
tail -n 3 $D/fwd.log $D/bwd.log | cut -c1-200
cat $D/rc.txt
