"""A tile order given as data: CTA i of a 1-D grid runs tile `tile_order[i]` (block-sparse forward).

Why: with block sparsity the work of a Q tile is the length of its K/V lists, and the lists can be
very unequal. A sliding window plus global tokens gives the global rows every K/V block (64 at
s8192) and the other rows ~10; FA4's grid order (m_block fastest, heads, batch) launches head 15's
global row in the last wave, where it runs alone for several tiles' time. The hardware hands CTAs
to SMs in launch order as SMs free up, a greedy list schedule, so launching the tiles longest first
makes it an LPT schedule (the longest tiles start in the first wave, the short ones fill the tail).

The host computes the order from the lists' counts (`block_sparse.tile_order`: a stable descending
sort of each tile's visited blocks, an int32 permutation of the grid's linear tile indices
m + num_block * (head + num_head * batch)). The kernel reads its entry after the role split
(`get_current_work`), like the other schedulers' decode. Any permutation gives the same result;
only the timing depends on the order.

The order reaches the kernel appended to the aux tensors (`with_tile_order` on the host,
`split_tile_order` in `__call__`), as the sink does: the compiled call convention stays upstream's.
The TMA forward launches a 1-D grid; the block-sparse backward keeps its (n_block, head, batch) grid
(the scheduler reads the CTA's linear index in either) and orders its K/V tiles the same way.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from flash_attn.cute.tile_scheduler import TileSchedulerArguments, WorkTileInfo
from quack.cute_dsl_utils import ParamsBase

from flash_attn_sm120.kernels import sink_fold


# The order rides as the last aux tensor the way the sink does: the same append (host) and pop (`__call__`).
with_tile_order = sink_fold.with_sink
split_tile_order = sink_fold.split_sink


class WorkOrderedTileScheduler:
    """One tile per CTA of a 1-D grid, CTA i running tile `tile_order[i]`: an int32 permutation of the
    linear tile indices m + num_block * (head + num_head * batch), e.g. longest first, so that the
    hardware's launch-order dispatch becomes an LPT schedule. Any permutation gives the same result."""

    @dataclass
    class Params(ParamsBase):
        num_block: Int32
        num_head: Int32
        num_batch: Int32
        tile_order: cute.Tensor

    def __init__(self, params: Params, linear_idx: Int32, *, loc=None, ip=None):
        self.params = params
        self._linear_idx = linear_idx
        self._is_first_block = True
        self._loc = loc
        self._ip = ip

    @staticmethod
    def params_with_order(args: TileSchedulerArguments, tile_order: cute.Tensor) -> Params:
        """Host side: `args` is a TileSchedulerArguments, or another scheduler's Params with the same
        num_block / num_head / num_batch (the backward's, swapped in at launch)."""
        return WorkOrderedTileScheduler.Params(args.num_block, args.num_head, args.num_batch, tile_order)

    @staticmethod
    def create(params: Params, ctx=None, *, loc=None, ip=None) -> "WorkOrderedTileScheduler":
        # the CTA's linear index in any grid shape: a 1-D grid (get_grid_shape), or the 3-D grid of a
        # kernel whose host side launches (num_block, num_head, num_batch) CTAs (the backward's)
        x, y, z = cute.arch.block_idx()
        grid_x, grid_y, _ = cute.arch.grid_dim()
        return WorkOrderedTileScheduler(params, x + grid_x * (y + grid_y * z), loc=loc, ip=ip)

    @staticmethod
    def get_grid_shape(params: Params, *, loc=None, ip=None) -> tuple:
        return (params.num_block * params.num_head * params.num_batch, Int32(1), Int32(1))

    def get_current_work(self, *, loc=None, ip=None) -> WorkTileInfo:
        tile = Int32(self.params.tile_order[self._linear_idx])
        # (two integer divisions once per CTA and role)
        m_block = tile % self.params.num_block
        head_batch = tile // self.params.num_block
        head_idx = head_batch % self.params.num_head
        batch_idx = head_batch // self.params.num_head
        return WorkTileInfo((m_block, head_idx, batch_idx, Int32(0)), self._is_first_block)

    def initial_work_tile_info(self, *, loc=None, ip=None) -> WorkTileInfo:
        return self.get_current_work(loc=loc, ip=ip)

    def prefetch_next_work(self, *, loc=None, ip=None) -> None:
        pass

    def advance_to_next_work(self, *, loc=None, ip=None) -> WorkTileInfo:
        self._is_first_block = False
        return self.get_current_work()

    def producer_tail(self, *, loc=None, ip=None) -> None:
        pass

    def __extract_mlir_values__(self):
        values, self._values_pos = [], []
        for obj in (self.params, self._linear_idx):
            obj_values = cutlass.extract_mlir_values(obj)
            values += obj_values
            self._values_pos.append(len(obj_values))
        return values

    def __new_from_mlir_values__(self, values):
        rebuilt = []
        for obj, n_items in zip((self.params, self._linear_idx), self._values_pos):
            rebuilt.append(cutlass.new_from_mlir_values(obj, values[:n_items]))
            values = values[n_items:]
        scheduler = WorkOrderedTileScheduler(*rebuilt, loc=self._loc)
        scheduler._is_first_block = self._is_first_block  # Python-only state
        return scheduler
