"""Block sparsity in the SM120 backward: each K/V tile visits only the Q tiles its lists name.

The backward lists are upstream's Q-direction ones (`block_sparse_tensors_bwd`: FlexAttention's
BlockMask q_num_blocks / q_indices and full_q_*): for each sparse KV block of each (batch, head),
the sparse Q blocks that see it, split into mask ("partial": the mask_mod applies) and full blocks
(it does not). A sparse block spans q_subtile_factor Q tiles and kv_subtile_factor K/V tiles of
the kernel; each list's indices ascend.

How the walk is made without a new mainloop. Upstream's SM80/SM120 backward kernel loops
`m_tile` over every Q tile of the sequence (non-causal: 0 .. ceil(seqlen_q / m_block) - 1) and
calls `compute_one_m_block(m_tile, ...)` once per tile, advancing its shared-memory slots once per
call. Here `m_tile` is read as a position in the CTA's list instead of a tile index (the listed
positions come first, so the slots advance with them as with tiles; up to two Q and two dO stages):
  * positions < count (the listed Q tiles, mask list then full list, ascending, the last sparse
    block's tiles past seqlen_q dropped) run the modifier step (bwd_mods.py) on the listed tile,
    with the mask_mod on mask-list tiles only;
  * positions >= count run no step; with count == 0, position 0 waits for the prologue's K/V loads,
    whose shared memory the epilogue reuses for dK/dV. Position 0 reads the CTA's list counts (and,
    with Q subtiles, each list's last index) into registers allocated in the prologue (`load_K`), and
    the other positions read those: a position past the lists costs a compare and a branch, where
    re-reading the counts (dependent global loads) had cost ~0.3 us per position, a third of a
    10%-dense walk;
  * the step's "load the next tile" hooks load the listed tile as many positions ahead as upstream's
    step loads tiles ahead (its stages), and the prologue's loads are deferred to position 0, which
    loads its own listed tiles in upstream's commit groups (the loads go through the
    kernel's own load_Q_LSE / load_dO_dPsum; `_prologue` marks the prologue's calls at trace time).
The lists travel as the last aux tensors (kernel arguments), like the forward's sinks.

Causal / local windows with lists: as in the forward, the rule applies inside every listed tile (the
step's mask_causal / mask_local), while the mainloop is built without them, so that its m range is the
whole sequence and every list position is visited (BlockInfo would shorten it to the diagonal).

Deterministic (`deterministic=True`), without a user score_mod: dQ in 64-bit fixed point
(bwd_fixed_point.py), whose sums have the same bits in any order; the walk is the non-deterministic
one (stages, launch order). With a user score_mod (no bound for fixed point), turns from the lists:
dQ is added in a fixed order per Q tile, ascending K/V tile.
The host gives each list entry its turn (`dq_turns`: the rank of the sparse KV block among the
sparse KV blocks whose lists name that Q block; upstream's `dq_write_order` layout, always
ascending), and the kernel turns it into a K/V tile's turn, rank * kv_subtile_factor + the tile's
place in its sparse block. The turns ride on the modifier step's own barriers (fused_turns):
before a listed tile's dQ adds thread 0 waits for its turn; after the next listed tile's dP barrier
it releases the previous one, and the last listed tile is released at its step's end. A CTA waits
only for K/V tiles of lower index, launched before it, so the walk cannot deadlock. GQA dK/dV
accumulate in head order in the tuned class's epilogue.

Launch order: with `ordered_tiles` and an order computed on the host, the K/V tiles launch longest
list first (WorkOrderedTileScheduler in ordered_scheduler.py). A K/V block of global tokens is named
by every Q block, and in grid order its CTAs would start late and run alone. The deterministic walk
keeps the grid order, which its no-deadlock argument needs.

Varlen (cu_seqlens_*, seqused_*; `rows_end`): the lists are per sequence, (batch, heads, kv_blocks[, width]) with
the sequence's own block indices, and may have fewer rows than a sequence has K/V blocks (the longest sequence is
device data; block_sparse_bwd.py): a K/V tile past the rows is named by no list, so it reads none and takes no step.
The grid is upstream's (the varlen scheduler with cu_seqlens_k), launched without a tile order.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from flash_attn.cute import utils as fa_utils
from flash_attn.cute.block_sparse_utils import sparse_physical_n_block_forward
from flash_attn.cute.tile_scheduler import SingleTileScheduler
from flash_attn.cute.utils import AuxData

from flash_attn_sm120.kernels import bwd_deterministic
from flash_attn_sm120.kernels.bwd_mods import FlashAttentionBackwardSm120Mods
from flash_attn_sm120.kernels.bwd_sm120 import FlashAttentionBackwardSm120Tuned
from flash_attn_sm120.kernels.fwd_block_sparse import _tiles_in_list
from flash_attn_sm120.kernels.ordered_scheduler import WorkOrderedTileScheduler, split_tile_order


def with_lists(aux_data: AuxData, blocksparse_tensors, turns: bool = False) -> AuxData:
    """Plain Python (trace time): aux_data with the lists (cnt, idx[, full cnt, full idx]) appended, and
    with `turns` the deterministic order's dq_write_order[, dq_write_order_full] after them."""
    if blocksparse_tensors is None:
        return aux_data
    lists = [t for t in blocksparse_tensors[:4] if t is not None]
    if turns:
        lists += [t for t in blocksparse_tensors[6:8] if t is not None]
    return AuxData(list(aux_data.tensors or []) + lists, aux_data.scalars)


