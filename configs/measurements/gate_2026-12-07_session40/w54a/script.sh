#!/bin/bash
# session 40: block-sparse vs dense at longer sequences (fixed per-tile cost attribution), forward (graphs) and backward (eager)
D=$OUT/w54a; mkdir -p $D; cp .gpu/b/w54a.sh $D/script.sh
nvidia-smi --query-gpu=name --format=csv,noheader > $D/gpu.txt; cat $D/gpu.txt
finish() { tar czf $OUT/w54a.tgz -C $OUT w54a; }
trap finish EXIT
FLASH_ATTN_SM120_EMULATE=1 timeout 230 python3 -u scripts/bench_block_sparse.py --graph --seqlens 8192,16384,32768 --reps 5 --json $D/bs_fwd_seqlens.json > $D/fwd.log 2>&1
echo "fwd rc=$?" >> $D/rc.txt; grep -a "emulated\]" $D/fwd.log | cut -c1-200
FLASH_ATTN_SM120_EMULATE=1 timeout 320 python3 -u scripts/bench_block_sparse.py --bwd --seqlens 8192,16384,32768 --reps 5 --json $D/bs_bwd_seqlens.json > $D/bwd.log 2>&1
echo "bwd rc=$?" >> $D/rc.txt; grep -a "emulated\]" $D/bwd.log | cut -c1-200
tail -n 3 $D/fwd.log $D/bwd.log | cut -c1-200
cat $D/rc.txt
