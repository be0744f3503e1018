#!/bin/bash
# session 38, call B: causal seed rows, the shipped deterministic plan against descending turns with the usual
# launch (det_fused_resident) and two dQ accumulators (det_split_fused); sanitizer on the new window turns and the
# d96 turns entries
D=$OUT/w48b; mkdir -p $D; cp .gpu/b/w48b.sh $D/script.sh
nvidia-smi --query-gpu=name --format=csv,noheader > $D/gpu.txt; cat $D/gpu.txt
finish() { tar czf $OUT/w48b.tgz -C $OUT w48b; }
trap finish EXIT
timeout 200 python3 -u scripts/prepare.py --set bwd --subset causal --emulate --reps 10 --no-ceiling --references upstream_sm120 \
  --det-variants det_fused_resident,det_split_fused --det-subset causal --json $D/bwd_causal_det_launch.json > $D/prepare.log 2>&1
echo "prepare rc=$?" >> $D/rc.txt
sed -n '/backward TFLOPS/,$p' $D/prepare.log | cut -c1-200 | grep -v "^fwd\|nan$" | tail -22
timeout 330 python3 scripts/sanitize.py --shapes bwd-d128-det-local-turns,bwd-d64-det-local-varlen,bwd-d96-det-causal-turns-entry,bwd-d96-det-none-turns-entry \
  --timeout 75 --log-dir $D/san > $D/sanitize.log 2>&1
echo "sanitize rc=$?" >> $D/rc.txt; tail -10 $D/sanitize.log
cat $D/rc.txt
