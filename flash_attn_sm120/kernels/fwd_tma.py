"""SM120 forward, TMA family: a producer warp streams Q/K/V with TMA, mma.sync warps run FlashAttention-2.

SM120 has no wgmma and no tcgen05, but it does have TMA (`cp.async.bulk.tensor`) and
transaction mbarriers. This kernel uses them the way FA3 does on Hopper, with SM80-style math:

  warps 0 .. W-1     consumers ("MMA warps", W = FwdConfig.num_threads / 32, 4 or 8)
  warps W .. W+3     producer warpgroup: warp W issues every TMA load of the CTA, the other
                     three exit at once; the warpgroup exists because setmaxnreg acts per
                     warpgroup: it drops to 24 registers and the MMA warps rise to up to 240

Pipeline (one CTA = one (m_block, head, batch) tile, or with `persistent` one wave of CTAs striding all
tiles: persistent_scheduler.py; mbarriers through cutlass' PipelineTmaAsync):

  producer:  Q once            -> pipeline_q (1 stage)
             for n_block = n_block_max-1 down to n_block_min:
                 acquire K slot s -> TMA K[n_block] into sK[s]      (pipeline_k, num_stages slots)
                 acquire V slot s -> TMA V[n_block] into sV[s]      (pipeline_v, num_stages slots)
  consumers: wait Q (optionally copy it to registers once: q_in_regs); per n_block:
                 wait K[s];  S = Q K^T   (ldmatrix + mma.sync m16n8k16, fp32 acc)   release K[s]
                 score_mod, masks (seqlen / causal / local / mask_mod), online softmax in registers,
                 rescale O; P = bf16/fp16(S) stays in registers as the A operand of the next MMA
                 wait V[s];  O += P V    (ldmatrix.trans on V)                        release V[s]
             epilogue: O /= rowsum, O -> smem (stmatrix, reusing sQ) -> one TMA store; LSE from
             registers. TMA clips the last tile's rows, so rows past seqlen_q are never written.

K and V have separate full/empty mbarrier rings of `num_stages` (1 to 4) slots, so the producer
runs up to `num_stages` blocks ahead and a K slot is refilled while the same block's PV product
still reads its V slot. With one slot each the two rings still alternate: K_{j+1} lands behind
block j's softmax and PV, V_{j+1} behind block j+1's QK^T (cp.async's one-stage schedule); that
frees the shared memory for wider tiles (256x48 at d=128). Rows past seqlen_k arrive zero-filled
from TMA and are masked to -inf. A consumer fences the async proxy (`fence.proxy.async.shared::cta`)
before it releases a slot that it read with ldmatrix, so the next TMA write into that slot cannot
overtake those generic-proxy reads.

Intra-warp overlap (use_intra_warp_overlap: warps of 16 rows; intra_warp_overlap=False in the
constructor keeps the plain order everywhere, for A/B runs): after the first n_block the
consumers wait for K_j and V_{j-1}, then issue S_j = Q K_j^T and O += P_{j-1} V_{j-1} back to back
and run block j's softmax; the loop body is one basic block, so ptxas interleaves the PV mma.sync
with the exp2/max/sum (FA3's intra-warpgroup overlap in mma.sync form). O is rescaled after the
PV product; P_{j-1} waits in registers. Warps of 32 rows keep the plain order (registers).

Warps are stacked along M (each warp owns 16 rows per MMA row step, tile_m / (16 W) steps), K/V are
shared by all warps. FwdConfig fields for this family: num_threads = MMA-warp threads (the kernel
adds its producer warpgroup: 128 more threads), num_stages = depth of the K and V rings,
q_in_regs = the MMA warps load their Q fragments once instead of per n_block (sQ stays allocated
as the epilogue's sO). Shared memory: sQ (reused as sO), sK[num_stages], sV[num_stages], each
1 KB aligned and TMA-swizzled (128 B swizzle for head dim 64/128, 64 B for 96), then the
mbarriers (the struct rounds up to 1 KB). `register_split` computes the setmaxnreg budget and the
CTAs per SM that ptxas is told (min_blocks_per_mp); configs of <= 41 KB run 2 CTAs per SM, whose
independent tiles interleave their softmax and MMA phases on the SM.

GQA packing (pack_gqa, FA3's PackGQA): the qhead_per_kvhead query heads that share a KV head are
folded into the M dimension, so one CTA serves a whole head group from one stream of K/V and the
grid has nheads_kv heads. Packed row r of an M tile is query head r % qhead_per_kvhead of the group
at position r // qhead_per_kvhead. Q and O keep their TMA boxes: `make_packgqa_tiled_tma_atom`
(flash_attn.cute.pack_gqa) views (head, seqlen) as one mode and boxes (qhead_per_kvhead,
tile_m / qhead_per_kvhead) of it, so tile_m must be a multiple of qhead_per_kvhead; the masks,
block ranges and score_mod/mask_mod take packed rows through qhead_per_kvhead_packgqa.

Supported: fp16/bf16 (fp16 not on d=128 tiles of 32-row warps wider than 48 keys, which spill:
`fp16_register_error`), head_dim == head_dim_v in {64, 96, 128}, causal, local windows, GQA/MQA
packed or not, softcap and score_mod (applied as in FlashAttentionForwardSm80, through
`apply_score_mod`), mask_mod, LSE output, learnable sinks (one more term in the final softmax's row
sums, sink_fold.load_row_sinks), block sparsity (the producer and the MMA warps walk the listed K/V
tiles instead of the n_block range: fwd_block_sparse.py), varlen (below). Refused with
NotImplementedError (the driver routes these to the cp.async family): seqused_k without
cu_seqlens_k, pack_gqa when tile_m is not a multiple of qhead_per_kvhead, paged KV.
`unsupported_reason(statics)` states the rule for the driver.

Varlen (FA3's approach with one addition): SingleTileVarlenScheduler hands out each sequence's own
M tiles. Q loads from the sequence's first row (a tile past seqlen_q reads the next sequence's
rows, whose outputs are never stored); O stores through a ragged descriptor
(quack's create_ragged_tensor_for_tma: one extra mode whose coordinate places the sequence, so
TMA's bound is the sequence's seqlen_q; with packed GQA the ragged tensor is packed as a dense one
is, as FA3 does). Packed K/V (cu_seqlens_k) load through ragged descriptors
too, so that TMA zero-fills every row past seqlen_k (with seqused_k, past it): those rows never
enter P V, where 0 * NaN would poison a row. seqused_k alone (a (b, s) cache) has no such bound
in a 4-mode descriptor and stays on the cp.async family, which predicates its loads.

RISK: cutlass PR #3189 reported a TMA `cute.copy` hang on sm_120 with the CuTe DSL (its author
later traced it to tile modes left ungrouped before `tma_partition`; this kernel partitions
through quack's `tma_get_copy_fn`, which groups them). SM120 emulation on an H200 (sm_90a) cannot
show an SM120-only hang, so the first runs on a real SM120 must use a timeout
(scripts/smoke_tma.py guards every call). The shipped table chooses this family for causal d64/d96/d128
on emulated measurements, with a cp.async entry after each TMA entry as the fallback;
FLASH_ATTN_SM120_FAMILIES=cpasync restricts the table to the cp.async family (fwd_cpasync.py) until
the family has run on a real SM120.

Where the code lives: one class, FlashAttentionForwardSm120Tma (below), built from one mixin per
role so that each role's device code reads on its own, as FA4's flash_fwd_sm90.py has one method
per role. The cute.jit methods read the kernel's configuration from `self`, so the roles stay
methods of one object rather than free functions taking a dozen attributes; each mixin only
defines methods and reads what the constructor and the host side set.
  fwd_tma.py             this docstring, the constructor and the host side (smem layouts, shared
                         storage, TMA atoms, tile scheduler, launch), the family's public names
  fwd_tma_rules.py       pure-Python rules: config errors, smem_bytes, register_split
  fwd_tma_kernel.py      `kernel`: mbarrier pipelines, the tile's block range, the role split
  fwd_tma_producer.py    `load`: the producer warp's TMA loads of Q and the K/V rings
  fwd_tma_mainloop.py    `mma`, `mma_one_n_block`, `mma_pv`: the MMA warps' loop, overlap, ping-pong
  fwd_tma_epilogue.py    `epilogue`: O through sO and one TMA store, LSE
  mma_sync_utils.py      trace-time GEMM helpers with finer ldmatrix prefetch than sm80_utils
  fwd_tma_proposals.py   PROPOSED_CONFIGS (search data); emulation.py: SM120 emulation padding
"""

