"""Re-time the config-search finalists whose ranking the emulation occupancy fix can change.

Before 2026-12-01 the emulation padding assumed 1 KB of static shared memory on the host, where the
H200's driver counts 0 B: 4-warp cp.async kernels that SM120 holds at 1 CTA/SM ran 2 CTAs/SM in
emulation (issue: verified emulation occupancy). 8-warp and TMA kernels were held at 1 CTA/SM by
registers and are unaffected. This script times, side by side in one prepare.py run with occupancy
verified, the finalists of every group where such a kernel was the entry, the runner-up or the
reference (configs/measurements/search*/times.jsonl, final rounds), next to the group's shipped
entries (TMA included) on the bucket's seed problems:

  FLASH_ATTN_SM120_EMULATE=1 python scripts/retime_finalists.py --json out.json
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import prepare  # noqa: E402

from flash_attn_sm120.config import FwdConfig  # noqa: E402


def _cp(m, n, s, qreg=False, threads=128):
    return FwdConfig(threads, m, n, s, qreg)


def _tma(m, n, s, qreg=False):
    return FwdConfig(256, m, n, s, qreg, family="tma")


# (bucket, mask) -> configs: the search's final-round cp.async configs (4 warps, 1 CTA/SM targets first),
# the 2-CTA/SM cp.async runners-up they competed with, and the TMA entries / leads of the table
GROUPS = {
    (128, "none"): [_cp(128, 48, 2), _cp(128, 32, 2), _cp(128, 32, 3), _cp(64, 96, 1, True), _cp(64, 64, 1, True),
                    _tma(256, 48, 1)],
    (128, "causal"): [_cp(64, 64, 1, True), _cp(64, 96, 1, True), _tma(128, 64, 2, True), _tma(256, 64, 1),
                      _tma(256, 32, 2)],
    (96, "causal"): [_cp(64, 96, 1, True), _cp(64, 64, 1, True), _cp(64, 64, 2), _tma(256, 64, 2)],
}


def candidates(info) -> list:
    impls = []
    for (bucket, mask), configs in GROUPS.items():
        for cfg in configs:
            impl = prepare.sm120_impl(f"{bucket}-{mask}-{cfg.name}", lambda p, cfg=cfg: cfg, info)
            impl.supports = lambda p, b=bucket, m=mask: p.head_dim == b and p.causal == (m == "causal")
            impls.append(impl)
    return impls


if __name__ == "__main__":
    argv = sys.argv[1:]
    if "--set" not in argv:
        argv = ["--set", "seed", "--references", "upstream_sm120,sm120_cpasync_table"] + argv
    prepare.run(candidates, argv, description=__doc__)
