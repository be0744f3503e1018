#!/bin/bash
# session 32, window 29: GPU tests of the plain and varlen backward cases (the table's choice for cu_seqlens calls), then
# compute-sanitizer memcheck + racecheck on a varlen GQA causal d128 call (the plain_only entry)
D=$OUT/w29; mkdir -p $D; cp .gpu/b/w29.sh $D/script.sh
timeout 330 python3 -m pytest -m gpu -n 8 -q -p no:cacheprovider tests/test_bwd_gpu.py -k "table or plain or varlen" > $D/tests.log 2>&1
echo "tests rc=$?" >> $D/rc.txt; tail -4 $D/tests.log
timeout 200 python3 scripts/sanitize.py --shapes bwd-d128-causal-gqa-varlen --timeout 120 --log-dir $D/san > $D/sanitize.log 2>&1
echo "sanitize rc=$?" >> $D/rc.txt; tail -8 $D/sanitize.log; cat $D/rc.txt
