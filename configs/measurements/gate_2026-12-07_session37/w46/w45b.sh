#!/bin/bash
# next session's first window: (1) the turns entries forced on GQA (decides config_bwd.ROTATED_ENTRIES_SERVE_GQA
# for the d96 rotated entry), the deterministic d96 tests, the turns entries' configs; (2) sanitizer on both
# d96 turns entries; (3) the seed problems: table / deterministic / upstream in one run (the det gate with the
# d96 rotated entry); (4) round 16: d64 64x128 tiles in the rotated turns against the table's deterministic row
D=$OUT/w45b; mkdir -p $D; cp .gpu/b/w45b.sh $D/script.sh
nvidia-smi --query-gpu=name --format=csv,noheader > $D/gpu.txt
timeout 170 python3 scripts/prepare.py --set bwd --emulate --reps 10 --no-ceiling --references upstream_sm120 \
  --json $D/bwd_seed.json > $D/prepare_seed.log 2>&1
echo "prepare seed rc=$?" >> $D/rc.txt
sed -n '/backward TFLOPS/,$p' $D/prepare_seed.log | cut -c1-200 | grep -v "^fwd\|nan$" | tail -20
cat $D/rc.txt
