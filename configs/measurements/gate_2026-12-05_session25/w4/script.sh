bench_block_sparse --bwd --deterministic --graph --head-dims 128 --reps 5; bwd_kernel_times --det-variants det_fixed_point --problems b4s2048h32d64-causal
