#!/bin/bash
# session 29, window 10: racecheck + memcheck of d128 on 4 warps with V across sQ and sdO (a table whose d128
# entries are that tile), on an MHA shape whose epilogue stages dV over V's view
D=$OUT/w10; mkdir -p $D; cp .gpu/b/w10.sh .gpu/b/two_cta_table.toml $D/
FLASH_ATTN_SM120_BWD_TABLE=.gpu/b/two_cta_table.toml timeout 280 python3 scripts/sanitize.py --tools racecheck,memcheck \
  --shapes bwd-d128-det-none --timeout 130 --log-dir $D/san > $D/san.log 2>&1; echo "sanitize rc=$?" >> $D/rc.txt
tail -8 $D/san.log; cat $D/rc.txt
