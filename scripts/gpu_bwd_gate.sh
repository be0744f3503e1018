#!/bin/bash
# The backward's GPU checks and timing (scripts/gpu_gate.sh with the backward's defaults).
#   STEP=tests: the backward GPU test files, fast fuzz draws of the backward, sanitizer on two backward shapes
#   STEP=time:  prepare.py --set bwd (the table, deterministic, upstream's SM120 backward, $PREPARE_ARGS), reps 10
#   source .gpu/b/env.sh && OUT=$OUT STEP=tests bash scripts/gpu_bwd_gate.sh
export OUT=${OUT:-./gpu_bwd_out}
export SAN_SHAPES=${SAN_SHAPES:-bwd-d64-causal-gqa,bwd-d128-det-causal-gqa}
export TEST_FILES=${TEST_FILES:-tests/test_bwd_gpu.py tests/test_bwd_deterministic_gpu.py tests/test_mods_bwd_gpu.py tests/test_block_sparse_gpu.py}
export FUZZ_K=${FUZZ_K:-bwd0 or det0}
export NAME=${NAME:-bwd_table}
export SET=bwd REFS=${REFS:-upstream_sm120} TIME_ARGS=${TIME_ARGS:---reps 10}
exec bash "$(dirname "$0")/gpu_gate.sh"
