#!/bin/bash
# session 29, window 9: racecheck on a V-in-registers backward (d96: V's copy across sQ and sdO), then the
# backward and deterministic cases of the fast fuzz profile
D=$OUT/w9; mkdir -p $D; cp .gpu/b/w9.sh $D/script.sh
timeout 260 python3 scripts/sanitize.py --tools racecheck --shapes bwd-d96-none --timeout 240 \
  --log-dir $D/race_d96 > $D/race_d96.log 2>&1; echo "race d96 rc=$?" >> $D/rc.txt
tail -5 $D/race_d96.log
FLASH_ATTN_SM120_FUZZ=fast timeout 200 python3 -m pytest -m gpu -n 10 -q -p no:cacheprovider -k "bwd or det" \
  tests/test_fuzz_gpu.py > $D/fuzz_fast.log 2>&1; echo "fuzz rc=$?" >> $D/rc.txt
grep -E "FAILED|passed|failed" $D/fuzz_fast.log | tail -6; cat $D/rc.txt
