# session 23 w2: two-slot Q ring on the dense seed problems, next to one slot and the table
mkdir -p $OUT/w2
timeout 560 python scripts/bench_configs.py --group 64:causal=tma-w8-256x64-s2-pers-q2,tma-w8-256x64-s2-pers,tma-w8-128x64-s3-pers-q2,tma-w4-128x48-s1-pers-q2 --group 64:none=tma-w8-256x64-s2-pers-q2,tma-w4-128x48-s1-pers-q2 --group 96:causal=tma-w8-128x64-s2-pers-q2,tma-w8-128x64-s2-pers --group 128:causal=tma-w8-128x64-s1-pers-q2,tma-w8-128x64-s1-pers --reps 10 --no-ceiling --json $OUT/w2/dense_q2.json > $OUT/w2/dense_q2.log 2>&1
tail -40 $OUT/w2/dense_q2.log
