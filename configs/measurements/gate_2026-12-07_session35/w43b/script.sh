#!/bin/bash
# session 35, call 3: the seed problems: table / deterministic plan / upstream, plus fixed point forced with the
# mask where needed and on every tile (is masking every tile free for fixed point?), same run
D=$OUT/w43b; mkdir -p $D; cp .gpu/b/w43b.sh $D/script.sh
nvidia-smi --query-gpu=name --format=csv,noheader > $D/gpu.txt
timeout 420 python3 scripts/prepare.py --set bwd --emulate --reps 10 --no-ceiling --references upstream_sm120 \
  --det-variants det_fixed_point,det_fixed_point_mask_always --json $D/bwd_seed.json > $D/prepare_seed.log 2>&1
echo "prepare seed rc=$?" >> $D/rc.txt
sed -n '/backward TFLOPS/,$p' $D/prepare_seed.log | cut -c1-220 | grep -v "^fwd\|nan$" | tail -30
cat $D/rc.txt
