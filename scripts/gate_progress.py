#!/usr/bin/env python3
"""Progress of the GPU gate (scripts/gpu_correctness.sh): one bar over every test its pytest shards run.

The gate runs pytest in many concurrent shards, each writing `pytest -q` output to a log. This
counts the result characters of those logs' progress lines (". F E s x X", one per finished test)
against the number of collected tests, and redraws a bar until the file --done appears.

  python3 scripts/gate_progress.py --logs OUT/r --total 412 [--total-file OUT/r/total.txt] --done OUT/r/done
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flash_attn_sm120 import progress  # noqa: E402

PROGRESS_LINE = re.compile(r"^([.FEsxX]+)\s*(\[\s*\d+%\])?\s*$")


def finished_tests(log_dir: Path, pattern: str = "*.log") -> tuple[int, int]:
    """(finished, failed) over the pytest -q logs in log_dir."""
    done = failed = 0
    for log in log_dir.glob(pattern):
        try:
            text = log.read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            m = PROGRESS_LINE.match(line)
            if m:
                done += len(m.group(1))
                failed += m.group(1).count("F") + m.group(1).count("E")
    return done, failed


def read_total(path: Optional[Path]) -> Optional[int]:
    """The exact total once the background collection wrote it, else None."""
    try:
        return int(path.read_text().strip()) if path is not None else None
    except (OSError, ValueError):
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--logs", type=Path, required=True, help="directory of the shards' pytest -q logs")
    ap.add_argument("--total", type=int, required=True, help="number of tests collected over all shards (a first estimate)")
    ap.add_argument("--total-file", type=Path, default=None,
                    help="a file that will hold the exact total (read again on every scan once it exists)")
    ap.add_argument("--done", type=Path, required=True, help="stop once this file exists")
    ap.add_argument("--every", type=float, default=5.0, help="seconds between log scans")
    args = ap.parse_args(argv)
    bar = progress.bar(total=args.total, desc="GPU gate", unit="test")
    while True:
        total = read_total(args.total_file)
        if total and total != bar.total:
            bar.total = total
        n, failed = finished_tests(args.logs)
        bar.n = min(n, bar.total)
        bar.set_postfix(failed=failed, refresh=False)
        bar.refresh()
        if args.done.exists():
            break
        time.sleep(args.every)
    bar.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
