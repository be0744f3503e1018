"""The TMA forward's kernel entry: what the whole CTA sets up before its warps split into roles.

Every warp of the CTA runs `kernel` from the top:

  1. the producer warp prefetches the four TMA descriptors (Q, K, V loads and the O store);
  2. shared memory is carved as the SharedStorage struct (fwd_tma.py: sQ/sO, sK, sV, mbarriers);
  3. three mbarrier pipelines are made (`make_tma_pipeline`, cutlass' PipelineTmaAsync): Q with
     `q_stages` slots (1, or 2 for a persistent CTA that loads the next tile's Q early), K and V with
     `num_stages` slots each. A full barrier expects one producer arrive plus
     the operand's TMA transaction bytes; an empty barrier expects one arrive per MMA warp (lane 0
     after the warp converges). The inits are deferred and made visible once for all three
     (pipeline_init_arrive / pipeline_init_wait: one CTA sync);
  4. the roles split: warps from `producer_warp_idx` on drop their registers (setmaxnreg.dec), the
     MMA warps raise theirs (setmaxnreg.inc);
  5. each role then asks the tile scheduler for this CTA's (m_block, head, batch) tile (varlen q:
     SingleTileVarlenScheduler over each sequence's own M tiles) and makes SeqlenInfoQK (the
     sequence's offsets and lengths: cu_seqlens / seqused) and BlockInfo (its n_block range; with
     block sparsity, `lists` reads the tile's K/V lists: fwd_block_sparse.py) in `_tile_setup`. After
     setmaxnreg, not before: values live across it are spilled around the register reallocation.
     The first producer warp runs `load` (fwd_tma_producer.py); the MMA warps run `mma`
     (fwd_tma_mainloop.py), which ends in `epilogue` (fwd_tma_epilogue.py);
  6. persistent (FwdConfig.persistent, persistent_scheduler.py): steps 5's tile setup, `load` and `mma`
     repeat for each tile the scheduler hands this CTA, the pipeline states carried from one tile to the
     next (the MMA warps release the Q slot after the epilogue's store has read sO, which is the tile's
     own Q slot). With two Q slots the producer loads tile i+1's Q into the other slot while tile i
     runs. Dynamic (FwdConfig.dynamic): the producer takes each next tile from the call's counter and
     hands its decoded coordinates to the MMA warps beside the tile's Q slot (`sTile`: m_block, head,
     batch, valid), so the MMA warps keep no scheduler state across tiles. Otherwise each CTA runs one
     tile, and the same code runs once.

A mixin of FlashAttentionForwardSm120Tma: it reads the attributes that the class's constructor and
host side set (tile sizes, `registers`, `tma_copy_bytes`, `num_mma_warps`).
"""

from functools import partial
from typing import Callable, Optional

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as cpipeline
from cutlass import Float32, Int32, const_expr
from cutlass.cute import FastDivmodDivisorV2
from cutlass.cute.nvgpu import cpasync
from flash_attn.cute.block_info import BlockInfo
from flash_attn.cute.block_sparsity import BlockSparseTensors
from flash_attn.cute.seqlen_info import SeqlenInfoQK
from flash_attn.cute.tile_scheduler import WorkTileInfo
from flash_attn.cute.utils import AuxData

from flash_attn_sm120.kernels import fwd_block_sparse
from flash_attn_sm120.kernels.persistent_scheduler import fetch_next_tile


