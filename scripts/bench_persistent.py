"""The TMA forward's persistent tile order against one CTA per tile, and the table, side by side.

FwdConfig.persistent launches one wave of CTAs that walk all tiles (kernels/persistent_scheduler.py):
the producer loads a tile's first K/V block under the previous tile's epilogue, and no CTA pays a
launch, mbarrier inits and a cold pipeline per tile. Q_RING_CONFIGS add a second Q slot (q_stages=2),
each timed next to the same tile with one slot and with one CTA per tile. Each group times, on the seed problems of its
(head dim, mask), the table's entries and the spill-free persistent configs (PERSISTENT_CONFIGS),
each next to the same config without persistence, in one prepare.py run (occupancy verified at every
compile, every candidate gated against fp32):

  FLASH_ATTN_SM120_EMULATE=1 python scripts/bench_persistent.py --reps 10 --no-ceiling --json out.json
  ... --buckets 64,96   only the groups of those head-dim buckets

The block-sparse side is `scripts/bench_block_sparse.py --sparse-configs NAME,...`.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_configs import group_candidates, run_seed_groups  # noqa: E402

from flash_attn_sm120.config import FwdConfig  # noqa: E402
from flash_attn_sm120.kernels.fwd_tma_proposals import PERSISTENT_CONFIGS, Q_RING_CONFIGS  # noqa: E402


def groups() -> dict:
    """(bucket, mask) -> the persistent configs and their one-tile-per-CTA twins."""
    out: dict = {}
    for d, c, masks, _ in PERSISTENT_CONFIGS:
        for mask in masks:
            cfg = FwdConfig(*c, family="tma")
            out.setdefault((d, mask), []).extend([cfg, replace(cfg, persistent=True)])
    for d, c, masks, _ in Q_RING_CONFIGS:  # two Q slots, next to one slot and to one CTA per tile
        for mask in masks:
            cfg = FwdConfig(*c, family="tma")
            out.setdefault((d, mask), []).extend(
                [cfg, replace(cfg, persistent=True), replace(cfg, persistent=True, q_stages=2)])
    return out


def candidates(info, buckets=None) -> list:
    return group_candidates(info, {k: v for k, v in groups().items() if not buckets or k[0] in buckets})


if __name__ == "__main__":
    argv = sys.argv[1:]
    buckets = None
    if "--buckets" in argv:  # e.g. --buckets 64,96: only those head-dim groups
        i = argv.index("--buckets")
        buckets = {int(x) for x in argv[i + 1].split(",")}
        del argv[i:i + 2]
    run_seed_groups(lambda info: candidates(info, buckets), argv, __doc__)
