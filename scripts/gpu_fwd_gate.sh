#!/bin/bash
# The forward's GPU checks and timing in two bounded commands, for a lent GPU with a time limit (the
# forward's twin of scripts/gpu_bwd_gate.sh).
#   STEP=tests: forward GPU test files (-n $JOBS), fuzz draws ($FUZZ_PROFILE, -k $FUZZ_K) and compute-sanitizer
#               (memcheck, racecheck) on $SAN_SHAPES of the $SAN_PATHS paths, concurrently; logs in $OUT/r,
#               packed as $OUT/tests.tgz
#   STEP=time:  prepare.py --set $SET --emulate with $REFS (and $PREPARE_ARGS) alone, so that nothing else
#               shares the GPU; JSON and log in $OUT
#   source .gpu/b/env.sh && OUT=$OUT STEP=tests bash scripts/gpu_fwd_gate.sh
set -u
OUT=${OUT:-./gpu_fwd_out}
STEP=${STEP:-tests}
JOBS=${JOBS:-8}
BUDGET=${BUDGET:-540}
SAN_SHAPES=${SAN_SHAPES:-varlen-local-softcap,dense-causal-gqa}
SAN_PATHS=${SAN_PATHS:-tma-w8-128x64-s2,table-d64-causal,table-d128-none}
TEST_FILES=${TEST_FILES:-tests/test_fwd_tma_varlen_gpu.py tests/test_fwd_gpu.py tests/test_windows_gpu.py}
FUZZ_PROFILE=${FUZZ_PROFILE:-deep}
FUZZ_K=${FUZZ_K:-fwd and packed}
SET=${SET:-real}
REFS=${REFS:-upstream_sm120,sm120_cpasync_table}
NAME=${NAME:-fwd_real}
PREPARE_ARGS=${PREPARE_ARGS:-}
R=$OUT/r
mkdir -p "$R"
if ! python3 -c "import torch; assert torch.cuda.get_device_capability()[0] == 12" 2>/dev/null; then
  export FLASH_ATTN_SM120_EMULATE=1  # a non-SM120 GPU runs the SM120 kernels in emulation
fi
export FLASH_ATTN_SM120_PROGRESS=0
nvidia-smi -L > "$R/gpu.txt" 2>&1
case "$STEP" in
  tests)
    timeout $BUDGET python3 -m pytest -q -m gpu -n "$JOBS" $TEST_FILES > "$R/tests.log" 2>&1 &
    FLASH_ATTN_SM120_FUZZ=$FUZZ_PROFILE timeout $BUDGET python3 -m pytest -q -m gpu -n 4 tests/test_fuzz_gpu.py \
      -k "$FUZZ_K" > "$R/fuzz.log" 2>&1 &
    timeout $BUDGET python3 scripts/sanitize.py --paths "$SAN_PATHS" --shapes "$SAN_SHAPES" \
      --log-dir "$R/sanitize" > "$R/sanitize.log" 2>&1 &
    wait
    tar czf "$OUT/tests.tgz" -C "$OUT" r
    for f in tests fuzz sanitize; do echo "== $f"; tail -5 "$R/$f.log"; done
    ;;
  time)
    timeout $BUDGET python3 scripts/prepare.py --set "$SET" --emulate --references "$REFS" \
      --json "$OUT/$NAME.json" $PREPARE_ARGS > "$OUT/$NAME.log" 2>&1
    tail -40 "$OUT/$NAME.log"
    ;;
esac
