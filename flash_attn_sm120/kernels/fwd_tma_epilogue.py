"""The TMA forward's epilogue: the MMA warps write O through shared memory with one TMA store, and LSE.

O leaves the accumulators as bf16/fp16, goes to sO with stmatrix and to global memory with one TMA
store of the whole tile, which TMA clips at seqlen_q (rows past it are never written). sO reuses
sQ's buffer, so a named barrier among the MMA warps (NamedBarrierFwd.Epilogue) first makes sure
that every warp is past its last ldmatrix of Q; the async-proxy fence and a second barrier make
the stmatrix writes visible to the TMA store, which warp 0 issues and waits for. LSE goes straight
from registers: the quad lane that holds column 0 of a row writes it.

`epilogue` overrides the inherited one (FlashAttentionForwardSm80's: sO to global memory by a gmem
tiled copy, or by TMA from a warp outside the MMA warps) under the same name and role, with this
family's arguments; MMA warp 0 issues the store.

A mixin of FlashAttentionForwardSm120Tma; `mma` (fwd_tma_mainloop.py) calls `epilogue`.
"""

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import warp
from flash_attn.cute.named_barrier import NamedBarrierFwd
from flash_attn.cute.seqlen_info import SeqlenInfoQK
from quack import copy_utils, layout_utils


class TmaEpilogueMixin:
    """The output stage of FlashAttentionForwardSm120Tma (module docstring)."""

    @cute.jit
    def epilogue(
        self,
        acc_O: cute.Tensor,
        lse: cute.Tensor,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        sO: cute.Tensor,
        tma_atom_O: cute.CopyAtom,
        thr_mma_pv: cute.ThrMma,
        tiled_mma_pv: cute.TiledMma,
        tidx: Int32,
        warp_idx: Int32,
        seqlen: SeqlenInfoQK,
        m_block: Int32,
        head_idx: Int32,
        batch_idx: Int32,
    ):
        """O: registers -> sO (stmatrix) -> one TMA store (clipped at seqlen_q); LSE from registers."""
        rO = cute.make_fragment_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        # sO aliases sQ: every MMA warp must be past its last ldmatrix of Q
        cute.arch.barrier(barrier_id=int(NamedBarrierFwd.Epilogue), number_of_threads=self.num_mma_threads)
        stsm = cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        smem_thr_copy_O = cute.make_tiled_copy_C(stsm, tiled_mma_pv).get_slice(tidx)
        cute.copy(smem_thr_copy_O, smem_thr_copy_O.retile(rO), smem_thr_copy_O.partition_D(sO))
        # generic-proxy smem writes must be visible to the TMA store (async proxy)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=int(NamedBarrierFwd.Epilogue), number_of_threads=self.num_mma_threads)
        if warp_idx == 0:
            # varlen q: the host's ragged view, whose bound is this sequence's seqlen_q
            mO_cur = seqlen.offset_batch_Q(mO, batch_idx, dim=3, ragged=self.varlen_q)[None, None, head_idx]
            gO = cute.local_tile(mO_cur, (self.tile_m, self.tile_hdimv), (m_block, 0))
            store_O, _, _ = copy_utils.tma_get_copy_fn(tma_atom_O, 0, cute.make_layout(1), sO, gO, single_stage=True)
            store_O()
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)

        if const_expr(mLSE is not None):
            # (rows,) of this head (packed: ((qhead_per_kvhead, seqlen),) of this KV head, where the
            # flat row index m_block * tile_m + row is exactly the packed order)
            mLSE_cur = seqlen.offset_batch_Q(mLSE, batch_idx, dim=2)[None, head_idx]
            cO = cute.make_identity_tensor((self.tile_m, self.tile_hdimv))
            taccOcO = layout_utils.reshape_acc_to_mn(thr_mma_pv.partition_C(cO))
            assert cute.size(taccOcO, mode=[0]) == cute.size(lse)
            rows_left = seqlen.seqlen_q * self.qhead_per_kvhead_packgqa - m_block * self.tile_m
            # the four threads of a quad hold the same rows; the one holding column 0 writes
            if taccOcO[0][1] == 0:
                for r in cutlass.range(cute.size(lse), unroll_full=True):
                    row = taccOcO[r, 0][0]
                    if row < rows_left:
                        mLSE_cur[m_block * self.tile_m + row] = lse[r]
