#!/bin/bash
# session 37, one call: w45a (tests, fuzz det028, sanitizer on the d96 turns entries), w45b (seed det gate),
# w45c (rounds 16/17) in priority order; each step has its own timeout and writes under $OUT as it goes
cp .gpu/b/w46.sh $OUT/script_w46.sh
bash .gpu/b/w45a.sh
bash .gpu/b/w45b.sh
bash .gpu/b/w45c.sh
