"""Per-path fuzz counts: recorded by tests/test_fuzz_gpu.py, printed at the end of the session.

tests/conftest.py imports the two hooks below. The summary lists, per kernel path, the static
cases (compile keys) run and the forward / backward examples that passed and failed, with the
profile, seed and shard needed to replay the run. With FLASH_ATTN_SM120_FUZZ_REPORT=<path> the
same numbers are also written there as JSON (e.g. $OUT/fuzz_summary.json on the GPU machine).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict

REPORT_ENV = "FLASH_ATTN_SM120_FUZZ_REPORT"

# path -> counter -> int; counters: cases, fwd_pass, fwd_fail, bwd_pass, bwd_fail, compiles
COUNTS: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
CASES_SEEN: set = set()
RUN_INFO: dict = {}


def record_case(path: str, case_id: str) -> None:
    if case_id not in CASES_SEEN:
        CASES_SEEN.add(case_id)
        COUNTS[path]["cases"] += 1


def record_example(path: str, kind: str, passed: bool) -> None:
    COUNTS[path][f"{kind}_{'pass' if passed else 'fail'}"] += 1


def record_compiles(path: str, n: int) -> None:
    COUNTS[path]["compiles"] += n


def summary_lines() -> list[str]:
    cols = ("cases", "compiles", "fwd_pass", "fwd_fail", "bwd_pass", "bwd_fail")
    width = max([len("path")] + [len(p) for p in COUNTS])
    lines = [f"{'path':<{width}}  " + "  ".join(f"{c:>8}" for c in cols)]
    total = defaultdict(int)
    for path in sorted(COUNTS):
        row = COUNTS[path]
        lines.append(f"{path:<{width}}  " + "  ".join(f"{row.get(c, 0):>8}" for c in cols))
        for c in cols:
            total[c] += row.get(c, 0)
    lines.append(f"{'TOTAL':<{width}}  " + "  ".join(f"{total[c]:>8}" for c in cols))
    return lines


def write_json(path: str) -> None:
    data = {"run": RUN_INFO, "paths": {p: dict(c) for p, c in COUNTS.items()}}
    with open(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)


def pytest_report_header(config):
    try:
        import fuzz_profiles
    except ImportError:
        return None
    i, n = fuzz_profiles.shard()
    return (f"flash_attn_sm120 fuzz: profile={fuzz_profiles.active_profile()} seed={fuzz_profiles.FUZZ_SEED}"
            f" shard={i}/{n} (replay: FLASH_ATTN_SM120_FUZZ_SEED={fuzz_profiles.FUZZ_SEED})")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not COUNTS:
        return
    tr = terminalreporter
    tr.section("flash_attn_sm120 fuzz: examples per kernel path")
    info = " ".join(f"{k}={v}" for k, v in sorted(RUN_INFO.items()))
    tr.write_line(info)
    for line in summary_lines():
        tr.write_line(line)
    target = os.environ.get(REPORT_ENV)
    if target:
        write_json(target)
        tr.write_line(f"written to {target}")
