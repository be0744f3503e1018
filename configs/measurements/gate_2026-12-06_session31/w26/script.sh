#!/bin/bash
# session 31, window 26: the table with the d128 causal plain_only entry (8w 32x128, V in registers): GPU tests of
# the table's configs and the plain GQA features, then compute-sanitizer on a causal GQA d128 call
D=$OUT/w26; mkdir -p $D; cp .gpu/b/w26.sh $D/script.sh
timeout 300 python3 -m pytest -m gpu -n 8 -q -p no:cacheprovider tests/test_bwd_gpu.py -k "table or plain" > $D/tests.log 2>&1
echo "tests rc=$?" >> $D/rc.txt; tail -4 $D/tests.log
timeout 250 python3 scripts/sanitize.py --shapes bwd-d128-causal-gqa --timeout 120 --log-dir $D/san > $D/sanitize.log 2>&1
echo "sanitize rc=$?" >> $D/rc.txt; tail -8 $D/sanitize.log; cat $D/rc.txt
