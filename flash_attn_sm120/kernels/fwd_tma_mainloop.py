"""The TMA forward's MMA warps: FlashAttention-2's main loop over the K/V blocks, fed by the rings.

`mma` runs once per tile on every MMA warp. It partitions sQ/sK/sV for ldmatrix + mma.sync, waits
for Q (and with q_in_regs copies this warp's Q fragments once), then walks the n_blocks from the
last down, in the ranges BlockInfo gives, so that each range compiles with only the masks it needs:

  the last n_block                    seqlen_k mask + causal/local mask, starts the online softmax
  blocks crossing the causal diagonal causal/local mask
  blocks fully inside the mask        no mask
  blocks left of a local window       local mask
  (block sparsity: the tile's listed K/V tiles instead, fwd_block_sparse.consume_tiles)

then finalizes the softmax (with a learnable sink, one more term in the row sums) and hands O to
`epilogue` (fwd_tma_epilogue.py).

`mma_one_n_block` is one block: S = Q K^T, score_mod, masks, online softmax, P = bf16/fp16(S) in
registers. In the plain FA2 order it then runs O += P V (`mma_pv`) on the same block. With the
intra-warp overlap (16-row warps) it instead issues block j's QK^T and block j-1's PV back to back,
and the caller runs the last block's PV after the loop. `_release` hands a slot back to the
producer: the async-proxy fence first, since the next TMA write of the slot must not overtake this
warp's ldmatrix reads.

Ping-pong (`pingpong`: 8 MMA warps as two warpgroups) alternates the two warpgroups' MMA bursts
under named barriers, FA3's warp scheduler barrier with upstream's ids (NamedBarrierFwd:
WarpSchedulerWG1 + g is warpgroup g's turn): `_pingpong_sync` waits for this warpgroup's turn,
`_pingpong_arrive` hands it to the other; warpgroup 1 arrives once up front so that warpgroup 0
goes first. Both are no-ops without ping-pong.

A mixin of FlashAttentionForwardSm120Tma; `kernel` (fwd_tma_kernel.py) calls `mma`.
"""

from functools import partial
from typing import Callable, Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as cpipeline
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warp
from flash_attn.cute import ampere_helpers as sm80_utils
from flash_attn.cute import utils
from flash_attn.cute.block_info import BlockInfo
from flash_attn.cute.mask import AttentionMask
from flash_attn.cute.named_barrier import NamedBarrierFwd
from flash_attn.cute.seqlen_info import SeqlenInfoQK
from flash_attn.cute.softmax import Softmax
from flash_attn.cute.utils import AuxData
from quack import layout_utils

from flash_attn_sm120.kernels import fwd_block_sparse, sink_fold
from flash_attn_sm120.kernels.fwd_tma_rules import WARPGROUP_THREADS
from flash_attn_sm120.kernels.mma_sync_utils import gemm_rs_by_ldmatrix, gemm_ss_by_half_slices


