#!/bin/bash
# session 31 (prepared in 30), window 20: 4-warp 64x64 tiles with V and P/dS in registers (two CTAs per SM,
# 34 / 46 KB; d64 spill-free in every call variant, d96 spills with GQA and fp16) against the table, all
# problems of their head dims; then the per-tile mask test on the causal rows of the table's two-CTA tiles
D=$OUT/w20; mkdir -p $D; cp .gpu/b/w20.sh $D/script.sh
timeout 260 python3 scripts/prepare.py --set bwd --emulate --reps 10 --no-ceiling --references upstream_sm120 \
  --bwd-configs configs/measurements/search_bwd/round9_pds_vreg.json --json $D/bwd_pds_vreg.json > $D/prepare.log 2>&1
echo "prepare rc=$?" >> $D/rc.txt
sed -n '/backward TFLOPS/,$p' $D/prepare.log | cut -c1-250 | tail -24
timeout 200 python3 scripts/prepare.py --set bwd --subset causal --emulate --reps 10 --no-ceiling --references upstream_sm120 \
  --launch-variants launch_mask_where_needed --json $D/bwd_causal_where_needed.json > $D/prepare_mask.log 2>&1
echo "prepare_mask rc=$?" >> $D/rc.txt
sed -n '/backward TFLOPS/,$p' $D/prepare_mask.log | cut -c1-250 | tail -20; cat $D/rc.txt