def split_lists(aux_data: AuxData, n: int):
    """The inverse of with_lists: (the user's aux_data, the n list tensors)."""
    tensors = list(aux_data.tensors)
    user = tensors[:-n]
    return AuxData(user or None, aux_data.scalars), tensors[-n:]


@cute.jit
def _nth_listed(i: Int32, mask_idx: cute.Tensor, mask_tiles: Int32, full_idx: Optional[cute.Tensor],
                q_subtile_factor: cutlass.Constexpr[int]) -> Int32:
    """The i-th listed Q tile (the mask list's, then the full list's, each ascending)."""
    m = sparse_physical_n_block_forward(mask_idx, cutlass.min(i, cutlass.max(mask_tiles - 1, 0)), q_subtile_factor)
    if const_expr(full_idx is not None):
        if i >= mask_tiles:
            m = sparse_physical_n_block_forward(full_idx, i - mask_tiles, q_subtile_factor)
    return m


class FlashAttentionBackwardSm120BlockSparse(FlashAttentionBackwardSm120Mods):
    """The modifier backward walking upstream's Q-direction block-sparse lists (module docstring)."""

    def __init__(self, *args, q_subtile_factor: int = 1, kv_subtile_factor: int = 1, has_full: bool = False,
                 is_causal: bool = False, is_local: bool = False, ordered_tiles: bool = False, rows_end: bool = False,
                 **kwargs):
        # the mainloop without the window (its m range covers every list position); the step applies it
        super().__init__(*args, is_causal=False, is_local=False, **kwargs)
        self.mask_causal, self.mask_local = is_causal, is_local
        # deterministic with turns from the lists; fixed-point dQ (bwd_fixed_point.py) needs none and walks
        # as the non-deterministic kernel does
        self.turn_lists = self.deterministic and not self.dq_fixed_point
        if self.turn_lists and (self.num_stages_Q != 1 or self.num_stages_dO != 1):
            raise ValueError("the deterministic block-sparse backward with list turns takes one Q and one dO stage")
        if self.V_in_regs:
            raise ValueError("the block-sparse backward takes no V in registers")
        if self.pds_in_regs:  # its subtile masks and list turns are written for the unswapped S tile
            raise ValueError("the block-sparse backward takes no P/dS in registers (sdp_swapab)")
        if self.turn_lists and not self.fused_turns:
            raise ValueError("the deterministic block-sparse backward orders dQ with fused_turns (the modifier step) "
                             "or adds it in fixed point (dq_fixed_point)")
        if self.dq_descending or self.dq_rotated or self.reverse_n_blocks or self.dq_groups > 1 or self.lpt:
            raise ValueError("the block-sparse walk takes its dQ turns from its lists (ascending, one accumulator) "
                             "and its launch order from them (ordered_tiles), not from these options")
        self.q_subtile_factor = q_subtile_factor
        self.kv_subtile_factor = kv_subtile_factor
        self.has_full = has_full
        # varlen: a K/V tile past the lists' rows has empty lists (module docstring)
        self.rows_end = rows_end
        self._prologue = True
        if ordered_tiles and self.turn_lists:
            raise ValueError("the deterministic walk launches its K/V tiles in grid order (a tile waits only for "
                             "tiles launched before it): no tile order")
        # K/V tiles launched longest list first, in an order the host computes (ordered_scheduler.py); the
        # order tensor arrives as the last aux tensor
        self.ordered_tiles = ordered_tiles
        self._tile_order = None  # the order's cute tensor, set at trace time by __call__

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mLSE: cute.Tensor,
        mdPsum: cute.Tensor,
        mdQaccum: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        softmax_scale: Float32,
        mCuSeqlensQ: Optional[cute.Tensor] = None,
        mCuSeqlensK: Optional[cute.Tensor] = None,
        mSeqUsedQ: Optional[cute.Tensor] = None,
        mSeqUsedK: Optional[cute.Tensor] = None,
        window_size_left: Int32 | int | None = None,
        window_size_right: Int32 | int | None = None,
        mdQ_semaphore: Optional[cute.Tensor] = None,
        mdK_semaphore: Optional[cute.Tensor] = None,
        mdV_semaphore: Optional[cute.Tensor] = None,
        aux_data: AuxData = AuxData(),
        blocksparse_tensors=None,
        mCuTotalMBlocks: Optional[cute.Tensor] = None,
        stream: cuda.CUstream = None,
    ):
        # the lists ride as the last aux tensors; the kernel body's prologue is traced before its mainloop
        self._prologue = True
        aux_data, self._tile_order = split_tile_order(aux_data, self.ordered_tiles)
        FlashAttentionBackwardSm120Tuned.__call__(
            self, mQ, mK, mV, mdO, mLSE, mdPsum, mdQaccum, mdK, mdV, softmax_scale, mCuSeqlensQ, mCuSeqlensK,
            mSeqUsedQ, mSeqUsedK, window_size_left, window_size_right, mdQ_semaphore, mdK_semaphore, mdV_semaphore,
            with_lists(aux_data, blocksparse_tensors, self.turn_lists), None, mCuTotalMBlocks, stream,
        )

    def kernel(self, *args):
        # upstream's __call__ passes (..., tile scheduler params, its class, aux_data) last: with a tile order
        # the same grid runs WorkOrderedTileScheduler, which reads each CTA's (n_block, head, batch) from it
        if self._tile_order is not None:
            params, scheduler = args[-3], args[-2]
            if scheduler is not SingleTileScheduler:
                raise ValueError("a tile order needs the dense SingleTileScheduler grid (no cu_seqlens_k)")
            ordered = WorkOrderedTileScheduler.params_with_order(params, self._tile_order)
            args = (*args[:-3], ordered, WorkOrderedTileScheduler, args[-1])
        return super().kernel(*args)

    def load_K(self, *args, **kwargs):
        # The kernel calls this once, in the prologue, inside the same branches as its m-block loop and
        # outside any other: the walk's state (its lists' tile counts) gets its registers here, before the
        # loop, so that positions past the lists read no memory (a read of the counts is a dependent pair
        # of global loads)
        self._walk_state = cute.make_rmem_tensor(2, Int32)
        return super().load_K(*args, **kwargs)

    def load_Q_LSE(self, *args, **kwargs):
        if self._prologue:
            return None  # position 0 of the walk loads its own tile
        return super().load_Q_LSE(*args, **kwargs)

    def load_dO_dPsum(self, *args, **kwargs):
        if self._prologue:
            return None
        return super().load_dO_dPsum(*args, **kwargs)

    def compute_one_m_block(self, m_block, *args, mask_fn=None, **kwargs):
        self._prologue = False
        aux_data, sems = kwargs.pop("aux_data"), []
        if self.deterministic:  # the semaphores follow the lists (FlashAttentionBackwardSm120Tuned.__call__)
            dq_slots = 2 if self.dq_fixed_point else 1  # (fixed point: the int64 accumulator and the scales)
            aux_data, sems = split_lists(aux_data, dq_slots + (1 if self.qhead_per_kvhead > 1 else 0))
            self._dkv_semaphore = sems[-1] if self.qhead_per_kvhead > 1 else None  # for the epilogue
            if const_expr(self.dq_fixed_point):
                self._dq_fixed = (sems[0].iterator.toint(), sems[1][mask_fn.keywords["head_idx"]])
                sems = []
        lists_per_kind = 3 if self.turn_lists else 2  # cnt, idx[, turns]
        aux_data, lists = split_lists(aux_data, lists_per_kind * (2 if self.has_full else 1))
        self._walk_step(m_block, _by_kind(lists, self.has_full, self.turn_lists), sems[0] if sems else None,
                        *args, mask_fn=mask_fn, aux_data=aux_data, **kwargs)

    @cute.jit
    def _walk_step(
        self,
        position: Int32,
        lists: list,
        dq_semaphore: Optional[cute.Tensor],
        smem_pipe_read_q: Int32,
        smem_pipe_read_do: Int32,
        smem_pipe_write_q: Int32,
        smem_pipe_write_do: Int32,
        mma_params,
        smem_copy_params,
        gmem_copy_params,
        load_Q_LSE: Callable,
        load_dO_dPsum: Callable,
        m_block_max: Int32,
        softmax_scale: Float32,
        softmax_scale_log2: Float32,
        aux_data: AuxData = AuxData(),
        mask_fn: Optional[Callable] = None,
    ):
        """Position `position` of this CTA's list: the listed Q tile's step, or nothing past the list."""
        F = self.q_subtile_factor
        kw = mask_fn.keywords
        batch_idx, head_idx = kw["batch_idx"], kw["head_idx"]
        kv_sparse = kw["n_block"] // self.kv_subtile_factor
        if const_expr(self.rows_end):  # a row past the lists: any row's pointer, and no count read from it
            kv_sparse = cutlass.min(kv_sparse, cutlass.max(lists[0].shape[2] - 1, 0))
        mask_idx = lists[1][batch_idx, head_idx, kv_sparse, None]
        full_idx = lists[4][batch_idx, head_idx, kv_sparse, None] if const_expr(self.has_full) else None
        state = self._walk_state  # (mask-list tiles, full-list tiles), read from memory at position 0 only
        if position == 0:
            num_m_tiles = cute.ceil_div(mask_fn.func.__self__.seqlen_info.seqlen_q, self.m_block_size)
            state[0] = Int32(0)
            state[1] = Int32(0)
            if const_expr(self.rows_end):
                if kw["n_block"] // self.kv_subtile_factor < lists[0].shape[2]:
                    self._read_counts(state, lists, batch_idx, head_idx, kv_sparse, mask_idx, full_idx, num_m_tiles)
            else:
                self._read_counts(state, lists, batch_idx, head_idx, kv_sparse, mask_idx, full_idx, num_m_tiles)
        mask_tiles = state[0]
        count = mask_tiles + state[1]

        if position == 0:
            if count == 0:
                # no Q tile sees this K/V tile: the prologue's K and V loads must land before the epilogue
                # writes dK/dV (zeros) into their shared memory (compute-sanitizer racecheck found it)
                cute.arch.cp_async_wait_group(0)
                cute.arch.barrier()
        if position < count:
            m_block = _nth_listed(position, mask_idx, mask_tiles, full_idx, F)
            # upstream's step loads Q `q_ahead` and dO `do_ahead` tiles ahead (its stages): here listed tiles
            q_ahead = max(self.num_stages_Q - 1, 1)
            do_ahead = self.num_stages_dO
            if position == 0:  # the prologue's loads (upstream's groups: Q, dO[, second dO]), for listed tiles
                load_Q_LSE(m_block, 0)
                cute.arch.cp_async_commit_group()
                load_dO_dPsum(m_block, 0)
                cute.arch.cp_async_commit_group()
                if const_expr(self.num_stages_dO > 1):
                    if count > 1:
                        load_dO_dPsum(_nth_listed(Int32(1), mask_idx, mask_tiles, full_idx, F), 1)
                    cute.arch.cp_async_commit_group()
            q_next = _nth_listed(cutlass.min(position + q_ahead, count - 1), mask_idx, mask_tiles, full_idx, F)
            do_next = q_next
            if const_expr(do_ahead != q_ahead):
                do_next = _nth_listed(cutlass.min(position + do_ahead, count - 1), mask_idx, mask_tiles, full_idx, F)
            has_q_next = position + q_ahead < count
            has_do_next = position + do_ahead < count

            def load_Q_next_listed(m, slot):
                if has_q_next:
                    load_Q_LSE(q_next, slot)

            def load_dO_next_listed(m, slot):
                if has_do_next:
                    load_dO_dPsum(do_next, slot)

            step = dict(
                smem_pipe_read_q=smem_pipe_read_q, smem_pipe_read_do=smem_pipe_read_do,
                smem_pipe_write_q=smem_pipe_write_q, smem_pipe_write_do=smem_pipe_write_do, mma_params=mma_params,
                smem_copy_params=smem_copy_params, gmem_copy_params=gmem_copy_params,
                load_Q_LSE=load_Q_next_listed, load_dO_dPsum=load_dO_next_listed,
                # the step's own "next tile in range" tests (m_block + its stages) always pass
                m_block_max=m_block + self.num_stages_Q + self.num_stages_dO + 1,
                softmax_scale=softmax_scale, softmax_scale_log2=softmax_scale_log2, aux_data=aux_data, mask_fn=mask_fn,
            )
            if const_expr(self.turn_lists):
                self._fuse_turns(position, m_block, mask_idx, mask_tiles, full_idx, lists, dq_semaphore,
                                 batch_idx, head_idx, kv_sparse, kw["n_block"])
            if position < mask_tiles:
                self._one_m_block(m_block, use_mask_mod=True, **step)
            else:
                self._one_m_block(m_block, use_mask_mod=False, **step)
            if const_expr(self.turn_lists):  # the last listed tile's turn ends with its step
                bwd_deterministic.call_if(position == count - 1, partial(
                    bwd_deterministic.release_after_barrier,
                    fa_utils.elem_pointer(dq_semaphore, (batch_idx, head_idx, m_block))))

    @cute.jit
    def _read_counts(self, state: cute.Tensor, lists: list, batch_idx: Int32, head_idx: Int32, kv_sparse: Int32,
                     mask_idx: cute.Tensor, full_idx: Optional[cute.Tensor], num_m_tiles: Int32):
        """state <- (mask-list tiles, full-list tiles) of this K/V tile's lists."""
        F = self.q_subtile_factor
        state[0] = _tiles_in_list(lists[0][batch_idx, head_idx, kv_sparse], mask_idx, F, num_m_tiles)
        if const_expr(self.has_full):
            state[1] = _tiles_in_list(lists[3][batch_idx, head_idx, kv_sparse], full_idx, F, num_m_tiles)

    @cute.jit
    def _fuse_turns(self, position: Int32, m_block: Int32, mask_idx: cute.Tensor, mask_tiles: Int32,
                    full_idx: Optional[cute.Tensor], lists: list, dq_semaphore: cute.Tensor, batch_idx: Int32,
                    head_idx: Int32, kv_sparse: Int32, n_block: Int32):
        """The step's fused_turns hooks for this listed tile: release the previous listed tile after the dP
        barrier, wait for this tile's turn before the dQ adds (the list entry's turn, scaled to K/V tiles)."""
        F = self.q_subtile_factor
        # the list entry (sparse Q block) of this position: mask list, then full list (as _nth_listed)
        rank = lists[2][batch_idx, head_idx, kv_sparse, cutlass.min(position, cutlass.max(mask_tiles - 1, 0)) // F]
        if const_expr(self.has_full):
            if position >= mask_tiles:
                rank = lists[5][batch_idx, head_idx, kv_sparse, (position - mask_tiles) // F]
        turn = rank * self.kv_subtile_factor + n_block % self.kv_subtile_factor
        previous = _nth_listed(cutlass.max(position - 1, 0), mask_idx, mask_tiles, full_idx, F)
        self._after_dp_barrier = partial(bwd_deterministic.call_if, position > 0, partial(
            bwd_deterministic.release_unfenced, fa_utils.elem_pointer(dq_semaphore, (batch_idx, head_idx, previous))))
        self._before_dq_barrier = partial(bwd_deterministic.spin,
                                          fa_utils.elem_pointer(dq_semaphore, (batch_idx, head_idx, m_block)), turn)


def _by_kind(lists: list, has_full: bool, turns: bool) -> list:
    """[mask cnt, mask idx, mask turns or None, full cnt, full idx, full turns or None] from with_lists' order
    (cnt, idx[, full cnt, full idx][, turns[, full turns]])."""
    mask, rest = lists[:2], lists[2:]
    full = rest[:2] if has_full else [None, None]
    rest = rest[2:] if has_full else rest
    mask_turns = rest[0] if turns else None
    full_turns = rest[1] if turns and has_full else None
    return [*mask, mask_turns, *full, full_turns]
