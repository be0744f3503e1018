#!/bin/bash
# session 30, window 17: racecheck + memcheck of the d64 causal entry (4 warps, V in registers) on GQA
D=$OUT/w17; mkdir -p $D; cp .gpu/b/w17.sh $D/script.sh
timeout 400 python3 scripts/sanitize.py --tools racecheck,memcheck --shapes bwd-d64-causal-gqa --timeout 180 \
  --log-dir $D/san > $D/san.log 2>&1; echo "sanitize rc=$?" >> $D/rc.txt
tail -8 $D/san.log; cat $D/rc.txt
