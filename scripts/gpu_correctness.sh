#!/bin/bash
# The whole GPU correctness gate in one bounded command, for a lent GPU machine with a time limit:
#   1. the hypothesis fuzz suite (profile $PROFILE, default deep) in $SHARDS shards run concurrently,
#   2. every other GPU test file in $SHARDS chunks, concurrently with (1),
#   3. compute-sanitizer (scripts/sanitize.py) in $SAN_GROUPS groups of registry paths, concurrently
#      with (1) and (2) from the start (run after the tests, the cp.async and SplitKV families did not
#      fit in a 560 s budget).
# One GPU is enough: compiles are CPU-bound, so concurrent processes overlap them. Everything stays
# within $BUDGET seconds (default 560) and lands in $OUT (default ./gpu_correctness_out) with
# $OUT/res.tgz holding it all (for tools that bring back only a few files). A progress bar over all
# collected tests (scripts/gate_progress.py) goes to stderr and $OUT/r/progress.txt.
#
#   source .gpu/b/env.sh && OUT=$OUT bash scripts/gpu_correctness.sh
#   PROFILE=fast SHARDS=4 BUDGET=300 bash scripts/gpu_correctness.sh
set -u
OUT=${OUT:-./gpu_correctness_out}
PROFILE=${PROFILE:-deep}
SHARDS=${SHARDS:-6}
BUDGET=${BUDGET:-560}
R=$OUT/r
mkdir -p "$R"
t0=$(date +%s)
elapsed() { echo $(( $(date +%s) - t0 )); }
pack() { tar czf "$OUT/res.tgz" -C "$OUT" r; }
if ! python3 -c "import torch; assert torch.cuda.get_device_capability()[0] == 12" 2>/dev/null; then
  export FLASH_ATTN_SM120_EMULATE=1  # a non-SM120 GPU runs the SM120 kernels in emulation
fi
export FLASH_ATTN_SM120_WATCHDOG_S=${FLASH_ATTN_SM120_WATCHDOG_S:-300}
tests_budget=$(( BUDGET - 25 ))
SAN_GROUPS=${SAN_GROUPS:-"tma-w8-128x64-s2,table-d64-causal,table-d96-causal,table-d128-causal
splitkv-w4-64x64,cpasync-table,cpasync-w8-128x96-s1,cpasync-w4-64x64-s2
cpasync-w4-64x32-s3,upstream-config,table-d64-causal-cpasync,table-d64-none
table-d96-causal-cpasync,table-d96-none,table-d128-causal-cpasync,table-d128-none,table-d256-causal"}
g=0
while read -r group; do
  [ -z "$group" ] && continue
  ( timeout $(( BUDGET - 20 )) python3 scripts/sanitize.py --paths "$group" --log-dir "$R/sanitize_$g" --timeout $(( BUDGET - 40 )) \
      > "$R/sanitize_$g.log" 2>&1; echo "sanitize group $g exit $? after $(elapsed) s" >> "$R/times.txt" ) &
  g=$(( g + 1 ))
done <<< "$SAN_GROUPS"

last=$(( SHARDS - 1 ))
for i in $(seq 0 $last); do
  FLASH_ATTN_SM120_CACHE_DIR=/tmp/fa_sm120_fuzz$i FLASH_ATTN_SM120_FUZZ=$PROFILE FLASH_ATTN_SM120_FUZZ_SHARD=$i/$SHARDS \
  FLASH_ATTN_SM120_FUZZ_REPORT=$R/fuzz_$i.json timeout $tests_budget python3 -m pytest -q -p no:cacheprovider \
    tests/test_fuzz_gpu.py > "$R/fuzz_$i.log" 2>&1 &
done
python3 -m pytest --collect-only -q -m gpu tests --ignore=tests/test_fuzz_gpu.py 2>/dev/null | grep '::' > "$R/gpu_test_ids.txt"
# the bar's total: the GPU test ids now, plus each fuzz shard's own collection (its profile and shard) when
# that lands; collected in the background, so the shards start at once
n_tests=$(wc -l < "$R/gpu_test_ids.txt")
( total=$n_tests
  for i in $(seq 0 $last); do
    n=$(FLASH_ATTN_SM120_FUZZ=$PROFILE FLASH_ATTN_SM120_FUZZ_SHARD=$i/$SHARDS \
        python3 -m pytest --collect-only -q -p no:cacheprovider tests/test_fuzz_gpu.py 2>/dev/null | grep -c '::')
    total=$(( total + n ))
  done
  echo $total > "$R/total.txt" ) &
python3 scripts/gate_progress.py --logs "$R" --total "$n_tests" --total-file "$R/total.txt" \
  --done "$R/done" 2> >(tee "$R/progress.txt" >&2) &
progress_pid=$!
rm -f /tmp/fa_sm120_ids_*
split -n r/$SHARDS -d "$R/gpu_test_ids.txt" /tmp/fa_sm120_ids_
for f in /tmp/fa_sm120_ids_*; do
  FLASH_ATTN_SM120_CACHE_DIR=/tmp/fa_sm120_cache_$(basename "$f") timeout $tests_budget \
    python3 -m pytest -q -p no:cacheprovider $(cat "$f") > "$R/tests_$(basename "$f").log" 2>&1 &
done
wait_tests() { for p in $(jobs -p); do [ "$p" = "$progress_pid" ] || wait "$p"; done; }
wait_tests
touch "$R/done"; wait "$progress_pid"
echo "tests and sanitizer done after $(elapsed) s" >> "$R/times.txt"
{ for f in "$R"/fuzz_*.log "$R"/tests_*.log; do echo "$(basename "$f"): $(tail -n 1 "$f")"; done
  grep -h "^FAILED" "$R"/*.log; for f in "$R"/sanitize_*.log; do tail -n 12 "$f"; done; } > "$R/summary.txt"
cat "$R/summary.txt"
pack