from functools import partial
from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync
from cutlass.tensor_utils import LayoutEnum
from flash_attn.cute import utils
from flash_attn.cute.block_sparsity import BlockSparseTensors
from flash_attn.cute.cute_dsl_utils import assume_tensor_aligned
from flash_attn.cute.flash_fwd_sm120 import FlashAttentionForwardSm120
from flash_attn.cute.pack_gqa import make_packgqa_tiled_tma_atom, pack_gqa_layout
from flash_attn.cute.tile_scheduler import (
    SingleTileLPTScheduler,
    SingleTileScheduler,
    SingleTileVarlenScheduler,
    TileSchedulerArguments,
)
from flash_attn.cute.utils import AuxData
from quack import copy_utils, layout_utils
from quack import sm90_utils as quack_sm90_utils

from flash_attn_sm120 import hardware
from flash_attn_sm120.kernels import sink_fold
from flash_attn_sm120.kernels.emulation import emulation_storage
from flash_attn_sm120.kernels.fwd_tma_epilogue import TmaEpilogueMixin
from flash_attn_sm120.kernels.fwd_tma_kernel import TmaKernelMixin
from flash_attn_sm120.kernels.fwd_tma_mainloop import TmaMainloopMixin
from flash_attn_sm120.kernels.fwd_tma_producer import TmaProducerMixin
from flash_attn_sm120.kernels.ordered_scheduler import WorkOrderedTileScheduler, split_tile_order
from flash_attn_sm120.kernels.persistent_scheduler import PersistentTileScheduler, persistent_grid
from flash_attn_sm120.kernels.fwd_tma_proposals import ALL_MASKS, PROPOSED_CONFIGS
from flash_attn_sm120.kernels.fwd_tma_rules import (
    MAX_MMA_REGS,
    PERSISTENT_PRODUCER_REGS,
    PRODUCER_REGS,
    PRODUCER_THREADS,
    SUPPORTED_HEAD_DIMS,
    SUPPORTED_NUM_THREADS,
    WARPGROUP_THREADS,
    _SMEM_ALIGN,
    RegisterSplit,
    dynamic_error,
    fp16_register_error,
    num_mbarriers,
    pack_gqa_error,
    persistent_error,
    pingpong_error,
    producer_regs,
    q_stages_error,
    register_split,
    rows_per_warp,
    smem_bytes,
    tma_config_error,
    unsupported_reason,
    use_intra_warp_overlap,
    varlen_error,
    varlen_register_error,
)
from flash_attn_sm120.kernels.mma_sync_utils import gemm_rs_by_ldmatrix, gemm_ss_by_half_slices

