#!/bin/bash
# session 38, call C: the compiled-backward layout test after its fix (flash_attn_func returns (out, lse))
D=$OUT/w48c; mkdir -p $D; cp .gpu/b/w48c.sh $D/script.sh
finish() { tar czf $OUT/w48c.tgz -C $OUT w48c; }
trap finish EXIT
timeout 150 python3 -m pytest -m gpu -n 4 -q -p no:cacheprovider tests/test_api_parity_gpu.py > $D/tests_parity.log 2>&1
echo "tests parity rc=$?" >> $D/rc.txt; grep -E "FAILED|passed|failed|^E " $D/tests_parity.log | cut -c1-250 | tail -8
cat $D/rc.txt