class TmaKernelMixin:
    """The kernel entry of FlashAttentionForwardSm120Tma: pipelines, tile, role split (module docstring)."""

    def make_tma_pipeline(self, barriers, num_stages: int, operand: str, producer, consumers):
        """One mbarrier ring (trace-time helper): full barriers expect one TMA arrive plus the
        operand's transaction bytes, empty barriers one arrive per MMA warp. Barrier init is
        deferred to the kernel's single pipeline_init_arrive / pipeline_init_wait."""
        return cpipeline.PipelineTmaAsync.create(
            barrier_storage=barriers.data_ptr(),
            num_stages=num_stages,
            producer_group=producer,
            consumer_group=consumers,
            tx_count=self.tma_copy_bytes[operand],
            defer_sync=True,
        )

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        tma_atom_Q: cute.CopyAtom,
        tma_atom_K: cute.CopyAtom,
        tma_atom_V: cute.CopyAtom,
        tma_atom_O: cute.CopyAtom,
        softmax_scale_log2: Float32,
        softmax_scale: Optional[Float32],
        window_size_left: Optional[Int32],
        window_size_right: Optional[Int32],
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
        tile_sched_params,
        TileScheduler: cutlass.Constexpr[Callable],
        aux_data: AuxData = AuxData(),
        fastdiv_mods=None,
        blocksparse_tensors: Optional[BlockSparseTensors] = None,
        mCuSeqlensQ: Optional[cute.Tensor] = None,
        mCuSeqlensK: Optional[cute.Tensor] = None,
        mSeqUsedQ: Optional[cute.Tensor] = None,
        mSeqUsedK: Optional[cute.Tensor] = None,
        mTileCounter: Optional[cute.Tensor] = None,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == self.producer_warp_idx:
            for tma_atom in (tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O):
                cpasync.prefetch_descriptor(tma_atom)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)

        # full barriers: one TMA arrive + transaction bytes; empty barriers: one arrive per MMA warp
        producer = cpipeline.CooperativeGroup(cpipeline.Agent.Thread, 1)
        consumers = cpipeline.CooperativeGroup(cpipeline.Agent.Thread, self.num_mma_warps)
        pipeline_q = self.make_tma_pipeline(storage.mbar_Q, self.q_stages, "Q", producer, consumers)
        pipeline_k = self.make_tma_pipeline(storage.mbar_K, self.num_stages, "K", producer, consumers)
        pipeline_v = self.make_tma_pipeline(storage.mbar_V, self.num_stages, "V", producer, consumers)
        # make the mbarrier inits visible to the async proxy, then sync the CTA once
        cpipeline.pipeline_init_arrive()
        cpipeline.pipeline_init_wait()

        # with two Q slots, sQ and sO have a stage mode: each role takes the tile's slot (`q_slot`)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sO = storage.sQ.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        # dynamic: (m_block, head, batch, valid) of the tile in each Q slot
        sTile = storage.tile_slots.get_tensor(cute.make_layout((4, self.q_stages if const_expr(self.dynamic) else 1)))

        # each role asks the scheduler for its tile and makes the tile's sequence info after its setmaxnreg:
        # values live across the register reallocation are spilled around it (varlen lengths and the varlen
        # scheduler's decode are loads and divisions, not kernel parameters)
        tile_scheduler = TileScheduler.create(tile_sched_params)  # the tile's decode waits for the roles
        setup = partial(
            self._tile_setup, mQ, mK, window_size_left=window_size_left, window_size_right=window_size_right,
            fastdiv_mods=fastdiv_mods, blocksparse_tensors=blocksparse_tensors, mCuSeqlensQ=mCuSeqlensQ,
            mCuSeqlensK=mCuSeqlensK, mSeqUsedQ=mSeqUsedQ, mSeqUsedK=mSeqUsedK,
        )
        if warp_idx >= self.producer_warp_idx:
            if const_expr(self.registers.producer_regs is not None):
                cute.arch.setmaxregister_decrease(self.registers.producer_regs)
            if warp_idx == self.producer_warp_idx:
                # persistent: the rings' states run on across tiles
                q_state = cpipeline.make_pipeline_state(cpipeline.PipelineUserType.Producer, self.q_stages)
                kv_state = cpipeline.make_pipeline_state(cpipeline.PipelineUserType.Producer, self.num_stages)
                load = partial(
                    self.load, mQ, mK, mV, sQ, sK, sV, tma_atom_Q, tma_atom_K, tma_atom_V,
                    pipeline_q, pipeline_k, pipeline_v,
                )
                work_tile = tile_scheduler.initial_work_tile_info()
                if const_expr(self.persistent):
                    while work_tile.is_valid_tile:
                        m_block, head_idx, batch_idx, _ = work_tile.tile_idx
                        seqlen, _, n_block_min, n_block_max, lists, _ = setup(
                            m_block=m_block, head_idx=head_idx, batch_idx=batch_idx)
                        # dynamic: the tile's coordinates go beside its Q slot for the MMA warps
                        q_state, kv_state = load(m_block, head_idx, batch_idx, n_block_min, n_block_max, lists,
                                                 seqlen, q_state, kv_state,
                                                 tile_slot=(sTile, work_tile) if const_expr(self.dynamic) else None)
                        if const_expr(self.dynamic):
                            # the next tile as soon as this one's loads are issued (persistent_scheduler.py)
                            tile_scheduler._tile_idx = fetch_next_tile(mTileCounter, cute.arch.grid_dim()[0])
                            work_tile = tile_scheduler.get_current_work()
                        else:
                            work_tile = tile_scheduler.advance_to_next_work()
                    if const_expr(self.dynamic):
                        # past the last tile: an invalid entry and an arrive without a load end the MMA warps' loop
                        self.signal_last_tile(pipeline_q, q_state, sTile)
                elif work_tile.is_valid_tile:
                    m_block, head_idx, batch_idx, _ = work_tile.tile_idx
                    seqlen, _, n_block_min, n_block_max, lists, _ = setup(
                        m_block=m_block, head_idx=head_idx, batch_idx=batch_idx)
                    load(m_block, head_idx, batch_idx, n_block_min, n_block_max, lists, seqlen, q_state, kv_state)
        else:
            if const_expr(self.registers.mma_regs is not None):
                cute.arch.setmaxregister_increase(self.registers.mma_regs)
            tidx, _, _ = cute.arch.thread_idx()
            q_state = cpipeline.make_pipeline_state(cpipeline.PipelineUserType.Consumer, self.q_stages)
            kv_k = cpipeline.make_pipeline_state(cpipeline.PipelineUserType.Consumer, self.num_stages)
            kv_v = cpipeline.make_pipeline_state(cpipeline.PipelineUserType.Consumer, self.num_stages)
            mma = partial(
                self.mma, mO, mLSE, sQ, sK, sV, sO, tma_atom_O, pipeline_q, pipeline_k, pipeline_v,
                tiled_mma_qk, tiled_mma_pv, tidx, warp_idx, softmax_scale_log2, softmax_scale,
            )
            work_tile = tile_scheduler.initial_work_tile_info()
            if const_expr(self.persistent):
                if const_expr(self.dynamic):  # the tile whose Q lands next, as the producer wrote it
                    work_tile = self.next_tile_from_slot(pipeline_q, q_state, sTile)
                while work_tile.is_valid_tile:
                    m_block, head_idx, batch_idx, _ = work_tile.tile_idx
                    seqlen, block_info, n_block_min, n_block_max, lists, tile_fastdiv_mods = setup(
                        m_block=m_block, head_idx=head_idx, batch_idx=batch_idx)
                    q_state, kv_k, kv_v = mma(
                        block_info, seqlen, window_size_left, window_size_right,
                        m_block, head_idx, batch_idx, n_block_min, n_block_max,
                        aux_data, tile_fastdiv_mods, lists, q_state, kv_k, kv_v,
                    )
                    if const_expr(self.dynamic):
                        work_tile = self.next_tile_from_slot(pipeline_q, q_state, sTile)
                    else:
                        work_tile = tile_scheduler.advance_to_next_work()
            elif work_tile.is_valid_tile:
                m_block, head_idx, batch_idx, _ = work_tile.tile_idx
                seqlen, block_info, n_block_min, n_block_max, lists, tile_fastdiv_mods = setup(
                    m_block=m_block, head_idx=head_idx, batch_idx=batch_idx)
                mma(
                    block_info, seqlen, window_size_left, window_size_right,
                    m_block, head_idx, batch_idx, n_block_min, n_block_max,
                    aux_data, tile_fastdiv_mods, lists, q_state, kv_k, kv_v,
                )

    @cute.jit
    def next_tile_from_slot(self, pipeline_q, q_state: cpipeline.PipelineState, s_tile: cute.Tensor) -> WorkTileInfo:
        """MMA warps, dynamic order: wait for the next Q slot, then read the tile the producer wrote beside it."""
        pipeline_q.consumer_wait(q_state)
        i = q_state.index
        return WorkTileInfo((s_tile[0, i], s_tile[1, i], s_tile[2, i], Int32(0)), s_tile[3, i] != 0)

    def q_slot(self, s: cute.Tensor, q_state: cpipeline.PipelineState) -> cute.Tensor:
        """The tile's Q slot of sQ (or sO) when the Q ring has two slots; the buffer itself with one.
        Trace-time (a slice by the state's dynamic index)."""
        if const_expr(self.q_stages > 1):
            return s[None, None, q_state.index]
        return s

    def _tile_setup(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        *,
        m_block: Int32,
        head_idx: Int32,
        batch_idx: Int32,
        window_size_left: Optional[Int32],
        window_size_right: Optional[Int32],
        fastdiv_mods,
        blocksparse_tensors: Optional[BlockSparseTensors],
        mCuSeqlensQ: Optional[cute.Tensor],
        mCuSeqlensK: Optional[cute.Tensor],
        mSeqUsedQ: Optional[cute.Tensor],
        mSeqUsedK: Optional[cute.Tensor],
    ):
        """The tile's sequence info (SeqlenInfoQK), block range (BlockInfo), block-sparse lists reader and
        aux-tensor divisors: (seqlen, block_info, n_block_min, n_block_max, lists, fastdiv_mods). Traced
        inline where a role calls it (no control flow of its own: a plain method)."""
        seqlen_q_static = mQ.shape[0][1] if const_expr(self.pack_gqa) else mQ.shape[0]
        # varlen: this sequence's offsets and lengths (SeqlenInfoQK reads cu_seqlens / seqused);
        # mK is the ragged TMA view with cu_seqlens_k, whose static length is never read
        # varlen block-sparse lists: each sequence's first Q block and first index entry, and its K/V
        # block count in this kernel's tiles
        sparse_varlen = const_expr(blocksparse_tensors is not None
                                   and blocksparse_tensors.cu_total_m_blocks is not None)
        seqlen = SeqlenInfoQK.create(
            batch_idx, seqlen_q_static=seqlen_q_static, seqlen_k_static=mK.shape[0],
            mCuSeqlensQ=mCuSeqlensQ, mCuSeqlensK=mCuSeqlensK, mSeqUsedQ=mSeqUsedQ, mSeqUsedK=mSeqUsedK,
            mCuTotalMBlocks=blocksparse_tensors.cu_total_m_blocks if sparse_varlen else None,
            mCuBlockIdxOffsets=blocksparse_tensors.cu_block_idx_offsets if sparse_varlen else None,
            tile_m=self.tile_m, tile_n=self.tile_n,
        )
        if const_expr(fastdiv_mods is not None):
            # aux tensors index by position in the sequence: divisors of this sequence's lengths
            fastdiv_mods = (
                FastDivmodDivisorV2(seqlen.seqlen_q) if const_expr(mCuSeqlensQ is not None or mSeqUsedQ is not None)
                else fastdiv_mods[0],
                FastDivmodDivisorV2(seqlen.seqlen_k) if const_expr(mCuSeqlensK is not None or mSeqUsedK is not None)
                else fastdiv_mods[1],
            )
        block_info = BlockInfo(
            self.tile_m,
            self.tile_n,
            self.is_causal,
            self.is_local,
            False,  # is_split_kv
            window_size_left,
            window_size_right,
            qhead_per_kvhead_packgqa=self.qhead_per_kvhead_packgqa,
        )
        n_block_min, n_block_max = block_info.get_n_block_min_max(seqlen, m_block)
        # with block sparsity, each role reads this Q tile's lists after its first wait or load
        lists = partial(
            fwd_block_sparse.tile_lists, blocksparse_tensors, batch_idx, head_idx, m_block, seqlen, self.tile_n,
            self.qhead_per_kvhead_packgqa, self.q_subtile_factor, self.kv_subtile_factor,
        ) if const_expr(blocksparse_tensors is not None) else None
        return seqlen, block_info, n_block_min, n_block_max, lists, fastdiv_mods
