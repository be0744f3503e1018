# session 23 w6: block-sparse backward kernel times (forward + backward captured in CUDA graphs, the forward's graph subtracted)
mkdir -p $OUT/w6
timeout 330 python scripts/bench_block_sparse.py --bwd --graph --reps 5 --bwd-configs bwd-w8-32x128-q1do1-a282 --json $OUT/w6/bs_bwd_graph.json > $OUT/w6/bs_bwd_graph.log 2>&1; echo rc=$? >> $OUT/w6/bs_bwd_graph.log
grep -v "^\s*$" $OUT/w6/bs_bwd_graph.log | tail -24