class TmaMainloopMixin:
    """The MMA warps of FlashAttentionForwardSm120Tma: the n_block loop and one block (module docstring)."""

    @cute.jit
    def mma(
        self,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        sO: cute.Tensor,
        tma_atom_O: cute.CopyAtom,
        pipeline_q: cpipeline.PipelineAsync,
        pipeline_k: cpipeline.PipelineAsync,
        pipeline_v: cpipeline.PipelineAsync,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        tidx: Int32,
        warp_idx: Int32,
        softmax_scale_log2: Float32,
        softmax_scale: Optional[Float32],
        block_info: BlockInfo,
        seqlen: SeqlenInfoQK,
        window_size_left: Optional[Int32],
        window_size_right: Optional[Int32],
        m_block: Int32,
        head_idx: Int32,
        batch_idx: Int32,
        n_block_min: Int32,
        n_block_max: Int32,
        aux_data: AuxData,
        fastdiv_mods,
        lists: Optional[Callable],
        q_state: cpipeline.PipelineState,
        kv_k: cpipeline.PipelineState,
        kv_v: cpipeline.PipelineState,
    ):
        """MMA warps: the FA2 loop over n_blocks (or the block-sparse tiles), then the epilogue.
        Returns the advanced (q_state, kv_k, kv_v): the persistent kernel's next tile goes on from them."""
        aux_data, sink = sink_fold.split_sink(aux_data, self.has_sink)
        sQ, sO = self.q_slot(sQ, q_state), self.q_slot(sO, q_state)  # this tile's slot of the Q ring
        sVt = layout_utils.transpose_view(sV)  # (head_dim_v, tile_n, stage) for the PV B operand
        thr_mma_qk = tiled_mma_qk.get_slice(tidx)
        thr_mma_pv = tiled_mma_pv.get_slice(tidx)
        tSrQ = thr_mma_qk.make_fragment_A(thr_mma_qk.partition_A(sQ))
        tSrK = thr_mma_qk.make_fragment_B(thr_mma_qk.partition_B(sK[None, None, 0]))
        tOrVt = thr_mma_pv.make_fragment_B(thr_mma_pv.partition_B(sVt[None, None, 0]))
        acc_O = cute.make_rmem_tensor(thr_mma_pv.partition_shape_C((self.tile_m, self.tile_hdimv)), Float32)
        acc_O.fill(0.0)

        ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype)
        smem_thr_copy_Q = utils.make_tiled_copy_A(ldsm, tiled_mma_qk).get_slice(tidx)
        smem_thr_copy_K = utils.make_tiled_copy_B(ldsm, tiled_mma_qk).get_slice(tidx)
        smem_thr_copy_V = utils.make_tiled_copy_B(ldsm_t, tiled_mma_pv).get_slice(tidx)
        tSsQ = smem_thr_copy_Q.partition_S(sQ)
        tSsK = smem_thr_copy_K.partition_S(sK)
        tOsVt = smem_thr_copy_V.partition_S(sVt)

        softmax = Softmax.create(
            softmax_scale_log2, num_rows=acc_O.shape[0][0] * acc_O.shape[1], softmax_scale=softmax_scale
        )
        softmax.reset()
        mask = AttentionMask(
            self.tile_m, self.tile_n, seqlen, window_size_left, window_size_right, self.qhead_per_kvhead_packgqa
        )

        # P of the last processed n_block, bf16/fp16 in registers, the A operand of O += P V
        rP = cute.make_rmem_tensor(thr_mma_qk.partition_shape_C((self.tile_m, self.tile_n)), self.dtype)
        tOrP = layout_utils.reshape_acc_to_frgA(rP)

        pipeline_q.consumer_wait(q_state)
        if const_expr(self.Q_in_regs):
            # this warp's Q rows, once; sQ stays allocated for the epilogue's sO
            cute.copy(smem_thr_copy_Q, tSsQ, smem_thr_copy_Q.retile(tSrQ))
        # K and V rings advance in lockstep; with the overlap, V trails K by one n_block
        mma_wg = warp_idx // 4  # this warp's MMA warpgroup (the ping-pong turn it takes)
        if const_expr(self.pingpong):
            if mma_wg == 1:
                # warpgroup 0 takes the first turn
                cute.arch.barrier_arrive(
                    barrier_id=int(NamedBarrierFwd.WarpSchedulerWG1), number_of_threads=2 * WARPGROUP_THREADS
                )

        common = dict(
            pipeline_k=pipeline_k, pipeline_v=pipeline_v, thr_mma_qk=thr_mma_qk,
            tiled_mma_qk=tiled_mma_qk, tiled_mma_pv=tiled_mma_pv, tSrQ=tSrQ, tSrK=tSrK, tOrVt=tOrVt,
            tSsQ=tSsQ, tSsK=tSsK, tOsVt=tOsVt, smem_thr_copy_Q=smem_thr_copy_Q,
            smem_thr_copy_K=smem_thr_copy_K, smem_thr_copy_V=smem_thr_copy_V, acc_O=acc_O, rP=rP,
            tOrP=tOrP, softmax=softmax, mask=mask, seqlen=seqlen, m_block=m_block, head_idx=head_idx,
            batch_idx=batch_idx, aux_data=aux_data, fastdiv_mods=fastdiv_mods, mma_wg=mma_wg,
        )
        # one n_block: S = QK^T (+ the previous block's PV when overlapping), mask, softmax
        block = partial(self.mma_one_n_block, overlap=self.intra_warp_overlap, **common)

        if const_expr(lists is not None):
            sparse = lists()
            # causal/local masks (when the call has them) apply to every visited tile
            kv_k, kv_v = fwd_block_sparse.consume_tiles(
                sparse, partial(block, mask_causal_local=True), kv_k, kv_v, self.intra_warp_overlap,
                self.kv_subtile_factor,
            )
            if fwd_block_sparse.total_tiles(sparse) > 0:
                if const_expr(self.intra_warp_overlap):
                    self.mma_pv(kv_v, pipeline_v, tiled_mma_pv, acc_O, tOrP, tOrVt, tOsVt, smem_thr_copy_V)
                    kv_v.advance()
                else:
                    self._pingpong_arrive(mma_wg)  # the turn taken by the last block's PV
        elif n_block_max > n_block_min:
            # the last n_block first: it holds the seqlen_k boundary and the causal diagonal
            block(kv_k, kv_v, n_block_max - 1, is_first=True, mask_seqlen=True, mask_causal_local=True)
            kv_k.advance()
            if const_expr(not self.intra_warp_overlap):
                kv_v.advance()
            n_block_hi = n_block_max - 1
            if const_expr(self.is_causal or self.is_local):
                n_block_causal = block_info.get_n_block_min_causal_local_mask(seqlen, m_block, n_block_min)
                for n_tile in cutlass.range(n_block_hi - n_block_causal, unroll=1):
                    block(kv_k, kv_v, n_block_hi - 1 - n_tile, is_first=False, mask_seqlen=False, mask_causal_local=True)
                    kv_k.advance()
                    kv_v.advance()
                n_block_hi = cutlass.min(n_block_hi, n_block_causal)
            n_block_local = block_info.get_n_block_min_before_local_mask(seqlen, m_block, n_block_min)
            for n_tile in cutlass.range(n_block_hi - n_block_local, unroll=1):
                block(kv_k, kv_v, n_block_hi - 1 - n_tile, is_first=False, mask_seqlen=False, mask_causal_local=False)
                kv_k.advance()
                kv_v.advance()
            if const_expr(self.is_local and block_info.window_size_left is not None):
                n_block_hi = cutlass.min(n_block_hi, n_block_local)
                for n_tile in cutlass.range(n_block_hi - n_block_min, unroll=1):
                    block(kv_k, kv_v, n_block_hi - 1 - n_tile, is_first=False, mask_seqlen=False, mask_causal_local=True)
                    kv_k.advance()
                    kv_v.advance()
            if const_expr(self.intra_warp_overlap):
                # the PV product of the last n_block is still due
                self.mma_pv(kv_v, pipeline_v, tiled_mma_pv, acc_O, tOrP, tOrVt, tOsVt, smem_thr_copy_V)
                kv_v.advance()
            else:
                self._pingpong_arrive(mma_wg)  # the turn taken by the last block's PV

        # with a sink, the final softmax counts it (one more column per row, no value)
        if const_expr(self.has_sink):
            row_sinks = sink_fold.load_row_sinks(sink, thr_mma_pv, self.tile_m, self.tile_hdimv, m_block, head_idx,
                                                 self.qhead_per_kvhead, self.pack_gqa)
            row_scale = sink_fold.finalize_with_sinks(softmax, row_sinks)  # overflow-safe for any sink
        else:
            row_scale = softmax.finalize()
        softmax.rescale_O(acc_O, row_scale)
        self.epilogue(
            acc_O, softmax.row_sum, mO, mLSE, sO, tma_atom_O, thr_mma_pv, tiled_mma_pv, tidx, warp_idx,
            seqlen, m_block, head_idx, batch_idx,
        )
        if const_expr(self.persistent):
            # sO (= this tile's Q slot) is free for a later tile's Q: warp 0 has waited for the TMA store's reads
            self._release(pipeline_q, q_state)
        q_state.advance()
        return q_state, kv_k, kv_v

    @cute.jit
    def mma_one_n_block(
        self,
        kv_k: cpipeline.PipelineState,
        kv_v: cpipeline.PipelineState,
        n_block: Int32,
        pipeline_k: cpipeline.PipelineAsync,
        pipeline_v: cpipeline.PipelineAsync,
        thr_mma_qk: cute.ThrMma,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        tSrQ: cute.Tensor,
        tSrK: cute.Tensor,
        tOrVt: cute.Tensor,
        tSsQ: cute.Tensor,
        tSsK: cute.Tensor,
        tOsVt: cute.Tensor,
        smem_thr_copy_Q: cute.TiledCopy,
        smem_thr_copy_K: cute.TiledCopy,
        smem_thr_copy_V: cute.TiledCopy,
        acc_O: cute.Tensor,
        rP: cute.Tensor,
        tOrP: cute.Tensor,
        softmax: Softmax,
        mask: AttentionMask,
        seqlen: SeqlenInfoQK,
        m_block: Int32,
        head_idx: Int32,
        batch_idx: Int32,
        aux_data: AuxData,
        fastdiv_mods,
        mma_wg: Int32,
        overlap: cutlass.Constexpr[bool],
        is_first: cutlass.Constexpr[bool],
        mask_seqlen: cutlass.Constexpr[bool],
        mask_causal_local: cutlass.Constexpr[bool],
        use_mask_mod: cutlass.Constexpr[bool] = True,
    ):
        """One n_block. Without overlap: S = Q K^T, softmax, O = O * scale + P V (same block).

        With overlap (not for the first block): S_j = Q K_j^T and O += P_{j-1} V_{j-1} are issued
        back to back after both waits, then softmax_j; the straight-line body lets ptxas interleave
        the PV mma.sync of block j-1 with the exp2/max/sum of block j. O is rescaled after the
        PV product: P_{j-1} was taken against max_{j-1}, the scale moves all of O to max_j.

        Ping-pong (self.pingpong): each MMA burst is one turn, taken after the other warpgroup's
        turn ends, so one warpgroup's softmax runs under the other's mma.sync (FA3's scheduler
        barrier). With overlap the burst is QK^T_j + PV_{j-1} (the first block's QK^T runs
        untaken, as FA3's first half-block); without it the burst is PV_{j-1} + QK^T_j: the first
        block takes a turn before its QK^T, every block ends the turn after its QK^T and takes one
        before its PV, and the caller ends the last.
        """
        do_pv_first = const_expr(overlap and not is_first)
        acc_S = cute.make_rmem_tensor(thr_mma_qk.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        acc_S.fill(0.0)
        pipeline_k.consumer_wait(kv_k, pipeline_k.consumer_try_wait(kv_k))
        if const_expr(do_pv_first):
            pipeline_v.consumer_wait(kv_v, pipeline_v.consumer_try_wait(kv_v))
        if const_expr(do_pv_first or (is_first and not overlap)):
            self._pingpong_sync(mma_wg)
        apply_causal_local = const_expr(mask_causal_local and (self.is_causal or self.is_local))
        if const_expr(apply_causal_local and self.qk_half_slices_when_masked):
            gemm_ss_by_half_slices(
                thr_mma_qk, acc_S, tSrQ, tSrK, tSsQ, tSsK[None, None, None, kv_k.index], smem_thr_copy_Q, smem_thr_copy_K
            )
        else:
            sm80_utils.gemm(
                thr_mma_qk, acc_S, tSrQ, tSrK, tSsQ, tSsK[None, None, None, kv_k.index], smem_thr_copy_Q, smem_thr_copy_K,
                A_in_regs=self.Q_in_regs,
            )
        if const_expr(do_pv_first):
            sm80_utils.gemm_rs(tiled_mma_pv, acc_O, tOrP, tOrVt, tOsVt[None, None, None, kv_v.index], smem_thr_copy_V)
        if const_expr(do_pv_first or not overlap):
            self._pingpong_arrive(mma_wg)
        if const_expr(not overlap):
            self._release(pipeline_k, kv_k)

        if const_expr(self.score_mod is not None):
            self.apply_score_mod(
                thr_mma_qk, batch_idx, head_idx, m_block, acc_S, n_block,
                softmax_scale=softmax.softmax_scale, seqlen=seqlen, aux_data=aux_data, fastdiv_mods=fastdiv_mods,
            )
        mask_mod = self.mask_mod if const_expr(use_mask_mod) else None  # block sparsity's full tiles: none
        if const_expr(mask_seqlen or apply_causal_local or mask_mod is not None):
            mask.apply_mask(
                acc_S,
                batch_idx=batch_idx,
                head_idx=head_idx,
                m_block=m_block,
                n_block=n_block,
                thr_mma=thr_mma_qk,
                mask_seqlen=mask_seqlen,
                mask_causal=self.is_causal and apply_causal_local,
                mask_local=self.is_local and apply_causal_local,
                mask_mod=mask_mod,
                aux_data=aux_data,
                fastdiv_mods=fastdiv_mods if const_expr(mask_mod is not None) else None,
            )
        # a row max of -inf needs a causal/local mask, a mask_mod or a score_mod: with only the
        # seqlen_k mask, the first block (the last n_block) has a valid key in every row, so the
        # guard (a compare and select per row and block) is skipped
        may_be_inf = const_expr(
            self.is_causal or self.is_local or self.score_mod is not None or self.mask_mod is not None
        )
        row_scale = softmax.online_softmax(acc_S, is_first=is_first, check_inf=may_be_inf)
        if const_expr(not is_first):
            softmax.rescale_O(acc_O, row_scale)
        rP.store(acc_S.load().to(self.dtype))

        if const_expr(overlap):
            self._release(pipeline_k, kv_k)
            if const_expr(do_pv_first):
                self._release(pipeline_v, kv_v)
        else:
            self.mma_pv(kv_v, pipeline_v, tiled_mma_pv, acc_O, tOrP, tOrVt, tOsVt, smem_thr_copy_V, mma_wg)

    @cute.jit
    def _pingpong_sync(self, mma_wg: Int32):
        """Ping-pong: wait for this warpgroup's turn at the tensor pipe (no-op without it)."""
        if const_expr(self.pingpong):
            cute.arch.barrier(
                barrier_id=int(NamedBarrierFwd.WarpSchedulerWG1) + mma_wg, number_of_threads=2 * WARPGROUP_THREADS
            )

    @cute.jit
    def _pingpong_arrive(self, mma_wg: Int32):
        """Ping-pong: end this warpgroup's turn, handing it to the other (no-op without it)."""
        if const_expr(self.pingpong):
            cute.arch.barrier_arrive(
                barrier_id=int(NamedBarrierFwd.WarpSchedulerWG1) + 1 - mma_wg,
                number_of_threads=2 * WARPGROUP_THREADS,
            )

    @cute.jit
    def mma_pv(
        self,
        kv_v: cpipeline.PipelineState,
        pipeline_v: cpipeline.PipelineAsync,
        tiled_mma_pv: cute.TiledMma,
        acc_O: cute.Tensor,
        tOrP: cute.Tensor,
        tOrVt: cute.Tensor,
        tOsVt: cute.Tensor,
        smem_thr_copy_V: cute.TiledCopy,
        pingpong_wg: Optional[Int32] = None,
    ):
        """O += P V for the V slot of `kv_v`, then hand the slot back. `pingpong_wg`: take the
        warpgroup's ping-pong turn first (the plain order's PV; the overlap's last PV takes none)."""
        pipeline_v.consumer_wait(kv_v, pipeline_v.consumer_try_wait(kv_v))
        if const_expr(pingpong_wg is not None):
            self._pingpong_sync(pingpong_wg)
        if const_expr(self.pv_by_ldmatrix):
            gemm_rs_by_ldmatrix(tiled_mma_pv, acc_O, tOrP, tOrVt, tOsVt[None, None, None, kv_v.index], smem_thr_copy_V)
        else:
            sm80_utils.gemm_rs(tiled_mma_pv, acc_O, tOrP, tOrVt, tOsVt[None, None, None, kv_v.index], smem_thr_copy_V)
        self._release(pipeline_v, kv_v)

    @cute.jit
    def _release(self, pipeline: cpipeline.PipelineAsync, state: cpipeline.PipelineState):
        """Hand a K or V slot back to the producer after this warp's last ldmatrix from it.

        The slot was read through the generic proxy and the next TMA writes it through the async
        proxy: fence between them; one lane per warp arrives, so converge the warp first.
        """
        cute.arch.fence_view_async_shared()
        cute.arch.sync_warp()
        pipeline.consumer_release(state)