# the family's public names, as they were when all of it lived in this module
__all__ = [
    "ALL_MASKS",
    "MAX_MMA_REGS",
    "PERSISTENT_PRODUCER_REGS",
    "PRODUCER_REGS",
    "PRODUCER_THREADS",
    "PROPOSED_CONFIGS",
    "SUPPORTED_HEAD_DIMS",
    "SUPPORTED_NUM_THREADS",
    "WARPGROUP_THREADS",
    "FlashAttentionForwardSm120Tma",
    "RegisterSplit",
    "dynamic_error",
    "fp16_register_error",
    "gemm_rs_by_ldmatrix",
    "gemm_ss_by_half_slices",
    "num_mbarriers",
    "pack_gqa_error",
    "persistent_error",
    "pingpong_error",
    "producer_regs",
    "q_stages_error",
    "register_split",
    "rows_per_warp",
    "smem_bytes",
    "tma_config_error",
    "unsupported_reason",
    "use_intra_warp_overlap",
    "varlen_error",
    "varlen_register_error",
]


class FlashAttentionForwardSm120Tma(
    TmaKernelMixin, TmaProducerMixin, TmaMainloopMixin, TmaEpilogueMixin, FlashAttentionForwardSm120
):
    """SM120 forward with a TMA producer warp and 4 or 8 mma.sync consumer warps (module docstring).

    Constructor: the same as FlashAttentionForwardSm120CpAsync. `num_threads` counts the MMA warps'
    threads; the launch adds a producer warpgroup (128 threads). `emulate_host_smem`: a hardware.EmulationHost
    (the host driver's shared-memory numbers) of a non-SM120 GPU running the kernel in SM120
    emulation (shared memory is padded so it fits no more CTAs per SM than SM120); None on SM120.
    `intra_warp_overlap`: None follows use_intra_warp_overlap (16-row warps overlap), False keeps
    the plain FA2 order, True overlaps on any tile (32-row warps spill with it at d=128).
    """

    family = "tma"

    def __init__(
        self,
        dtype,
        head_dim: int,
        head_dim_v: Optional[int] = None,
        qhead_per_kvhead: int = 1,
        *,
        is_causal: bool = False,
        is_local: bool = False,
        pack_gqa: bool = False,
        tile_m: int = 128,
        tile_n: int = 64,
        num_stages: int = 2,
        num_threads: int = 256,
        Q_in_regs: bool = False,
        score_mod=None,
        mask_mod=None,
        has_aux_tensors: bool = False,
        emulate_host_smem: Optional[hardware.EmulationHost] = None,
        q_subtile_factor: int = 1,
        kv_subtile_factor: int = 1,
        pingpong: bool = False,
        lpt: Optional[bool] = None,
        intra_warp_overlap: Optional[bool] = None,
        persistent: bool = False,
        num_sms: Optional[int] = None,
        ordered_tiles: bool = False,
        q_stages: int = 1,
        dynamic: bool = False,
    ):
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        if dtype not in (cutlass.Float16, cutlass.BFloat16):
            raise TypeError(f"SM120 TMA forward takes Float16 or BFloat16, got {dtype}")
        error = tma_config_error(head_dim, head_dim_v, tile_m, tile_n, num_stages, num_threads, Q_in_regs)
        if error is None and pingpong:
            error = pingpong_error(num_threads)
        if error is None and persistent:
            error = persistent_error(pingpong)
        if error is None:
            error = q_stages_error(q_stages, persistent)
        if error is None:
            error = dynamic_error(dynamic, persistent)
        if error is None and q_stages > 1:
            error = tma_config_error(head_dim, head_dim_v, tile_m, tile_n, num_stages, num_threads, Q_in_regs,
                                     q_stages=q_stages)
        if error is not None:
            raise ValueError(f"SM120 TMA forward config not implementable: {error}")
        pack_gqa = pack_gqa and qhead_per_kvhead > 1
        if pack_gqa:
            error = pack_gqa_error(tile_m, qhead_per_kvhead)
            if error is not None:
                raise NotImplementedError(f"SM120 TMA forward: {error}; pass pack_gqa=False or use the cpasync family")
        super().__init__(
            dtype,
            head_dim,
            head_dim_v,
            qhead_per_kvhead,
            is_causal=is_causal,
            is_local=is_local,
            pack_gqa=pack_gqa,
            tile_m=tile_m,
            tile_n=tile_n,
            num_stages=num_stages,
            num_threads=num_threads,
            Q_in_regs=Q_in_regs,
            score_mod=score_mod,
            mask_mod=mask_mod,
            has_aux_tensors=has_aux_tensors,
        )
        self.num_mma_threads = num_threads
        self.qhead_per_kvhead_packgqa = qhead_per_kvhead if pack_gqa else 1
        self.num_mma_warps = num_threads // 32
        self.producer_warp_idx = self.num_mma_warps  # first warp of the producer warpgroup
        self.num_threads_total = num_threads + PRODUCER_THREADS
        # Q slots: 2 lets a persistent CTA load the next tile's Q under this tile's loop (the producer's `load`)
        self.q_stages = q_stages
        # persistent tiles from a global counter instead of a fixed stride (persistent_scheduler.py); the
        # counter arrives as the last aux tensor
        self.dynamic = dynamic
        smem_total = smem_bytes(head_dim, head_dim_v, tile_m, tile_n, num_stages, q_stages=q_stages) \
            + hardware.DSL_STATIC_SMEM
        self.registers = register_split(smem_total, num_threads, producer_regs(persistent, num_threads))
        # issue the next block's QK^T next to the previous block's PV (see mma_one_n_block)
        if intra_warp_overlap is None:
            intra_warp_overlap = use_intra_warp_overlap(tile_m, num_threads)
        self.intra_warp_overlap = intra_warp_overlap
        # causal/local diagonal blocks of 32-row warps with >= 64 keys: QK^T by half k-slices (registers)
        self.qk_half_slices_when_masked = rows_per_warp(tile_m, num_threads) == 32 and tile_n >= 64 and not Q_in_regs
        # PV with V one ldmatrix ahead where its k-slices are widest (d=128: 32 registers each); at
        # d <= 96 the whole-slice prefetch is spill-free and measured (d96 256x32 local spills otherwise)
        self.pv_by_ldmatrix = head_dim_v > 96
        self.has_sink = False  # set at trace time by __call__
        self.varlen_q = False  # cu_seqlens_q or seqused_q, set at trace time by __call__
        # block sparsity (fwd_block_sparse.py): K/V and Q tiles per sparse block
        self.q_subtile_factor = q_subtile_factor
        self.kv_subtile_factor = kv_subtile_factor
        self.emulate_host_smem = emulate_host_smem
        # two MMA warpgroups take turns at the tensor pipe (pingpong_error, mma_one_n_block)
        self.pingpong = pingpong
        # longest-processing-time tile order; None: for causal (not local) masks, where tiles differ in work
        self.lpt = lpt
        # one wave of CTAs walks all tiles, the pipelines running on across tiles (persistent_scheduler.py);
        # varlen q keeps one CTA per tile
        self.persistent = persistent
        self.num_sms = hardware.DEFAULT_NUM_SMS if num_sms is None else num_sms
        # block sparsity: tiles launched in a host-given order, longest lists first (ordered_scheduler.py);
        # the order tensor arrives as the last aux tensor
        self.ordered_tiles = ordered_tiles
        # filled in at trace time, read by the codegen report and the tests
        self.smem_bytes_unpadded: Optional[int] = None
        self.smem_bytes_launched: Optional[int] = None
        self.launch_threads: Optional[int] = None

    # ------------------------------------------------------------------------------------------
    # host side
    # ------------------------------------------------------------------------------------------

    @staticmethod
    def can_implement(
        dtype, head_dim, head_dim_v, tile_m, tile_n, num_stages, num_threads, is_causal, Q_in_regs=False
    ) -> bool:
        if dtype not in (cutlass.Float16, cutlass.BFloat16):
            return False
        return tma_config_error(head_dim, head_dim_v, tile_m, tile_n, num_stages, num_threads, Q_in_regs) is None

    @staticmethod
    def unsupported_reason(statics) -> Optional[str]:
        return unsupported_reason(statics)

    @classmethod
    def supports(cls, statics) -> bool:
        return unsupported_reason(statics) is None

    def _refuse_unsupported_args(self, **args) -> None:
        """Trace-time refusal of call arguments this kernel does not implement."""
        given = [name.replace("_without_", " without ") for name, value in args.items() if value is not None]
        if given:
            raise NotImplementedError(
                f"SM120 TMA forward does not support {', '.join(given)}; use the cpasync family"
            )

    def _setup_smem_layouts(self) -> None:
        """TMA-compatible swizzled layouts (the same atoms wgmma uses; ldmatrix reads them too)."""
        make = quack_sm90_utils.make_smem_layout
        self.sQ_layout = make(self.dtype, LayoutEnum.ROW_MAJOR, (self.tile_m, self.tile_hdim))
        self.sK_layout = make(self.dtype, LayoutEnum.ROW_MAJOR, (self.tile_n, self.tile_hdim), self.num_stages)
        self.sV_layout = make(self.dtype, LayoutEnum.ROW_MAJOR, (self.tile_n, self.tile_hdimv), self.num_stages)
        self.sO_layout = make(self.dtype, LayoutEnum.ROW_MAJOR, (self.tile_m, self.tile_hdimv))
        # the Q ring: (tile_m, head_dim, q_stages); the epilogue's sO takes the slot being retired, so sO's view
        # of the buffer has the same stage mode (head_dim == head_dim_v in this family: same slot size)
        self.sQ_ring_layout, self.sO_ring_layout = self.sQ_layout, self.sO_layout
        if const_expr(self.q_stages > 1):
            self.sQ_ring_layout = make(self.dtype, LayoutEnum.ROW_MAJOR, (self.tile_m, self.tile_hdim), self.q_stages)
            self.sO_ring_layout = make(self.dtype, LayoutEnum.ROW_MAJOR, (self.tile_m, self.tile_hdimv), self.q_stages)

    def _get_shared_storage_cls(self):
        sQ_struct, sK_struct, sV_struct = [
            cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layout)], _SMEM_ALIGN]
            for layout in (self.sQO_layout_for_size(), self.sK_layout, self.sV_layout)
        ]
        mbar_q = cute.struct.MemRange[cutlass.Int64, 2 * self.q_stages]
        mbar_k = cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
        mbar_v = cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
        # dynamic: each Q slot's tile, (m_block, head, batch, valid), from the producer to the MMA warps (16-32 B
        # inside the mbarriers' 1 KB round-up, so smem_bytes is unchanged)
        tile_slots_struct = cute.struct.MemRange[Int32, 4 * (self.q_stages if self.dynamic else 1)]

        @cute.struct
        class SharedStorageTma:
            sQ: sQ_struct
            sK: sK_struct
            sV: sV_struct
            mbar_Q: mbar_q
            mbar_K: mbar_k
            mbar_V: mbar_v
            tile_slots: tile_slots_struct

        return emulation_storage(self, SharedStorageTma, self.num_threads_total)

    def sQO_layout_for_size(self):
        """sQ doubles as sO: the buffer must hold the larger of the two (all Q slots)."""
        q, o = self.sQ_ring_layout, self.sO_ring_layout
        return q if cute.cosize(q) >= cute.cosize(o) else o

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
        # Always keep stream as the last parameter (EnvStream: obtained implicitly via TVM FFI).
        stream: cuda.CUstream = None,
    ):
        """Same call convention as upstream's FlashAttentionForwardSm80.__call__.

        mQ/mK/mV/mO: (batch, seqlen, nheads, head_dim), head_dim contiguous, or (total, nheads,
        head_dim) with cu_seqlens; mLSE: (batch, nheads, seqlen_q) fp32, (nheads, total_q) with
        cu_seqlens_q, or None. Varlen: the module docstring; what is refused: `varlen_error`.
        """
        self._refuse_unsupported_args(
            page_table=mPageTable,
            seqused_k_without_cu_seqlens_k=mSeqUsedK if const_expr(mCuSeqlensK is None) else None,
        )
        self.varlen_q = mCuSeqlensQ is not None or mSeqUsedQ is not None
        if const_expr(self.ordered_tiles and (self.varlen_q or self.persistent)):
            raise ValueError("SM120 TMA forward: a tile order is for one CTA per tile of a fixed-length grid")
        if const_expr(self.dynamic and not self.persistent):
            raise ValueError("SM120 TMA forward: a dynamic tile order is for persistent CTAs")
        # the host appends the counter last, for a dense-q call (varlen q runs one CTA per tile: no counter)
        aux_data, tile_counter = split_tile_order(aux_data, self.dynamic and not self.varlen_q)
        aux_data, tile_order = split_tile_order(aux_data, self.ordered_tiles)
        self.has_sink = learnable_sink is not None
        self._check_type(
            *(t.element_type if t is not None else None
              for t in (mQ, mK, mV, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK))
        )
        mQ, mK, mV, mO = [assume_tensor_aligned(t) for t in (mQ, mK, mV, mO)]
        # (b, s, h, d) -> (s, d, h, b), or (total, h, d) -> (total, d, h): seqlen and head_dim lead,
        # as the TMA boxes want them
        QO_order = [1, 3, 2, 0] if const_expr(mCuSeqlensQ is None) else [0, 2, 1]
        KV_order = [1, 3, 2, 0] if const_expr(mCuSeqlensK is None) else [0, 2, 1]
        mQ, mO = [layout_utils.select(t, QO_order) for t in (mQ, mO)]
        mK, mV = [layout_utils.select(t, KV_order) for t in (mK, mV)]
        if const_expr(mLSE is not None):
            # (s, h, b), or (total_q, h)
            mLSE = layout_utils.select(mLSE, [2, 1, 0] if const_expr(mCuSeqlensQ is None) else [1, 0])

        tiled_mma_qk, tiled_mma_pv = self._get_tiled_mma()
        self._setup_smem_layouts()
        SharedStorage = self._get_shared_storage_cls()

        self.tma_copy_bytes = {
            name: cute.size_in_bytes(self.dtype, cute.select(layout, mode=[0, 1]))
            for name, layout in (("Q", self.sQ_layout), ("K", self.sK_layout), ("V", self.sV_layout))
        }
        # packed GQA: Q/O boxes of (qhead_per_kvhead, tile_m / qhead_per_kvhead) (head, position) rows;
        # the returned coordinate tensors are ((qhead_per_kvhead, seqlen), d, nheads_kv, b)
        make_tma_QO = (
            partial(make_packgqa_tiled_tma_atom, qhead_per_kvhead=self.qhead_per_kvhead, head_idx=2)
            if const_expr(self.pack_gqa)
            else cpasync.make_tiled_tma_atom
        )
        tma_load = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_Q, tma_tensor_Q = make_tma_QO(tma_load, mQ, self.sQ_layout, (self.tile_m, self.tile_hdim))
        # packed K/V (cu_seqlens_k): ragged descriptors, so that TMA zero-fills every row past the
        # sequence's seqlen_k (the next sequence's rows, or memory past seqused_k, never enter P V)
        mK_tma, mV_tma = mK, mV
        if const_expr(mCuSeqlensK is not None):
            mK_tma, mV_tma = [copy_utils.create_ragged_tensor_for_tma(t, ragged_dim=0, ptr_shift=False)
                              for t in (mK, mV)]
        tma_atom_K, tma_tensor_K = cpasync.make_tiled_tma_atom(
            tma_load, mK_tma, cute.select(self.sK_layout, mode=[0, 1]), (self.tile_n, self.tile_hdim), 1
        )
        tma_atom_V, tma_tensor_V = cpasync.make_tiled_tma_atom(
            tma_load, mV_tma, cute.select(self.sV_layout, mode=[0, 1]), (self.tile_n, self.tile_hdimv), 1
        )
        # varlen q: a ragged O descriptor, so that the store clips at each sequence's seqlen_q (packed
        # GQA packs the ragged view's (head, position) modes as a dense O's)
        mO_tma = mO
        if const_expr(self.varlen_q):
            mO_tma = copy_utils.create_ragged_tensor_for_tma(mO, ragged_dim=0, ptr_shift=True)
        tma_atom_O, tma_tensor_O = make_tma_QO(
            cpasync.CopyBulkTensorTileS2GOp(), mO_tma, self.sO_layout, (self.tile_m, self.tile_hdimv)
        )
        # the M tiles the grid covers: packed rows per KV head, or positions per query head
        mQ_rows = mQ
        if const_expr(self.pack_gqa):
            nheads_kv = mK.shape[2]
            mQ_rows = pack_gqa_layout(mQ, self.qhead_per_kvhead, nheads_kv, head_idx=2)
            if const_expr(mLSE is not None):
                mLSE = pack_gqa_layout(mLSE, self.qhead_per_kvhead, nheads_kv, head_idx=1)

        # causal tiles differ in work: longest first, with heads grouped for L2 reuse (as upstream sm90)
        use_lpt = (self.is_causal and not self.is_local) if self.lpt is None else self.lpt
        if const_expr(self.varlen_q):
            TileScheduler = SingleTileVarlenScheduler  # tiles of each sequence's own seqlen_q
            # the varlen order depends on each sequence: one CTA per tile (this kernel object compiles one
            # key, and varlen is part of it, so the flag holds for the whole trace)
            self.persistent = False
            self.dynamic = False  # (the host appends no counter for varlen q: driver.tile_counter)
        elif const_expr(self.persistent):
            TileScheduler = PersistentTileScheduler
        elif const_expr(self.ordered_tiles):
            TileScheduler = WorkOrderedTileScheduler
        else:
            TileScheduler = SingleTileLPTScheduler if const_expr(use_lpt) else SingleTileScheduler
        tile_sched_args = TileSchedulerArguments(
            num_block=cute.ceil_div(cute.size(mQ_rows.shape[0]), self.tile_m),
            num_head=cute.size(mQ_rows.shape[2]),
            num_batch=cute.size(mQ_rows.shape[3]) if const_expr(mCuSeqlensQ is None)
            else cute.size(mCuSeqlensQ.shape[0] - 1),
            num_splits=1,
            seqlen_k=cute.size(mK.shape[0]),
            headdim=mQ.shape[1],
            headdim_v=mV.shape[1],
            # rows the grid covers: packed GQA multiplies them by qhead_per_kvhead
            total_q=cute.size(mQ_rows.shape[0]) * cute.size(mQ_rows.shape[3]) if const_expr(mCuSeqlensQ is None)
            else cute.size(mQ_rows.shape[0]),
            tile_shape_mn=(self.tile_m, self.tile_n),
            mCuSeqlensQ=mCuSeqlensQ,
            mSeqUsedQ=mSeqUsedQ,
            qhead_per_kvhead_packgqa=self.qhead_per_kvhead_packgqa,
            element_size=self.dtype.width // 8,
            is_persistent=False,
            lpt=use_lpt,
        )
        if const_expr(self.ordered_tiles):
            tile_sched_params = WorkOrderedTileScheduler.params_with_order(tile_sched_args, tile_order)
        else:
            tile_sched_params = TileScheduler.to_underlying_arguments(tile_sched_args)
        if const_expr(self.persistent):
            grid_dim = persistent_grid(tile_sched_params.total_blocks, self.num_sms, self.registers.ctas_per_sm)
        else:
            grid_dim = TileScheduler.get_grid_shape(tile_sched_params)

        softmax_scale_log2, softmax_scale = utils.compute_softmax_scale_log2(softmax_scale, self.score_mod)
        window_size_left = Int32(window_size_left) if window_size_left is not None else None
        window_size_right = Int32(window_size_right) if window_size_right is not None else None
        # varlen: the kernel entry makes each sequence's divisors
        fastdiv_mods = utils.compute_fastdiv_mods(mQ, mK, self.qhead_per_kvhead, False, aux_data.tensors)
        aux_data = sink_fold.with_sink(aux_data, learnable_sink)  # the sink rides with the aux tensors

        self.kernel(
            tma_tensor_Q,
            tma_tensor_K,
            tma_tensor_V,
            tma_tensor_O,
            mLSE,
            tma_atom_Q,
            tma_atom_K,
            tma_atom_V,
            tma_atom_O,
            softmax_scale_log2,
            softmax_scale,
            window_size_left,
            window_size_right,
            self.sQ_ring_layout,
            self.sK_layout,
            self.sV_layout,
            self.sO_ring_layout,
            tiled_mma_qk,
            tiled_mma_pv,
            SharedStorage,
            tile_sched_params,
            TileScheduler,
            aux_data,
            fastdiv_mods,
            blocksparse_tensors,
            mCuSeqlensQ,
            mCuSeqlensK,
            mSeqUsedQ,
            mSeqUsedK,
            tile_counter,
        ).launch(
            grid=grid_dim,
            block=[self.num_threads_total, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=self.registers.ctas_per_sm,
            # all of the SM's memory as shared memory when CTAs share an SM; set here, the DSL
            # would otherwise query the device at compile time for it
            preferred_smem_carveout=100 if self.registers.ctas_per_sm > 1 else None,
        )

    # device side: `kernel` (TmaKernelMixin), `load` (TmaProducerMixin), `mma` and its blocks
    # (TmaMainloopMixin), `epilogue` (TmaEpilogueMixin)
