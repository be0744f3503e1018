#!/bin/bash
# The forward's GPU checks and timing (scripts/gpu_gate.sh with the forward's defaults).
#   STEP=tests: the varlen TMA, forward and window GPU test files, deep fuzz draws with varlen layouts, sanitizer on
#               two shapes of three TMA paths
#   STEP=time:  prepare.py --set $SET (default real) with upstream's SM120 kernel and the table's cp.async entries
#   source .gpu/b/env.sh && OUT=$OUT STEP=tests bash scripts/gpu_fwd_gate.sh
export OUT=${OUT:-./gpu_fwd_out}
export SAN_SHAPES=${SAN_SHAPES:-varlen-local-softcap,dense-causal-gqa}
export SAN_PATHS=${SAN_PATHS:-tma-w8-128x64-s2,table-d64-causal,table-d128-none}
export TEST_FILES=${TEST_FILES:-tests/test_fwd_tma_varlen_gpu.py tests/test_fwd_gpu.py tests/test_windows_gpu.py}
export FUZZ_PROFILE=${FUZZ_PROFILE:-deep} FUZZ_K=${FUZZ_K:-fwd and packed} FUZZ_JOBS=${FUZZ_JOBS:-4}
export SET=${SET:-real} REFS=${REFS:-upstream_sm120,sm120_cpasync_table} NAME=${NAME:-fwd_real} TAIL=${TAIL:-40}
exec bash "$(dirname "$0")/gpu_gate.sh"
