"""The TMA forward's producer: one warp issues every TMA load of the CTA.

Q once into its slot, then K and V of each n_block, from the last n_block down to the
first (the order the MMA warps consume them: the last block holds the seqlen_k boundary and the
causal diagonal). For each block the warp acquires a K slot (waits for its empty barrier), issues
the TMA load with the slot's full barrier as the transaction barrier, then does the same for V;
K and V share one producer state, so both rings advance in lockstep and the producer runs up to
`num_stages` blocks ahead of the MMA warps. With block sparsity the walk is over the tile's
listed K/V tiles instead (fwd_block_sparse.load_tiles).

The partitioning goes through quack's `tma_get_copy_fn`, which groups the tile modes before
`tma_partition` (cutlass PR #3189 traced a TMA hang on sm_120 to modes left ungrouped).

A mixin of FlashAttentionForwardSm120Tma; `kernel` (fwd_tma_kernel.py) calls `load`.
"""

from functools import partial
from typing import Callable, Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as cpipeline
from cutlass import Int32, const_expr
from flash_attn.cute.seqlen_info import SeqlenInfoQK
from quack import copy_utils

from flash_attn_sm120.kernels import fwd_block_sparse


class TmaProducerMixin:
    """The producer warp of FlashAttentionForwardSm120Tma: Q, then the K/V rings (module docstring)."""

    @cute.jit
    def load(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        tma_atom_Q: cute.CopyAtom,
        tma_atom_K: cute.CopyAtom,
        tma_atom_V: cute.CopyAtom,
        pipeline_q: cpipeline.PipelineAsync,
        pipeline_k: cpipeline.PipelineAsync,
        pipeline_v: cpipeline.PipelineAsync,
        m_block: Int32,
        head_idx: Int32,
        batch_idx: Int32,
        n_block_min: Int32,
        n_block_max: Int32,
        lists: Optional[Callable],
        seqlen: SeqlenInfoQK,
        q_state: cpipeline.PipelineState,
        kv_state: cpipeline.PipelineState,
        tile_slot: Optional[tuple] = None,
    ):
        """Producer warp: Q once, then K and V of each n_block (descending; with block sparsity the
        listed tiles, fwd_block_sparse.py) into the rings. Returns the advanced (q_state, kv_state).

        Persistent with one Q slot: the tile's first K/V block goes before its Q. The MMA warps release
        the Q slot only after the previous tile's epilogue (sO reuses it), and the K/V slot is free
        earlier, so the first block's loads overlap that epilogue instead of queueing behind Q. With two
        Q slots, Q goes first: its slot (the one before last tile's) is already free, so the load runs
        under the previous tile's main loop and the tile starts without waiting for it.

        `tile_slot` (the dynamic order): (sTile, this tile's WorkTileInfo), written into the Q slot's entry of
        sTile before the slot's full-barrier arrive, so that the MMA warps read it once the Q has landed."""
        # packed GQA: the grid's head index is already the KV head
        head_idx_kv = head_idx if const_expr(self.pack_gqa) else head_idx // self.qhead_per_kvhead
        # varlen q: Q from the sequence's first row (a tile past seqlen_q reads the next sequence's
        # rows, whose outputs the ragged O store clips)
        mQ_cur = seqlen.offset_batch_Q(mQ, batch_idx, dim=3)[None, None, head_idx]
        if const_expr(seqlen.has_cu_seqlens_k):
            # the host's ragged views: rows past seqlen_k are out of bounds, zero-filled by TMA
            mK_cur, mV_cur = [
                copy_utils.offset_ragged_tensor(t, seqlen.offset_k, seqlen.seqlen_k, ragged_dim=0, ptr_shift=False)
                [None, None, head_idx_kv]
                for t in (mK, mV)
            ]
        else:
            mK_cur, mV_cur = mK[None, None, head_idx_kv, batch_idx], mV[None, None, head_idx_kv, batch_idx]
        gQ = cute.local_tile(mQ_cur, (self.tile_m, self.tile_hdim), (m_block, 0))
        sQ = self.q_slot(sQ, q_state)
        gK = cute.local_tile(mK_cur, (self.tile_n, self.tile_hdim), (None, 0))
        gV = cute.local_tile(mV_cur, (self.tile_n, self.tile_hdimv), (None, 0))
        load_Q, _, _ = copy_utils.tma_get_copy_fn(tma_atom_Q, 0, cute.make_layout(1), gQ, sQ, single_stage=True)
        load_K, _, _ = copy_utils.tma_get_copy_fn(tma_atom_K, 0, cute.make_layout(1), gK, sK)
        load_V, _, _ = copy_utils.tma_get_copy_fn(tma_atom_V, 0, cute.make_layout(1), gV, sV)
        load_K = copy_utils.tma_producer_copy_fn(load_K, pipeline_k)
        load_V = copy_utils.tma_producer_copy_fn(load_V, pipeline_v)

        # Q behind the first K/V block only when its single slot waits for the previous tile's epilogue
        q_after_first_block = const_expr(self.persistent and self.q_stages == 1)
        load_q_slot = partial(self._load_q_slot, tile_slot=tile_slot)
        if const_expr(not q_after_first_block):
            load_q_slot(pipeline_q, load_Q, q_state)
        if const_expr(lists is not None):  # read under the Q load (persistent: under the last tile's epilogue)
            kv_state = fwd_block_sparse.load_tiles(
                lists(), kv_state, load_K, load_V, pipeline_k, pipeline_v, self.kv_subtile_factor,
                load_q=partial(load_q_slot, pipeline_q, load_Q) if const_expr(q_after_first_block) else None,
                q_state=q_state,
            )
        else:
            n_blocks = n_block_max - n_block_min
            first = 0
            if const_expr(q_after_first_block):
                if n_blocks > 0:
                    pipeline_k.producer_acquire(kv_state)
                    load_K(src_idx=n_block_max - 1, producer_state=kv_state)
                    pipeline_v.producer_acquire(kv_state)
                    load_V(src_idx=n_block_max - 1, producer_state=kv_state)
                    kv_state.advance()
                load_q_slot(pipeline_q, load_Q, q_state)
                first = 1
            for i in cutlass.range(first, n_blocks, unroll=1):
                n_block = n_block_max - 1 - i
                pipeline_k.producer_acquire(kv_state)
                load_K(src_idx=n_block, producer_state=kv_state)
                pipeline_v.producer_acquire(kv_state)
                load_V(src_idx=n_block, producer_state=kv_state)
                kv_state.advance()
        q_state.advance()
        return q_state, kv_state

    @cute.jit
    def _load_q_slot(self, pipeline_q: cpipeline.PipelineAsync, load_Q: Callable, q_state: cpipeline.PipelineState,
                     tile_slot: Optional[tuple] = None):
        """Acquire the Q slot (free once the MMA warps released it) and issue the tile's Q load. With
        `tile_slot` the tile's coordinates go into the slot's sTile entry between the empty wait and the full
        barrier's arrive (the arrive releases them to the MMA warps' wait)."""
        if const_expr(tile_slot is not None):
            s_tile, work_tile = tile_slot
            pipeline_q.sync_object_empty.wait(q_state.index, q_state.phase)
            m_block, head_idx, batch_idx, _ = work_tile.tile_idx
            self._write_tile_slot(s_tile, q_state.index, m_block, head_idx, batch_idx, Int32(1))
            pipeline_q.sync_object_full.arrive(q_state.index, pipeline_q.producer_mask)
        else:
            pipeline_q.producer_acquire(q_state)
        load_Q(tma_bar_ptr=pipeline_q.producer_get_barrier(q_state))

    @staticmethod
    def _write_tile_slot(s_tile: cute.Tensor, slot, m_block, head_idx, batch_idx, valid) -> None:
        """(m_block, head, batch, valid) into a Q slot's sTile entry (every lane writes the same values)."""
        for i, value in enumerate((m_block, head_idx, batch_idx, valid)):
            s_tile[i, slot] = value

    @cute.jit
    def signal_last_tile(self, pipeline_q: cpipeline.PipelineAsync, q_state: cpipeline.PipelineState,
                         s_tile: cute.Tensor):
        """Dynamic order, past the last tile: an invalid entry in the next Q slot's sTile, then a plain
        arrive on its full barrier (no transaction bytes, no load), which ends the MMA warps' tile loop."""
        pipeline_q.sync_object_empty.wait(q_state.index, q_state.phase)
        self._write_tile_slot(s_tile, q_state.index, Int32(0), Int32(0), Int32(0), Int32(0))
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive(pipeline_q.producer_get_barrier(q_state))
