#!/bin/bash
# session 25, window 1: fixed-point deterministic dQ (issue 16): timing vs the turn order it replaces
D=$OUT/w1; mkdir -p $D; cp .gpu/b/w1.sh $D/script.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $D/gpu.txt 2>&1
timeout 330 python3 scripts/prepare.py --set bwd --emulate --reps 10 --no-ceiling --references upstream_sm120 \
  --det-variants det_fused --json $D/bwd_fixed_point.json > $D/prepare.log 2>&1; echo "prepare rc=$?" >> $D/rc.txt
timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_fwd_tma_persistent_gpu.py -k graph \
  > $D/persistent_graph.log 2>&1; echo "graph rc=$?" >> $D/rc.txt
grep -E "geomean|verified|det" $D/prepare.log | tail -30; tail -3 $D/persistent_graph.log; cat $D/rc.txt
