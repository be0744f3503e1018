#!/bin/bash
# session 31, window 22: the deep fuzz profile over the backward paths on the current table (part $1: bwd | det)
D=$OUT/w22_$1; mkdir -p $D; cp .gpu/b/w22.sh $D/script.sh
FLASH_ATTN_SM120_FUZZ=deep timeout 560 python3 -m pytest -m gpu -n 10 -q tests/test_fuzz_gpu.py -k "$1" -p no:cacheprovider > $D/fuzz.log 2>&1
echo "fuzz $1 rc=$?" >> $D/rc.txt; tail -15 $D/fuzz.log; cat $D/rc.txt
