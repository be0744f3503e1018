"""Ping-pong consumers against the cooperative 8-warp TMA kernel, and the table's entries, side by side.

Issue 18's ping-pong experiment: the TMA family's two MMA warpgroups either run together
(cooperative, the shipped kernel) or take turns at the tensor pipe under named barriers
(FwdConfig.pingpong, FA3's scheduler barrier), so one warpgroup's softmax runs under the other's
mma.sync. Each group below times, on the seed problems of its (head dim, mask), the table's entries,
8-warp TMA configs with and without ping-pong, and the causal d128 256x64 lead, in one prepare.py
run with occupancy verified at every compile and every candidate gated against fp32:

  FLASH_ATTN_SM120_EMULATE=1 python scripts/bench_pingpong.py --json out.json
  FLASH_ATTN_SM120_EMULATE=1 python scripts/bench_pingpong.py --wide --subset h32d64 --json wide.json  # WIDE groups
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_configs import group_candidates, run_seed_groups  # noqa: E402

from flash_attn_sm120.config import FwdConfig  # noqa: E402


def _tma(m, n, s, qreg=False, pingpong=False):
    return FwdConfig(256, m, n, s, qreg, family="tma", pingpong=pingpong)


def _both(m, n, s, qreg=False):
    return [_tma(m, n, s, qreg), _tma(m, n, s, qreg, True)]


# (bucket, mask) -> configs besides the table's own entries
GROUPS = {
    (128, "none"): _both(256, 48, 1) + _both(128, 64, 2) + _both(128, 48, 2) + [_tma(128, 64, 2, True, True)],
    (128, "causal"): _both(256, 64, 1) + _both(256, 48, 1) + _both(128, 64, 2, True) + _both(128, 64, 2),
    (96, "none"): _both(128, 64, 2, True) + _both(128, 64, 3, True) + _both(256, 32, 2) + _both(128, 96, 2, True),
    (96, "causal"): _both(256, 64, 2) + _both(128, 64, 2, True) + _both(128, 64, 3, True),
    (64, "none"): _both(128, 128, 2, True) + _both(128, 128, 2) + _both(256, 64, 2) + _both(128, 64, 3, True)
    + _both(256, 128, 1),
    (64, "causal"): _both(256, 64, 3, True) + _both(128, 128, 2, True) + _both(128, 64, 3, True),
}


# --wide: 32-row-warp (256-row) TMA tiles for the non-causal d64/d96 gap (spill-free on sm_120a)
WIDE = {
    (96, "none"): [_tma(256, 64, 2), _tma(256, 64, 2, pingpong=True), _tma(256, 64, 1), _tma(256, 48, 2)],
    (64, "none"): [_tma(256, 64, 3), _tma(256, 80, 2), _tma(256, 64, 3, True)],
}


def candidates(info, groups=None) -> list:
    return group_candidates(info, groups or GROUPS)


if __name__ == "__main__":
    argv = sys.argv[1:]
    groups = GROUPS
    if "--wide" in argv:
        argv.remove("--wide")
        groups = WIDE
    run_seed_groups(lambda info: candidates(info, groups), argv, __doc__)
