#!/bin/bash
# The backward's GPU checks and timing in two bounded commands, for a lent GPU with a time limit.
#   STEP=tests: the backward GPU test files (-n $JOBS), fuzz draws ($FUZZ_PROFILE, -k $FUZZ_K) and compute-sanitizer
#               (memcheck, racecheck) on $SAN_SHAPES, concurrently; logs in $OUT/r, packed as $OUT/tests.tgz
#   STEP=time:  prepare.py --set bwd (the table, deterministic, upstream's SM120 backward, $PREPARE_ARGS) alone,
#               so that nothing else shares the GPU; JSON and log in $OUT
#   source .gpu/b/env.sh && OUT=$OUT STEP=tests bash scripts/gpu_bwd_gate.sh
set -u
OUT=${OUT:-./gpu_bwd_out}
STEP=${STEP:-tests}
JOBS=${JOBS:-8}
BUDGET=${BUDGET:-540}
SAN_SHAPES=${SAN_SHAPES:-bwd-d64-causal-gqa,bwd-d128-det-causal-gqa}
TEST_FILES=${TEST_FILES:-tests/test_bwd_gpu.py tests/test_bwd_deterministic_gpu.py tests/test_mods_bwd_gpu.py tests/test_block_sparse_gpu.py}
FUZZ_PROFILE=${FUZZ_PROFILE:-fast}
FUZZ_K=${FUZZ_K:-bwd0 or det0}
NAME=${NAME:-bwd_table}
PREPARE_ARGS=${PREPARE_ARGS:-}
R=$OUT/r
mkdir -p "$R"
if ! python3 -c "import torch; assert torch.cuda.get_device_capability()[0] == 12" 2>/dev/null; then
  export FLASH_ATTN_SM120_EMULATE=1  # a non-SM120 GPU runs the SM120 kernels in emulation
fi
export FLASH_ATTN_SM120_PROGRESS=0
git rev-parse HEAD > "$R/commit.txt" 2>/dev/null || true
nvidia-smi -L > "$R/gpu.txt" 2>&1
case "$STEP" in
  tests)
    timeout $BUDGET python3 -m pytest -q -m gpu -n "$JOBS" $TEST_FILES > "$R/tests.log" 2>&1 &
    FLASH_ATTN_SM120_FUZZ=$FUZZ_PROFILE timeout $BUDGET python3 -m pytest -q -m gpu -n 2 tests/test_fuzz_gpu.py \
      -k "$FUZZ_K" > "$R/fuzz.log" 2>&1 &
    timeout $BUDGET python3 scripts/sanitize.py --shapes "$SAN_SHAPES" --log-dir "$R/sanitize" > "$R/sanitize.log" 2>&1 &
    wait
    tar czf "$OUT/tests.tgz" -C "$OUT" r
    for f in tests fuzz sanitize; do echo "== $f"; tail -4 "$R/$f.log"; done
    ;;
  time)
    timeout $BUDGET python3 scripts/prepare.py --set bwd --emulate --reps 10 --references upstream_sm120 \
      --json "$OUT/$NAME.json" $PREPARE_ARGS > "$OUT/$NAME.log" 2>&1
    tail -30 "$OUT/$NAME.log"
    ;;
esac
