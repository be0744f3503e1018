"""The TMA forward's producer: one warp issues every TMA load of the CTA.

Q once into its single slot, then K and V of each n_block, from the last n_block down to the
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
    ):
        """Producer warp: Q once, then K and V of each n_block (descending; with block sparsity the
        listed tiles, fwd_block_sparse.py) into the rings. Returns the advanced (q_state, kv_state).

        Persistent: the tile's first K/V block goes before its Q. The MMA warps release the Q slot only
        after the previous tile's epilogue (sO reuses it), and the K/V slot is free earlier, so the first
        block's loads overlap that epilogue instead of queueing behind Q."""
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
        gK = cute.local_tile(mK_cur, (self.tile_n, self.tile_hdim), (None, 0))
        gV = cute.local_tile(mV_cur, (self.tile_n, self.tile_hdimv), (None, 0))
        load_Q, _, _ = copy_utils.tma_get_copy_fn(tma_atom_Q, 0, cute.make_layout(1), gQ, sQ, single_stage=True)
        load_K, _, _ = copy_utils.tma_get_copy_fn(tma_atom_K, 0, cute.make_layout(1), gK, sK)
        load_V, _, _ = copy_utils.tma_get_copy_fn(tma_atom_V, 0, cute.make_layout(1), gV, sV)
        load_K = copy_utils.tma_producer_copy_fn(load_K, pipeline_k)
        load_V = copy_utils.tma_producer_copy_fn(load_V, pipeline_v)

        if const_expr(not self.persistent):
            self._load_q_slot(pipeline_q, load_Q, q_state)
        if const_expr(lists is not None):  # read under the Q load (persistent: under the last tile's epilogue)
            kv_state = fwd_block_sparse.load_tiles(
                lists(), kv_state, load_K, load_V, pipeline_k, pipeline_v, self.kv_subtile_factor,
                load_q=partial(self._load_q_slot, pipeline_q, load_Q) if const_expr(self.persistent) else None,
                q_state=q_state,
            )
        else:
            n_blocks = n_block_max - n_block_min
            first = 0
            if const_expr(self.persistent):
                if n_blocks > 0:
                    pipeline_k.producer_acquire(kv_state)
                    load_K(src_idx=n_block_max - 1, producer_state=kv_state)
                    pipeline_v.producer_acquire(kv_state)
                    load_V(src_idx=n_block_max - 1, producer_state=kv_state)
                    kv_state.advance()
                self._load_q_slot(pipeline_q, load_Q, q_state)
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
    def _load_q_slot(self, pipeline_q: cpipeline.PipelineAsync, load_Q: Callable, q_state: cpipeline.PipelineState):
        """Acquire the Q slot (free once the MMA warps released it) and issue the tile's Q load."""
        pipeline_q.producer_acquire(q_state)
        load_Q(tma_bar_ptr=pipeline_q.producer_get_barrier(q_state))
