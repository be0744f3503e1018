"""A persistent tile order for the TMA forward: each CTA walks a fixed stride of FA4's LPT order.

Without persistence the TMA forward launches one CTA per (m_block, head, batch) tile. At one CTA per
SM (most TMA tiles fill the 99 KB), nothing hides a CTA's fixed cost: the launch, the mbarrier
inits, the latency of the first Q and K/V loads, and the epilogue's store. Block sparsity makes
tiles short (a Q tile visits ~10% of its K/V blocks), so that fixed cost becomes a large share.

With `PersistentTileScheduler` the host launches num_sms * ctas_per_sm CTAs (or fewer when there are
fewer tiles) and CTA c takes tiles c, c + G, c + 2G, ... of FA4's SingleTileLPTScheduler order
(G = the grid size): heads grouped into L2-sized sections, and for causal masks (lpt=True) the
longest m_blocks first, so a static stride still hands out the long tiles first and balances the
tail. The kernel's pipelines then run across tiles: the producer loads the next tile's first K/V
block while the MMA warps finish the current tile, and its Q as soon as the epilogue has released
the Q buffer (sO reuses it).

Only the tile index and the stride differ from SingleTileLPTScheduler (a subclass: `create` starts at
the CTA's own index, `advance_to_next_work` adds the grid size instead of ending the work).
Varlen q keeps SingleTileVarlenScheduler (one CTA per tile), whose order depends on each sequence.

Dynamic (FwdConfig.dynamic): a fixed stride cannot balance unequal tiles (causal, block-sparse lists) the way
the hardware's launch of one CTA per tile does. With a dynamic order CTA c still starts at tile c, and each
later tile comes from a global counter: the producer warp takes `fetch_next_tile` (one relaxed atomicAdd)
as soon as it has issued the current tile's loads, so a CTA that finishes early takes more tiles, in the
same LPT order. The producer hands the tile's coordinates to the MMA warps in shared memory next to its Q
slot, written before its arrive on the slot's full barrier (the producer's `_load_q_slot`); past the last
tile it writes an invalid entry and arrives without a load, which ends the MMA warps' loop. The counter is a
zeroed int32 the host allocates for each call (driver.py): the fetches of one launch return 0, 1, ... and
the index they give is grid + value, valid below the tile count.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from flash_attn.cute.tile_scheduler import SingleTileLPTScheduler, WorkTileInfo


class PersistentTileScheduler(SingleTileLPTScheduler):
    """SingleTileLPTScheduler's order, strided by the grid size (module docstring)."""

    @staticmethod
    @cute.jit
    def create(params: SingleTileLPTScheduler.Params, ctx=None, *, loc=None, ip=None) -> "PersistentTileScheduler":
        tile_idx, _, _ = cute.arch.block_idx()
        return PersistentTileScheduler(params, tile_idx, Int32(0), loc=loc, ip=ip)

    def advance_to_next_work(self, *, loc=None, ip=None) -> WorkTileInfo:
        self._tile_idx += cute.arch.grid_dim()[0]
        return self.get_current_work()


@cute.jit
def fetch_next_tile(counter: cute.Tensor, grid_size: Int32) -> Int32:
    """Producer warp: the next tile index from the call's counter (lane 0's atomicAdd, broadcast to the warp)."""
    taken = Int32(0)
    if cute.arch.lane_idx() == 0:
        taken = cute.arch.atomic_add(counter.iterator, Int32(1), sem="relaxed", scope="gpu")
    return grid_size + cute.arch.shuffle_sync(taken, 0)


def persistent_grid(total_tiles, num_sms: int, ctas_per_sm: int):
    """(CTAs, 1, 1): one wave of resident CTAs, or one CTA per tile when there are fewer tiles."""
    return (cutlass.min(Int32(num_sms * ctas_per_sm), total_tiles), Int32(1), Int32(1))
