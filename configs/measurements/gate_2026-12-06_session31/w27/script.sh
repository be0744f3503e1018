#!/bin/bash
# session 31, window 27: fast fuzz of the backward paths, then the training-shape set with the new table
D=$OUT/w27; mkdir -p $D; cp .gpu/b/w27.sh $D/script.sh
FLASH_ATTN_SM120_FUZZ=fast timeout 200 python3 -m pytest -m gpu -n 10 -q -p no:cacheprovider -k "bwd or det" tests/test_fuzz_gpu.py > $D/fuzz.log 2>&1
echo "fuzz rc=$?" >> $D/rc.txt; tail -2 $D/fuzz.log
timeout 250 python3 scripts/prepare.py --set bwd_real --emulate --reps 5 --no-ceiling --references upstream_sm120 \
  --json $D/bwd_real.json > $D/prepare.log 2>&1
echo "prepare rc=$?" >> $D/rc.txt
sed -n '/backward TFLOPS/,$p' $D/prepare.log | cut -c1-250 | tail -24; cat $D/rc.txt
