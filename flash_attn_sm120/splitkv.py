"""How many KV splits a forward gets: a pure function of the grid, the GPU and the KV length.

SplitKV cuts each (m_block, head, batch) tile's key blocks into `num_splits` contiguous ranges
that run as separate CTAs and are merged by the combine kernel. It pays when the unsplit grid
cannot fill the GPU: decode (seqlen_q 1..16 with the GQA group packed into one M tile) has only
batch x nheads_kv tiles, e.g. 8 CTAs for one sequence with 8 KV heads on a 188-SM RTX PRO 6000.

`num_splits` keeps upstream FA4's meaning:
  * 1: no split;
  * n > 1: n splits, clamped to `useful_max_splits` (see `clamp_num_splits`);
  * 0 or less: chosen by `choose_num_splits`.

The chooser counts CTA slots = SMs x CTAs per SM (from hardware.py's SM120 occupancy model for
the chosen config; the SM count is the GPU's own, so in emulation it is the host's) and picks
the fewest splits whose wave efficiency (CTAs / (waves x slots)) is within 95% of the best
reachable, among split counts that actually change the blocks per split. This is the rule of
FlashAttention-2/3's C++ `num_splits_heuristic` (which allows 85%), re-derived here with
SM120's slot count. For long KV it starts the search higher: at least MIN_WAVES waves and at most
MAX_BLOCKS_PER_SPLIT key blocks per split, while each split keeps MIN_BLOCKS_PER_SPLIT blocks
(measured faster at 32k-128k keys; short KV keeps the one-wave rule).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Optional

# Upstream's heuristic caps splits at 128; its combine kernel takes at most 256.
MAX_SPLITS = 128
# Below this many key blocks a split costs more (prologue, partial write, combine) than it hides.
MIN_N_BLOCKS_TO_SPLIT = 4
# An unsplit grid that fills this share of the CTA slots is not split.
FULL_GRID_SHARE = 0.8
EFFICIENCY_SLACK = 0.95  # decode reads KV at the rate of the busy SMs: stay near the best wave fill
# Long KV: at least this many waves of CTAs, and at most MAX_BLOCKS_PER_SPLIT key blocks per split,
# as long as every split keeps MIN_BLOCKS_PER_SPLIT blocks. Measured (H200, SM120 emulation, CUDA
# graphs, configs/measurements/2026-11-29_decode_splits_emulated.md): b=1 / b=8 at 32k-128k keys
# ran 2-8% faster with 32 splits than with the one-wave count, while 4k keys ran fastest with it.
MIN_WAVES = 2
MAX_BLOCKS_PER_SPLIT = 64
MIN_BLOCKS_PER_SPLIT = 16


def num_n_blocks(
    max_seqlen_k: int,
    tile_n: int,
    *,
    local: bool = False,
    window_left: Optional[int] = None,
    window_right: Optional[int] = None,
    tile_m: int = 0,
) -> int:
    """Key blocks one M tile may visit: all of them, or (local) the window band plus one M tile."""
    if max_seqlen_k <= 0:
        return 0
    loaded = max_seqlen_k
    if local:
        left = max_seqlen_k if window_left is None else window_left
        right = max_seqlen_k if window_right is None else window_right
        loaded = max(0, min(max_seqlen_k, left + right + 1 + tile_m))
    return -(-loaded // tile_n)


def useful_max_splits(n_blocks: int) -> int:
    """More splits than key blocks only adds empty splits; more than MAX_SPLITS is never chosen."""
    return max(1, min(n_blocks, MAX_SPLITS))


def clamp_num_splits(requested: int, n_blocks: int) -> int:
    """An explicit num_splits > 1, clamped to [1, useful_max_splits(n_blocks)].

    The clamp is silent and documented in the API docstrings: a split count above the number of
    key blocks (or above MAX_SPLITS) would only produce splits without work.
    """
    return max(1, min(requested, useful_max_splits(n_blocks)))


@lru_cache(maxsize=4096)  # pure and called per decode step: a host-time hot spot (~90 us uncached)
def choose_num_splits(
    *,
    total_mblocks: int,
    n_blocks: int,
    num_sms: int,
    ctas_per_sm: int,
    max_splits: int = MAX_SPLITS,
) -> int:
    """Automatic split count (pure). `total_mblocks`: CTAs of the unsplit grid."""
    if total_mblocks <= 0 or n_blocks <= MIN_N_BLOCKS_TO_SPLIT:
        return 1
    slots = max(1, num_sms) * max(1, ctas_per_sm)
    if total_mblocks >= FULL_GRID_SHARE * slots:
        return 1
    limit = max(1, min(max_splits, n_blocks, useful_max_splits(n_blocks), slots))

    def efficiency(s: int) -> float:
        waves = total_mblocks * s / slots
        return waves / math.ceil(waves)

    def eligible(s: int) -> bool:
        # s splits must change the blocks per split, or they only add empty splits
        return s == 1 or -(-n_blocks // s) != -(-n_blocks // (s - 1))

    # long KV: enough splits for MIN_WAVES waves and short splits, if each split keeps enough blocks
    low = max(-(-n_blocks // MAX_BLOCKS_PER_SPLIT), -(-MIN_WAVES * slots // total_mblocks))
    low = -(-n_blocks // -(-n_blocks // low))  # the fewest splits with that many blocks per split
    if 1 < low <= limit and -(-n_blocks // low) >= MIN_BLOCKS_PER_SPLIT:
        first = low
    else:
        first = 1
    best = max(efficiency(s) for s in range(first, limit + 1) if eligible(s))
    for s in range(first, limit + 1):
        if eligible(s) and efficiency(s) >= EFFICIENCY_SLACK * best:
            return s
    return 1  # pragma: no cover (the best split count always qualifies)


def resolve_num_splits(
    requested: int,
    *,
    total_mblocks: int,
    n_blocks: int,
    num_sms: int,
    ctas_per_sm: int,
) -> int:
    """Upstream's meaning: 1 off, n > 1 that many (clamped), <= 0 chosen."""
    if requested == 1:
        return 1
    if requested > 1:
        return clamp_num_splits(requested, n_blocks)
    return choose_num_splits(total_mblocks=total_mblocks, n_blocks=n_blocks, num_sms=num_sms, ctas_per_sm=ctas_per_sm)


def total_m_blocks(
    *,
    batch: int,
    max_seqlen_q: int,
    num_heads: int,
    num_heads_kv: int,
    tile_m: int,
    pack_gqa: bool,
) -> int:
    """CTAs of the unsplit grid: batch x heads x M tiles (GQA-packed tiles hold a KV head's group)."""
    group = num_heads // num_heads_kv
    rows = max_seqlen_q * (group if pack_gqa else 1)
    heads = num_heads_kv if pack_gqa else num_heads
    return batch * heads * -(-rows // tile_m)
