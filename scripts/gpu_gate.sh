#!/bin/bash
# GPU checks and timing in two bounded commands, for a lent GPU with a time limit. Run through
# scripts/gpu_fwd_gate.sh or scripts/gpu_bwd_gate.sh, which set the defaults of each direction.
#   STEP=tests: GPU test files $TEST_FILES (-n $JOBS), fuzz draws ($FUZZ_PROFILE, -k $FUZZ_K, -n $FUZZ_JOBS) and
#               compute-sanitizer (memcheck, racecheck) on $SAN_SHAPES ($SAN_PATHS when set, else every path),
#               concurrently; logs in $OUT/r, packed as $OUT/tests.tgz
#   STEP=time:  prepare.py --set $SET --emulate --references $REFS $TIME_ARGS $PREPARE_ARGS alone, so that nothing
#               else shares the GPU; JSON and log in $OUT
set -u
: "${SET:?} ${REFS:?} ${NAME:?} ${TEST_FILES:?} ${SAN_SHAPES:?} ${FUZZ_K:?}"
OUT=${OUT:-./gpu_out}
STEP=${STEP:-tests}
JOBS=${JOBS:-8}
FUZZ_JOBS=${FUZZ_JOBS:-2}
BUDGET=${BUDGET:-540}
FUZZ_PROFILE=${FUZZ_PROFILE:-fast}
SAN_PATHS=${SAN_PATHS:-}
TIME_ARGS=${TIME_ARGS:-}
PREPARE_ARGS=${PREPARE_ARGS:-}
TAIL=${TAIL:-30}
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
    FLASH_ATTN_SM120_FUZZ=$FUZZ_PROFILE timeout $BUDGET python3 -m pytest -q -m gpu -n "$FUZZ_JOBS" \
      tests/test_fuzz_gpu.py -k "$FUZZ_K" > "$R/fuzz.log" 2>&1 &
    timeout $BUDGET python3 scripts/sanitize.py ${SAN_PATHS:+--paths "$SAN_PATHS"} --shapes "$SAN_SHAPES" \
      --log-dir "$R/sanitize" > "$R/sanitize.log" 2>&1 &
    wait
    tar czf "$OUT/tests.tgz" -C "$OUT" r
    for f in tests fuzz sanitize; do echo "== $f"; tail -5 "$R/$f.log"; done
    ;;
  time)
    timeout $BUDGET python3 scripts/prepare.py --set "$SET" --emulate --references "$REFS" $TIME_ARGS \
      --json "$OUT/$NAME.json" $PREPARE_ARGS > "$OUT/$NAME.log" 2>&1
    tail -"$TAIL" "$OUT/$NAME.log"
    ;;
esac
