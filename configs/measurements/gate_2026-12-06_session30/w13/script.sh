#!/bin/bash
# session 30, window 13: the table's GPU tests (the plain-MHA d128 causal entry on the dispatcher's own choice,
# bf16 and fp16, and every table entry) against fp32 autograd
D=$OUT/w13; mkdir -p $D; cp .gpu/b/w13.sh $D/script.sh
timeout 330 python3 -m pytest -m gpu -n 10 -q -p no:cacheprovider tests/test_bwd_gpu.py -k "table or plain-mha" > $D/tests.log 2>&1
echo "tests rc=$?" >> $D/rc.txt
grep -E "FAILED|Error|passed|failed" $D/tests.log | tail -12; cat $D/rc.txt
