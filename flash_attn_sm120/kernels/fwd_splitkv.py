"""SM120 forward, splitkv family: SplitKV and paged KV on the cp.async + mma.sync kernel.

Algorithm. The cp.async family's FlashAttention-2 mainloop (one CTA owns a tile_m x head_dim block
of Q and walks the K/V sequence backwards in tile_n blocks, online softmax in registers), with
two generalizations that upstream FA4 refuses on SM 12.0:

* SplitKV. The grid gets a split axis: CTA (m_block, head, split) walks only its share of the
  key blocks, [n_block_min, n_block_max) from `BlockInfo.get_n_block_min_max(is_split_kv=True)`
  (an even ceil-split of the blocks the mask leaves), and writes an *unnormalized-split*
  result: O_s = softmax_s(S) V in fp32 and LSE_s, into (num_splits, ...) partial tensors.
  Upstream's `FlashAttentionForwardCombine` then merges the splits:
  O = sum_s exp(LSE_s - LSE) O_s with LSE = log sum_s exp(LSE_s). A split left with no key
  blocks skips its loads and mainloop and writes LSE_s = -inf, which the combine weighs 0.
  The cp.async prefetch never reaches below the split's n_block_min, so splits read no
  key/value tile twice.
* Paged KV. K and V live in a cache of pages (num_pages, page_size, nheads_kv, d) addressed
  through an int32 page table (batch, max_pages). Each K/V tile is gathered row by row: every
  copy thread looks up the page of the rows it owns (token -> page_table[b, token // page_size],
  token % page_size), forms the row's global address and issues 16-byte cp.async into the same
  swizzled smem tile the dense path fills, so the MMA side is unchanged. Upstream's
  `PagedKVManager` (flash_attn/cute/paged_kv.py) does the lookups and the row gathers; it is
  used in its "V has the same gmem layout as K" mode (its `arch=90` flag: a layout flag here,
  no SM90 instruction is involved). Rows past the sequence are zero-filled (cp.async src-size 0),
  so garbage or NaN in unused page slots never reaches P @ V. Any page size works, because
  every row is addressed on its own; the host keeps it a multiple of 16 (<= 512).

Without splits (num_splits == 1) the output is written by upstream's bf16/fp16 epilogue, so the
paged path also serves plain paged attention. GQA packing (pack_gqa), causal / local masks,
varlen Q (cu_seqlens_q / seqused_q), varlen K (cu_seqlens_k, dense only) and seqused_k work as in
the cp.async family. Shared memory and its SM120-emulation padding are the cp.async family's.
A learnable sink is folded into the output tile before the epilogue (sink_fold.py), by split 0
only, so the combine counts it once per row.
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace
from typing import Callable, Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warp

from quack import layout_utils

from flash_attn.cute import ampere_helpers as sm80_utils
from flash_attn.cute import utils
from flash_attn.cute.block_info import BlockInfo
from flash_attn.cute.block_sparsity import BlockSparseTensors
from flash_attn.cute.cute_dsl_utils import assume_tensor_aligned
from flash_attn.cute.mask import AttentionMask
from flash_attn.cute.pack_gqa import PackGQA, pack_gqa_layout
from flash_attn.cute.seqlen_info import SeqlenInfoQK
from flash_attn.cute.softmax import Softmax
from flash_attn.cute.tile_scheduler import SingleTileScheduler, SingleTileVarlenScheduler, TileSchedulerArguments
from flash_attn.cute.utils import AuxData

from flash_attn_sm120.kernels import sink_fold
from flash_attn_sm120.kernels.fwd_cpasync import FlashAttentionForwardSm120CpAsync
from flash_attn_sm120.kernels.fwd_splitkv_paged import KVTileLoaders


class FlashAttentionForwardSm120SplitKV(KVTileLoaders, FlashAttentionForwardSm120CpAsync):
    """cp.async forward with a split axis (fp32 partial O/LSE) and paged K/V gathers.

    `is_split_kv`: compile-time; with it `mO` is the fp32 partial (num_splits, b, s, h, dv) (or
    (num_splits, total_q, h, dv) with cu_seqlens_q) and `mLSE` the partial (num_splits, b, h, s)
    (or (num_splits, h, total_q)); the split count is the runtime size of their first mode.
    Paging is on when a page table is passed (then mK/mV are (num_pages, page_size, h_kv, d)).
    """

    family = "splitkv"

    def __init__(self, *args, is_split_kv: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.is_split_kv = is_split_kv
        self.has_sink = False  # set at trace time by __call__

    # ------------------------------------------------------------------------------------------
    # host side: layouts, grid, launch
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        softmax_scale: Float32,
        mCuSeqlensQ: Optional[cute.Tensor] = None,
        mCuSeqlensK: Optional[cute.Tensor] = None,
        mSeqUsedQ: Optional[cute.Tensor] = None,
        mSeqUsedK: Optional[cute.Tensor] = None,
        mPageTable: Optional[cute.Tensor] = None,
        window_size_left: Int32 | int | None = None,
        window_size_right: Int32 | int | None = None,
        learnable_sink: Optional[cute.Tensor] = None,
        blocksparse_tensors: Optional[BlockSparseTensors] = None,
        aux_data: AuxData = AuxData(),
        mCuTotalMBlocks: Optional[cute.Tensor] = None,
        mCuTotalSplitsMBlocks: Optional[cute.Tensor] = None,
        stream: cuda.CUstream = None,
    ):
        self.has_sink = learnable_sink is not None
        assert blocksparse_tensors is None, "block sparsity is not supported by the SM120 splitkv kernel"
        if const_expr(mPageTable is not None):
            assert mCuSeqlensK is None, "paged KV cannot be combined with cu_seqlens_k"
        o_dtype = Float32 if const_expr(self.is_split_kv) else mQ.element_type
        if const_expr(mO.element_type != o_dtype):
            raise TypeError(f"output must be {o_dtype} (fp32 partials when split), got {mO.element_type}")
        self._check_type(
            *(t.element_type if t is not None else None
              for t in (mQ, mK, mV, mQ, mLSE, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK))
        )
        tiled_mma_qk, tiled_mma_pv = self._get_tiled_mma()
        self.num_mma_threads = tiled_mma_pv.size
        self.num_producer_threads = self.num_threads
        self.num_Q_load_threads = self.num_threads
        self.num_epilogue_threads = self.num_threads
        self.use_tma_O = False  # SM80-style epilogue: O through smem, then 16-byte global stores
        self._setup_attributes()
        SharedStorage = self._get_shared_storage_cls()
        mQ, mK, mV = [assume_tensor_aligned(t) for t in (mQ, mK, mV)]
        mO = assume_tensor_aligned(mO)
        varlen_q = mCuSeqlensQ is not None
        num_splits = mO.shape[0] if const_expr(self.is_split_kv) else Int32(1)
        # (b, s, h, d) -> (s, d, h, b); varlen (total, h, d) -> (total, d, h); paged K/V
        # (num_pages, page_size, h, d) -> (page_size, d, h, num_pages)
        Q_transpose = [1, 3, 2, 0] if const_expr(not varlen_q) else [0, 2, 1]
        KV_transpose = [1, 3, 2, 0] if const_expr(mCuSeqlensK is None) else [0, 2, 1]
        if const_expr(self.is_split_kv):
            O_transpose = [2, 4, 3, 1, 0] if const_expr(not varlen_q) else [1, 3, 2, 0]
            LSE_transpose = [3, 2, 1, 0] if const_expr(not varlen_q) else [2, 1, 0]
        else:
            O_transpose = Q_transpose
            LSE_transpose = [2, 1, 0] if const_expr(not varlen_q) else [1, 0]
        mQ = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=Q_transpose))
        mO = cute.make_tensor(mO.iterator, cute.select(mO.layout, mode=O_transpose))
        mK, mV = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=KV_transpose)) for t in (mK, mV)]
        if const_expr(mLSE is not None):
            mLSE = cute.make_tensor(mLSE.iterator, cute.select(mLSE.layout, mode=LSE_transpose))
        if const_expr(self.pack_gqa):
            nheads_kv = mK.shape[2]
            mQ = pack_gqa_layout(mQ, self.qhead_per_kvhead, nheads_kv, head_idx=2)
            mO = pack_gqa_layout(mO, self.qhead_per_kvhead, nheads_kv, head_idx=2)
            if const_expr(mLSE is not None):
                mLSE = pack_gqa_layout(mLSE, self.qhead_per_kvhead, nheads_kv, head_idx=1)
        if const_expr(varlen_q or mSeqUsedQ is not None):
            TileScheduler = SingleTileVarlenScheduler
        else:
            TileScheduler = SingleTileScheduler
        num_batch = mCuSeqlensQ.shape[0] - 1 if const_expr(varlen_q) else cute.size(mQ.shape[3])
        tile_sched_args = TileSchedulerArguments(
            num_block=cute.ceil_div(cute.size(mQ.shape[0]), self.tile_m),
            num_head=cute.size(mQ.shape[2]),
            num_batch=num_batch,
            num_splits=num_splits,
            seqlen_k=0,
            headdim=mQ.shape[1],
            headdim_v=mV.shape[1],
            total_q=cute.size(mQ.shape[0]) if const_expr(varlen_q) else cute.size(mQ.shape[0]) * cute.size(mQ.shape[3]),
            tile_shape_mn=(self.tile_m, self.tile_n),
            qhead_per_kvhead_packgqa=self.qhead_per_kvhead if const_expr(self.pack_gqa) else 1,
            mCuSeqlensQ=mCuSeqlensQ,
            mSeqUsedQ=mSeqUsedQ,
            is_split_kv=self.is_split_kv,
            cu_total_m_blocks_ptr=mCuTotalMBlocks,
            cu_total_splits_m_blocks_ptr=mCuTotalSplitsMBlocks,
        )
        tile_sched_params = TileScheduler.to_underlying_arguments(tile_sched_args)
        grid_dim = TileScheduler.get_grid_shape(tile_sched_params)
        softmax_scale_log2, softmax_scale = utils.compute_softmax_scale_log2(softmax_scale, self.score_mod)
        fastdiv_mods = utils.compute_fastdiv_mods(
            mQ, mK, self.qhead_per_kvhead, self.pack_gqa, aux_data.tensors, mPageTable
        )
        aux_data = sink_fold.with_sink(aux_data, learnable_sink)  # the sink rides with the aux tensors
        self.kernel(
            mQ, mK, mV, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, mPageTable, num_splits,
            softmax_scale_log2, softmax_scale, window_size_left, window_size_right,
            self.sQ_layout, self.sK_layout, self.sV_layout, self.sO_layout,
            self.gmem_tiled_copy_Q, self.gmem_tiled_copy_K, self.gmem_tiled_copy_V, self.gmem_tiled_copy_O,
            tiled_mma_qk, tiled_mma_pv, SharedStorage, tile_sched_params, TileScheduler,
            aux_data, fastdiv_mods,
        ).launch(grid=grid_dim, block=[self.num_threads, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream)

    # ------------------------------------------------------------------------------------------
    # device side
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        mCuSeqlensQ: Optional[cute.Tensor],
        mCuSeqlensK: Optional[cute.Tensor],
        mSeqUsedQ: Optional[cute.Tensor],
        mSeqUsedK: Optional[cute.Tensor],
        mPageTable: Optional[cute.Tensor],
        num_splits: Int32,
        softmax_scale_log2: Float32,
        softmax_scale: Optional[Float32],
        window_size_left: Optional[Int32],
        window_size_right: Optional[Int32],
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        gmem_tiled_copy_Q: cute.TiledCopy,
        gmem_tiled_copy_K: cute.TiledCopy,
        gmem_tiled_copy_V: cute.TiledCopy,
        gmem_tiled_copy_O: cute.TiledCopy,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
        tile_sched_params,
        TileScheduler: cutlass.Constexpr[Callable],
        aux_data: AuxData = AuxData(),
        fastdiv_mods=None,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        tile_scheduler = TileScheduler.create(tile_sched_params)
        work_tile = tile_scheduler.initial_work_tile_info()
        aux_data, sink = sink_fold.split_sink(aux_data, self.has_sink)
        if work_tile.is_valid_tile:
            m_block, head_idx, batch_idx, split_idx = work_tile.tile_idx
            packgqa_rows = self.qhead_per_kvhead if const_expr(self.pack_gqa) else 1
            block_info = BlockInfo(
                self.tile_m, self.tile_n, self.is_causal, self.is_local, self.is_split_kv,
                window_size_left, window_size_right,
                qhead_per_kvhead_packgqa=packgqa_rows, num_splits=num_splits,
            )
            # paged: the static K length is what one page-table row can address
            seqlen = SeqlenInfoQK.create(
                batch_idx=batch_idx,
                seqlen_q_static=mQ.shape[0] if const_expr(not self.pack_gqa) else mQ.shape[0][1],
                seqlen_k_static=mK.shape[0] if const_expr(mPageTable is None) else mK.shape[0] * mPageTable.shape[1],
                mCuSeqlensQ=mCuSeqlensQ,
                mCuSeqlensK=mCuSeqlensK,
                mSeqUsedQ=mSeqUsedQ,
                mSeqUsedK=mSeqUsedK,
            )
            n_block_min, n_block_max = block_info.get_n_block_min_max(seqlen, m_block, split_idx, num_splits)
            head_idx_kv = head_idx if const_expr(self.pack_gqa) else head_idx // self.qhead_per_kvhead

            # shared memory
            storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
            sQ = storage.sQ.get_tensor(sQ_layout)
            sK = storage.sK.get_tensor(sK_layout)
            if const_expr(not self.Q_in_regs):
                sV = storage.sV.get_tensor(sV_layout)
            else:
                sV = cute.make_tensor(cute.recast_ptr(sQ.iterator, dtype=self.dtype), sV_layout)
            sVt = layout_utils.transpose_view(sV)  # (head_dim_v, tile_n) view for the PV MMA

            # MMA partitions and accumulators
            thr_mma_qk = tiled_mma_qk.get_slice(tidx)
            thr_mma_pv = tiled_mma_pv.get_slice(tidx)
            tSrQ = thr_mma_qk.make_fragment_A(thr_mma_qk.partition_A(sQ))
            tSrK = thr_mma_qk.make_fragment_B(thr_mma_qk.partition_B(sK[None, None, 0]))
            tOrVt = thr_mma_pv.make_fragment_B(thr_mma_pv.partition_B(sVt[None, None, 0]))
            acc_O = cute.make_rmem_tensor(thr_mma_pv.partition_shape_C((self.tile_m, self.tile_hdimv)), Float32)
            acc_O.fill(0.0)
            softmax = Softmax.create(
                softmax_scale_log2, num_rows=acc_O.shape[0][0] * acc_O.shape[1], softmax_scale=softmax_scale
            )
            softmax.reset()
            row_sinks = None
            if const_expr(self.has_sink):  # loaded now, its latency hidden by the mainloop
                row_sinks = sink_fold.load_row_sinks(sink, thr_mma_pv, self.tile_m, self.tile_hdimv, m_block, head_idx,
                                                     self.qhead_per_kvhead, self.pack_gqa)

            if n_block_min < n_block_max:
                self.attend(
                    mQ, mK, mV, mPageTable, sQ, sK, sV, sVt, tSrQ, tSrK, tOrVt, acc_O,
                    softmax, seqlen, block_info, n_block_min, n_block_max, m_block, head_idx, head_idx_kv,
                    batch_idx, window_size_left, window_size_right, gmem_tiled_copy_Q, gmem_tiled_copy_K,
                    gmem_tiled_copy_V, tiled_mma_qk, tiled_mma_pv, thr_mma_qk, thr_mma_pv, tidx,
                    aux_data, fastdiv_mods,
                )
            # A CTA with no key blocks (an empty split, seqlen_k == 0) keeps row_sum == 0: the
            # finalize below gives O = 0 and LSE = -inf for it.
            row_scale = softmax.finalize()
            softmax.rescale_O(acc_O, row_scale)
            if const_expr(self.has_sink):  # once per row: in split 0 only, the combine adds the splits up
                sink_fold.fold_sink(acc_O, softmax.row_sum, row_sinks,
                                    active=split_idx == 0 if const_expr(self.is_split_kv) else True)
            if const_expr(self.is_split_kv):
                self.epilogue_partial(
                    acc_O, softmax.row_sum, mO, mLSE, seqlen, thr_mma_pv, m_block, head_idx, batch_idx, split_idx
                )
            else:
                sO = cute.make_tensor(sQ.iterator, sO_layout)
                self.epilogue(
                    acc_O, softmax.row_sum, mO, mLSE, sO, seqlen, gmem_tiled_copy_O, None, tiled_mma_pv,
                    tidx, m_block, head_idx, batch_idx,
                )

    @cute.jit
    def attend(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mPageTable: Optional[cute.Tensor],
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        sVt: cute.Tensor,
        tSrQ: cute.Tensor,
        tSrK: cute.Tensor,
        tOrVt: cute.Tensor,
        acc_O: cute.Tensor,
        softmax: Softmax,
        seqlen: SeqlenInfoQK,
        block_info: BlockInfo,
        n_block_min: Int32,
        n_block_max: Int32,
        m_block: Int32,
        head_idx: Int32,
        head_idx_kv: Int32,
        batch_idx: Int32,
        window_size_left: Optional[Int32],
        window_size_right: Optional[Int32],
        gmem_tiled_copy_Q: cute.TiledCopy,
        gmem_tiled_copy_K: cute.TiledCopy,
        gmem_tiled_copy_V: cute.TiledCopy,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        thr_mma_qk,
        thr_mma_pv,
        tidx: Int32,
        aux_data: AuxData,
        fastdiv_mods,
    ):
        """Load Q, stream the key blocks [n_block_min, n_block_max) through smem, accumulate O."""
        load_K, load_V, fetch_pages = self.make_kv_loaders(
            mK, mV, mPageTable, sK, sV, seqlen, head_idx_kv, batch_idx, gmem_tiled_copy_K, gmem_tiled_copy_V, tidx,
        )
        # smem -> register copies feeding mma.sync
        smem_copy_atom_QK = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        smem_copy_atom_V = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype)
        smem_thr_copy_Q = utils.make_tiled_copy_A(smem_copy_atom_QK, tiled_mma_qk).get_slice(tidx)
        smem_thr_copy_K = utils.make_tiled_copy_B(smem_copy_atom_QK, tiled_mma_qk).get_slice(tidx)
        smem_thr_copy_V = utils.make_tiled_copy_B(smem_copy_atom_V, tiled_mma_pv).get_slice(tidx)
        mma = SimpleNamespace(thr_mma_qk=thr_mma_qk, thr_mma_pv=thr_mma_pv, tSrQ=tSrQ, tSrK=tSrK, tOrVt=tOrVt, acc_O=acc_O)
        smem = SimpleNamespace(
            smem_thr_copy_Q=smem_thr_copy_Q, smem_thr_copy_K=smem_thr_copy_K, smem_thr_copy_V=smem_thr_copy_V,
            tSsQ=smem_thr_copy_Q.partition_S(sQ), tSsK=smem_thr_copy_K.partition_S(sK),
            tOsVt=smem_thr_copy_V.partition_S(sVt),
        )
        mask = AttentionMask(
            self.tile_m, self.tile_n, seqlen, window_size_left, window_size_right,
            self.qhead_per_kvhead if const_expr(self.pack_gqa) else 1,
        )
        mask_fn = partial(
            mask.apply_mask, batch_idx=batch_idx, head_idx=head_idx, m_block=m_block, thr_mma=thr_mma_qk,
            mask_causal=self.is_causal, mask_local=self.is_local, mask_mod=self.mask_mod, aux_data=aux_data,
            fastdiv_mods=fastdiv_mods if const_expr(self.mask_mod is not None) else None,
        )
        step = partial(
            self.compute_one_n_block_split, n_block_min=n_block_min, mma_params=mma, smem_copy_params=smem,
            softmax=softmax, load_K=load_K, load_V=load_V, fetch_pages=fetch_pages, score_mod=self.score_mod,
            batch_idx=batch_idx,
            head_idx=head_idx, m_block=m_block, seqlen=seqlen, aux_data=aux_data, fastdiv_mods=fastdiv_mods,
        )

        # prologue: Q, then the first num_stages K (and num_stages - 1 V) tiles of this split
        mQ_cur = seqlen.offset_batch_Q(mQ, batch_idx, dim=3)[None, None, head_idx]
        gmem_thr_copy_Q = gmem_tiled_copy_Q.get_slice(tidx)
        if const_expr(not self.pack_gqa):
            gQ = cute.local_tile(mQ_cur, (self.tile_m, self.tile_hdim), (m_block, 0))
            self.load_Q(gmem_thr_copy_Q, gQ, sQ, m_block, seqlen=seqlen.seqlen_q, headdim=mQ.shape[1])
        else:
            PackGQA(self.tile_m, self.tile_hdim, self.check_hdim_oob, self.qhead_per_kvhead).load_Q(
                mQ_cur, sQ, gmem_tiled_copy_Q, tidx, m_block, seqlen.seqlen_q
            )
        cute.arch.cp_async_commit_group()

        def preprocess_Q():
            cute.arch.cp_async_wait_group(self.num_stages * 2 - 1)
            if const_expr(self.Q_in_regs):
                cute.arch.barrier()
                cute.copy(smem_thr_copy_Q, smem.tSsQ, smem_thr_copy_Q.retile(tSrQ))

        n_block = n_block_max - 1
        if const_expr(self.Q_in_regs):
            if const_expr(fetch_pages is not None):
                fetch_pages(n_block)
            load_K(n_block, 0, need_predicates=True)
            cute.arch.cp_async_commit_group()
            preprocess_Q()
            cute.arch.barrier()  # every thread has read sQ before V overwrites it
        for stage in cutlass.range_constexpr(self.num_stages):
            if const_expr(not self.Q_in_regs or stage > 0):
                if stage == 0 or n_block - stage >= n_block_min:
                    if const_expr(fetch_pages is not None):
                        fetch_pages(n_block - stage)
                    load_K(n_block - stage, stage, need_predicates=stage == 0)
                cute.arch.cp_async_commit_group()
            if const_expr(stage < self.num_stages - 1):
                if stage == 0 or n_block - stage >= n_block_min:
                    load_V(n_block - stage, stage, need_predicates=stage == 0)
                cute.arch.cp_async_commit_group()
        if const_expr(not self.Q_in_regs):
            preprocess_Q()

        # mainloop, key blocks walked backwards:
        #   n_block_max - 1           seqlen (+ causal/local) mask
        #   ... >= n_min_causal        causal/local mask (diagonal band)
        #   ... >= n_min_before_local  no mask
        #   ... >= n_block_min         local mask (left window edge)
        read = Int32(0)
        write = Int32(self.num_stages - 1)
        step(n_block, read, write, is_first_n_block=True, mask_fn=partial(mask_fn, mask_seqlen=True))
        read = self.advance_pipeline(read)
        write = self.advance_pipeline(write)
        next_block = n_block - 1
        if const_expr(self.is_causal or self.is_local):
            n_min_causal = block_info.get_n_block_min_causal_local_mask(seqlen, m_block, n_block_min)
            for i in cutlass.range(cutlass.max(next_block - n_min_causal + 1, 0), unroll=1):
                step(next_block - i, read, write, mask_fn=partial(mask_fn, mask_seqlen=False))
                read = self.advance_pipeline(read)
                write = self.advance_pipeline(write)
            next_block = cutlass.min(next_block, n_min_causal - 1)
        n_min_before_local = block_info.get_n_block_min_before_local_mask(seqlen, m_block, n_block_min)
        # a mask_mod masks every block (found by the fuzz harness: interior blocks of a split went unmasked)
        interior_mask = partial(mask_fn, mask_seqlen=False) if const_expr(self.mask_mod is not None) else None
        for i in cutlass.range(cutlass.max(next_block - n_min_before_local + 1, 0), unroll=1):
            step(next_block - i, read, write, mask_fn=interior_mask)
            read = self.advance_pipeline(read)
            write = self.advance_pipeline(write)
        if const_expr(self.is_local):
            next_block = cutlass.min(next_block, n_min_before_local - 1)
            for i in cutlass.range(cutlass.max(next_block - n_block_min + 1, 0), unroll=1):
                step(next_block - i, read, write, mask_fn=partial(mask_fn, mask_seqlen=False))
                read = self.advance_pipeline(read)
                write = self.advance_pipeline(write)

    @cute.jit
    def compute_one_n_block_split(
        self,
        n_block: Int32,
        smem_pipe_read: Int32,
        smem_pipe_write: Int32,
        n_block_min: Int32,
        mma_params: SimpleNamespace,
        smem_copy_params: SimpleNamespace,
        softmax: Softmax,
        load_K: Callable,
        load_V: Callable,
        fetch_pages: Optional[Callable],
        score_mod: Callable | None,
        batch_idx: Int32,
        head_idx: Int32,
        m_block: Int32,
        seqlen: SeqlenInfoQK,
        aux_data: AuxData = AuxData(),
        fastdiv_mods=None,
        mask_fn: Optional[Callable] = None,
        is_first_n_block: cutlass.Constexpr = False,
    ):
        """One key block: S = Q K^T, mask, online softmax, O += P V, with the next tiles' cp.async
        issued in between. Prefetches stop at n_block_min (the split's first block)."""

        def sync():
            cute.arch.cp_async_wait_group(self.num_stages * 2 - 2)
            cute.arch.barrier()

        stage_read = smem_pipe_read if const_expr(self.num_stages > 1) else 0
        acc_S = cute.make_rmem_tensor(mma_params.thr_mma_qk.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        acc_S.fill(0.0)
        sync()  # K[n_block] is in smem

        if const_expr(self.num_stages == 1) or n_block - self.num_stages + 1 >= n_block_min:
            load_V(n_block - self.num_stages + 1, smem_pipe_write, need_predicates=is_first_n_block and self.num_stages == 1)
        cute.arch.cp_async_commit_group()
        if const_expr(fetch_pages is not None):
            # pages of K[n_block - num_stages] (and later V), read while the MMAs below run
            if n_block - self.num_stages >= n_block_min:
                fetch_pages(n_block - self.num_stages)
        sm80_utils.gemm(
            mma_params.thr_mma_qk, acc_S, mma_params.tSrQ, mma_params.tSrK,
            smem_copy_params.tSsQ, smem_copy_params.tSsK[None, None, None, stage_read],
            smem_copy_params.smem_thr_copy_Q, smem_copy_params.smem_thr_copy_K, A_in_regs=self.Q_in_regs,
        )
        if const_expr(score_mod is not None):
            self.apply_score_mod(
                mma_params.thr_mma_qk, batch_idx, head_idx, m_block, acc_S, n_block,
                softmax_scale=softmax.softmax_scale, seqlen=seqlen, aux_data=aux_data, fastdiv_mods=fastdiv_mods,
            )
        next_write = self.advance_pipeline(smem_pipe_write)

        def load_K_next():
            if n_block - self.num_stages >= n_block_min:
                load_K(n_block - self.num_stages, next_write, need_predicates=False)
            cute.arch.cp_async_commit_group()

        if const_expr(self.num_stages == 1):
            sync()  # V[n_block] is in smem, every warp is done reading K
            load_K_next()
        if const_expr(mask_fn is not None):
            mask_fn(acc_S, n_block=n_block)
        row_scale = softmax.online_softmax(acc_S, is_first=is_first_n_block, check_inf=True)
        softmax.rescale_O(mma_params.acc_O, row_scale)
        rP = cute.make_fragment_like(acc_S, self.dtype)
        rP.store(acc_S.load().to(self.dtype))
        if const_expr(self.num_stages > 1):
            sync()
            load_K_next()
        sm80_utils.gemm_rs(
            mma_params.thr_mma_pv, mma_params.acc_O, layout_utils.reshape_acc_to_frgA(rP), mma_params.tOrVt,
            smem_copy_params.tOsVt[None, None, None, stage_read], smem_copy_params.smem_thr_copy_V,
        )

    @cute.jit
    def epilogue_partial(
        self,
        acc_O: cute.Tensor,
        lse: cute.Tensor,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        seqlen: SeqlenInfoQK,
        thr_mma_pv,
        m_block: Int32,
        head_idx: Int32,
        batch_idx: Int32,
        split_idx: Int32,
    ):
        """fp32 O_s and LSE_s of one split, straight from the accumulators to global memory.

        Each thread stores its accumulator pairs (two adjacent columns, 8 B); a quad covers 32
        contiguous bytes of a row, so every store instruction fills whole 32 B sectors.
        """
        rows_valid = seqlen.seqlen_q * (self.qhead_per_kvhead if const_expr(self.pack_gqa) else 1) - m_block * self.tile_m
        cO = cute.make_identity_tensor((self.tile_m, self.tile_hdimv))
        tOcO = layout_utils.reshape_acc_to_mn(thr_mma_pv.partition_C(cO))
        t0OcO = layout_utils.reshape_acc_to_mn(thr_mma_pv.get_slice(0).partition_C(cO))
        acc_O_mn = layout_utils.reshape_acc_to_mn(acc_O)
        num_rows, num_cols = cute.size(acc_O_mn, mode=[0]), cute.size(acc_O_mn, mode=[1])
        assert num_cols % 2 == 0
        for c in cutlass.range_constexpr(0, num_cols, 2):
            assert t0OcO[0, c + 1][1] == t0OcO[0, c][1] + 1, "accumulator column pairs must be adjacent"
        mO_cur = seqlen.offset_batch_Q(mO, batch_idx, dim=3)[None, None, head_idx, split_idx]
        for r in cutlass.range_constexpr(num_rows):
            row = tOcO[r, 0][0]
            if row < rows_valid:
                row_ptr_base = self._row_coord(m_block * self.tile_m + row)
                for c in cutlass.range_constexpr(0, num_cols, 2):
                    col = tOcO[r, c][1]
                    if const_expr(not self.check_hdim_v_oob) or col < mO.shape[1]:
                        ptr = utils.elem_pointer(mO_cur, (row_ptr_base, col))
                        dst = cute.make_tensor(
                            cute.make_ptr(Float32, ptr.toint(), cute.AddressSpace.gmem, assumed_align=8),
                            cute.make_layout(2),
                        )
                        pair = cute.make_rmem_tensor(2, Float32)
                        pair[0] = acc_O_mn[r, c]
                        pair[1] = acc_O_mn[r, c + 1]
                        cute.autovec_copy(pair, dst)
        if const_expr(mLSE is not None):
            mLSE_cur = seqlen.offset_batch_Q(mLSE, batch_idx, dim=2)[None, head_idx, split_idx]
            # the thread holding column 0 of a row writes its LSE
            if tOcO[0, 0][1] == 0:
                for r in cutlass.range_constexpr(num_rows):
                    row = tOcO[r, 0][0]
                    if row < rows_valid:
                        ptr = utils.elem_pointer(mLSE_cur, (self._row_coord(m_block * self.tile_m + row),))
                        cute.make_tensor(ptr, (1,))[0] = lse[r]

    @cute.jit
    def _row_coord(self, packed_row: Int32):
        """Coordinate of a tile row in mode 0 of Q/O/LSE: (q_head, token) when GQA is packed."""
        if const_expr(self.pack_gqa):
            token = packed_row // self.qhead_per_kvhead
            return (packed_row - token * self.qhead_per_kvhead, token)
        return packed_row
