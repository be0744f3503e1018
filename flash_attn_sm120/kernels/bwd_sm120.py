"""SM120 backward, FA2 family: upstream's SM120 backward opened up to 4 or 8 warps, any tile, stage and atom layout.

Algorithm (inherited, not copied): FlashAttention-2's backward on warp-level tensor cores. A CTA
owns one n-block of K and V (n_block rows) and walks the m-blocks of Q and dO that can see it. For
each m-block it recomputes S = Q K^T and P = exp2(S * scale_log2 - LSE_log2), then dP = dO V^T and
dS = P * (dP - dPsum), and accumulates dV += P^T dO and dK += dS^T Q in registers; dQ += dS K is
added to an fp32 accumulator in global memory with atomics. All products are `mma.sync.m16n8k16`
fed by `ldmatrix`. Q and dO arrive through `cp.async` in rings of `stages_q` / `stages_do` buffers;
P and dS go through shared memory (sP, sdS) to change their MMA operand layout. Upstream's
preprocess kernel computes dPsum = rowsum(dO * O) and LSE in log2 units before this kernel, and its
postprocess kernel converts the dQ accumulator (and, for GQA, the dK/dV accumulators) to the
output dtype after it.

The three products' warp layouts are free: `atom_m_sdp` warps along M for S/dP (the rest along N),
`atom_n_dkv` along N for dK/dV, `atom_m_dq` along M for dQ, each optionally swapped (swapAB)
so that the other operand is the A operand. With `v_in_regs` the modifier step
(FlashAttentionBackwardSm120Mods) keeps V in registers for dP = dO V^T: the SM80 kernel copies V
there once, in its prologue, and lends V's shared memory to Q, but its own step re-reads V from
that memory for every dP (wrong dQ and dK once Q has overwritten it); the modifier step reads the
registers, and the sV field, which nothing reads then, shrinks to one element.
With S/dP swapped and every warp along the keys (`BwdConfig.pds_in_regs`), P and dS stay in
registers for the dK/dV products (the modifier step, FlashAttentionBackwardSm120Mods, runs it).

This module adds, by subclassing upstream's `FlashAttentionBackwardSm120`:
  * `BwdConfig`, the tile/warp/stage/layout choice as data, its exact shared-memory footprint and
    SM120 feasibility rules with a reason for each refusal (host-side, in bwd_tiling.py);
  * SM120 emulation padding through the same checked mechanism as the forward
    (`emulation.emulation_storage`, verified per compile by occupancy.py).
  * a causal/local mask that is right for any S/dP warp layout (bwd_mask.py): upstream's assumes one
    warp along N, which only its own SM120 config has;
  * varlen GQA dK/dV accumulated at the offsets upstream's postprocess reads (`epilogue`);
  * `deterministic`: semaphore-ordered dQ and GQA dK/dV accumulation (bwd_deterministic.py);
  * `mask_where_needed`: masks applied only to the tiles that hold a masked element
    (`bwd_mask.where_needed`; driver_bwd.launch_plan uses it without a causal mask or window);
  * `lpt`: causal CTAs launched longest first (`LongestFirstNBlockScheduler`), an option the launch
    plan leaves off (it measured slower on 3 of the 4 causal seed problems, emulated).
  * `dq_wide_adds`: dQ added with 16-byte reductions (`red.global.add.v4.f32`, the modifier step's
    `_dq_adds`) into an accumulator whose tile holds four consecutive elements per thread
    (`DQ_WIDE_ELEMS`); this package's postprocess reads that layout (kernels/bwd_postprocess.py).
Everything else (mainloop, atomics, GQA accumulation, varlen) is upstream's.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from flash_attn.cute import copy_utils
from flash_attn.cute import utils as fa_utils
from flash_attn.cute.block_info import BlockInfo
from flash_attn.cute.flash_bwd_sm120 import FlashAttentionBackwardSm120
from flash_attn.cute.tile_scheduler import SingleTileScheduler
from flash_attn.cute.utils import AuxData

from flash_attn_sm120 import hardware
from flash_attn_sm120.kernels import bwd_deterministic, bwd_fixed_point, bwd_mask
from flash_attn_sm120.kernels.bwd_tiling import (
    _HDIM_MULTIPLE,
    _SMALL_ALIGN,
    _SMEM_ALIGN,
    DQ_WIDE_ELEMS,
    BwdConfig,
    bwd_config_error,
    dq_wide_fits,
    shared_qv_bytes,
    v_runs_into_sdo,
)
from flash_attn_sm120.kernels.emulation import emulation_storage
from flash_attn_sm120.kernels.fwd_cpasync import _round_up

LPT_L2_BYTES = 32 * 1024 * 1024  # the working set the longest-first launch keeps to (a fraction of L2)


def lpt_row_bytes(head_dim_padded: int, head_dim_v_padded: int, elem_bytes: int) -> int:
    """Bytes per query row that a head's CTAs share: Q and dO in the input dtype, the fp32 dQ
    accumulator, LSE and dPsum."""
    return (head_dim_padded + head_dim_v_padded) * elem_bytes + head_dim_padded * 4 + 8


def lpt_section_heads(num_block, rows_per_block: int, row_bytes: int, heads, l2_bytes: int = LPT_L2_BYTES):
    """Heads (batch x head pairs) whose CTAs LongestFirstNBlockScheduler interleaves: as many as keep
    their query rows (Q, dO, the dQ accumulator: `row_bytes` each; num_block * rows_per_block rows,
    the key length standing in for the query length) within `l2_bytes`, at least one. Plain
    arithmetic (cutlass.min/max take ints and Int32): the kernel and the tests run the same formula."""
    per_head = num_block * (rows_per_block * row_bytes)
    return cutlass.min(cutlass.max(l2_bytes // per_head, 1), heads)


def lpt_coords(linear, num_block, heads, section):
    """(n_block, head-batch index) of the CTA launched `linear`-th: sections of `section` heads, each
    walking its n_blocks from 0 (longest under a causal mask) with its heads interleaved; the last
    section holds the remaining heads. Plain arithmetic, shared by the kernel and the tests."""
    start = linear // (section * num_block) * section
    width = cutlass.min(heads - start, section)
    within = linear - start * num_block
    return within // width, start + within % width


class LongestFirstNBlockScheduler(SingleTileScheduler):
    """SingleTileScheduler (one tile per CTA) with the grid's CTAs re-ordered longest first (LPT).

    Under a causal mask n_block 0 sees every m_block and the last n_block the fewest. SingleTileScheduler's order
    launches one head's n_blocks, then the next head's, so the last head's long CTAs start at the end
    and run while the other SMs idle. Here the CTAs of a section of heads go n_block 0 of every head,
    then n_block 1, ...: the longest work starts first and the kernel ends on short CTAs. A section
    keeps its heads' Q, dO and dQ accumulator within LPT_L2_BYTES (lpt_section_heads). The class
    attributes are set per kernel (`specialized`)."""

    rows_per_block = 64
    row_bytes = 1024

    @classmethod
    def specialized(cls, rows_per_block: int, row_bytes: int):
        return type(cls.__name__, (cls,), dict(rows_per_block=rows_per_block, row_bytes=row_bytes))

    @classmethod
    def create(cls, params, ctx=None, *, loc=None, ip=None):
        block_idx, head_idx, batch_idx = cute.arch.block_idx()
        num_block, num_head, num_batch = cute.arch.grid_dim()
        heads = num_head * num_batch
        # (64-bit: a head's rows times their bytes passes 2**31 past about 2M query rows)
        section = Int32(lpt_section_heads(cutlass.Int64(num_block), cls.rows_per_block, cls.row_bytes,
                                          cutlass.Int64(heads), cutlass.Int64(LPT_L2_BYTES)))
        linear = block_idx + num_block * (head_idx + num_head * batch_idx)
        n_block, head_batch = lpt_coords(linear, num_block, heads, section)
        batch, head = head_batch // num_head, head_batch % num_head
        return cls(params, (n_block, head, batch), loc=loc, ip=ip)


class FlashAttentionBackwardSm120Tuned(FlashAttentionBackwardSm120):
    """Upstream's SM120 backward with a BwdConfig, SM120 limits and emulation padding.

    `emulate_host_smem`: a hardware.EmulationHost when the kernel runs in SM120 emulation on another
    GPU (shared memory padded so that the host fits no more CTAs per SM than SM120); None on SM120.
    """

    family = "bwd"

    def __init__(
        self,
        dtype,
        head_dim: int,
        head_dim_v: Optional[int] = None,
        qhead_per_kvhead: int = 1,
        config: BwdConfig = BwdConfig(),
        *,
        pack_gqa: bool = False,
        is_causal: bool = False,
        is_local: bool = False,
        score_mod=None,
        score_mod_bwd=None,
        emulate_host_smem: Optional[hardware.EmulationHost] = None,
        deterministic: bool = False,
        dq_descending: bool = False,
        dq_rotated: bool = False,
        reverse_n_blocks: bool = False,
        fetch_early: bool = False,
        barrier_release: bool = False,
        release_deferred: bool = False,
        fetch_relaxed: bool = False,
        warp_turns: bool = False,
        late_dq_adds: bool = False,
        diag_no_wait: bool = False,
        diag_no_sync: bool = False,
        dq_split: bool = False,
        fused_turns: bool = False,
        fused_fetch: bool = False,
        lpt: bool = False,
        mask_where_needed: bool = False,
        dq_fixed_point: bool = False,
        dq_wide_adds: bool = False,
    ):
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        if deterministic and is_local and dq_split:
            raise ValueError("dq_split groups the n_blocks by n % 2, which a window's turns (counted from its "
                             "left edge) do not follow: not with a sliding window")
        if dtype not in (cutlass.Float16, cutlass.BFloat16):
            raise TypeError(f"SM120 backward takes Float16 or BFloat16, got {dtype}")
        error = bwd_config_error(head_dim, head_dim_v, config)
        if error is not None:
            raise ValueError(f"SM120 backward config not implementable: {error}")
        super().__init__(
            dtype, head_dim, head_dim_v, qhead_per_kvhead, config.m_block, config.n_block, config.stages_q,
            config.stages_do, config.num_threads, pack_gqa, is_causal, is_local, config.sdp_swapab,
            config.dkv_swapab, config.dq_swapab, config.atom_m_sdp, config.atom_n_dkv, config.atom_m_dq,
            V_in_regs=config.v_in_regs, score_mod=score_mod, score_mod_bwd=score_mod_bwd,
        )
        self.config = config
        self.emulate_host_smem = emulate_host_smem
        self.deterministic = deterministic
        self.dq_descending = dq_descending and (is_causal or is_local)  # bwd_deterministic.py: the dQ turn order
        if dq_rotated and (is_causal or is_local):
            raise ValueError("the rotated dQ order is for attention without a causal or local mask")
        self.dq_rotated = deterministic and dq_rotated
        self.reverse_n_blocks = deterministic and reverse_n_blocks  # shortest-first launch (bwd_deterministic.ReversedNBlockScheduler)
        self.fetch_early = fetch_early  # read the dQ turn flag at the m_block's start
        self.barrier_release = barrier_release  # release: CTA barrier + one release increment, no per-thread fence
        self.release_deferred = release_deferred  # release an m_block's turn in the next m_block, before its wait
        self.fetch_relaxed = fetch_relaxed  # the early read is relaxed (bwd_deterministic.fetch)
        if warp_turns and fetch_early:
            raise ValueError("warp_turns waits per warp; fetch_early (a CTA-wide early read) does not apply")
        self.warp_turns = warp_turns  # dQ turns waited for and released per warp, no CTA barrier
        # the dQ adds (and their wait) after the dK product, at the m_block's end: the modifier step's
        # (kernels/bwd_mods.py) option, this package's own step; upstream's cannot reorder them
        own_step = type(self)._one_m_block is not FlashAttentionBackwardSm120Tuned._one_m_block
        for name, on in (("late_dq_adds", late_dq_adds), ("dq_split", dq_split), ("fused_turns", fused_turns),
                         ("dq_fixed_point", dq_fixed_point), ("dq_wide_adds", dq_wide_adds)):
            if on and not own_step:
                raise ValueError(f"{name} needs the modifier step (FlashAttentionBackwardSm120Mods)")
        if config.pds_in_regs and not own_step:
            raise ValueError("P/dS in registers (sdp_swapab) needs the modifier step (FlashAttentionBackwardSm120Mods)")
        if config.v_in_regs and not own_step:
            # upstream's step re-reads V from its shared memory, which Q's loads overwrite with V_in_regs
            raise ValueError("v_in_regs needs the modifier step (FlashAttentionBackwardSm120Mods): upstream's step "
                             "reads V from the shared memory it lends to Q")
        self.late_dq_adds = deterministic and late_dq_adds
        # dq_groups() dQ accumulators (the driver allocates and sums them), and the
        # turns' wait and release on the step's own barriers
        self.dq_groups = bwd_deterministic.dq_groups(deterministic and dq_split)
        if fused_turns and (warp_turns or fetch_early or late_dq_adds):
            raise ValueError("fused_turns places the wait and release itself: not with warp_turns, fetch_early "
                             "or late_dq_adds")
        self.fused_turns = deterministic and fused_turns
        if fused_turns and (diag_no_wait or diag_no_sync):
            raise ValueError("the diag_* timing diagnostics apply to the hooked-load placement, not fused_turns")
        if fused_fetch and not fused_turns:
            raise ValueError("fused_fetch is an option of fused_turns")
        self.fused_fetch = self.fused_turns and fused_fetch
        # dQ added as 64-bit fixed point: the same bits in any order, no turns (the modifier step's adds)
        # (its bound holds for softcap's score_mod_bwd, not a user's: bwd_plans.deterministic_plan decides)
        if dq_fixed_point and not deterministic:
            raise ValueError("dq_fixed_point is an option of deterministic=True")
        if dq_fixed_point and any((dq_descending, dq_rotated, reverse_n_blocks, fetch_early, barrier_release,
                                   release_deferred, warp_turns, late_dq_adds, dq_split, fused_turns)):
            raise ValueError("dq_fixed_point takes no turns: not with the ordering flags of the turn protocol")
        self.dq_fixed_point = deterministic and dq_fixed_point
        self._dq_fixed = None  # (int64 accumulator's base address, this head's 2^k) at trace time
        self._dq_block_offset = 0  # dq_split: this CTA's accumulator, as an m_block offset (trace time)
        self._after_dp_barrier = self._after_p_barrier = self._before_dq_barrier = None  # fused_turns' hooks
        # Diagnostics for benchmarks only (results are NOT deterministic): the ordered kernel with its dQ
        # waits replaced by a CTA barrier (what the waiting itself costs), or with no waits, releases or
        # barriers at all (what the walk order and the rest of the protocol cost).
        if (diag_no_wait or diag_no_sync) and not deterministic:
            raise ValueError("diag_no_wait / diag_no_sync are diagnostics of the deterministic kernel")
        if diag_no_wait and diag_no_sync:
            raise ValueError("diag_no_wait and diag_no_sync are alternatives; pick one")
        self.diag_no_wait = diag_no_wait
        self.diag_no_sync = diag_no_sync
        if lpt and (deterministic or not is_causal or is_local):
            raise ValueError("lpt (longest-first launch) is for causal attention without a window, not "
                             "deterministic (whose orderings fix the launch order)")
        self.lpt = lpt
        self.mask_where_needed = mask_where_needed  # mask only tiles with a masked element (bwd_mask.where_needed)
        if dq_wide_adds and not dq_wide_fits(config, head_dim):
            raise ValueError(f"dq_wide_adds: a {config.m_block}x{_round_up(head_dim, _HDIM_MULTIPLE)} dQ tile does not "
                             f"split into {DQ_WIDE_ELEMS}-element pieces over {config.num_threads} threads")
        self.dq_wide_adds = dq_wide_adds  # 16-byte dQ reductions, the accumulator in their layout
        # filled in at trace time, read by the occupancy check, the codegen report and the tests
        self.smem_bytes_unpadded: Optional[int] = None
        self.smem_bytes_launched: Optional[int] = None
        self.launch_threads: Optional[int] = None

    def _setup_attributes(self):
        super()._setup_attributes()
        if self.dq_wide_adds:
            # each thread's dQ accumulator elements in runs of four consecutive floats (thread t's run j at
            # (j * threads + t) * 4), which one 16-byte reduction adds; upstream's GQA dK/dV copies, made
            # from the one-element dQ copy above, keep their layout (upstream's postprocess reads them)
            self.gmem_tiled_copy_dQaccum = copy_utils.tiled_copy_1d(cutlass.Float32, self.num_threads,
                                                                     DQ_WIDE_ELEMS)

    def _get_shared_storage_cls(self):
        storage = super()._get_shared_storage_cls()
        if self.config.pds_in_regs:  # P never reaches shared memory: the kernel's sP views keep one element
            storage = _without_sp(storage, self.dtype)
        if self.config.v_in_regs:  # V lands in sQ's memory (and sdO's); its own field is unused
            into_sdo = v_runs_into_sdo(self.head_dim_padded, self.head_dim_v_padded, self.config,
                                       self.dtype.width // 8)
            storage = _without_sv(storage, self.dtype, into_sdo, *(cute.cosize(layout) for layout in
                                                                   (self.sQ_layout, self.sV_layout, self.sdO_layout)))
        return emulation_storage(self, storage, self.num_threads)

    @property
    def sdp_warps_along_n(self) -> int:
        return self.config.num_warps // self.config.atom_m_sdp

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
        softmax_scale: cutlass.Float32,
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
        # Upstream's SM80/SM120 mainloop takes no semaphores; they travel to compute_one_m_block and
        # the epilogue at the end of aux_data (dQ's, then dK/dV's with GQA), as kernel arguments.
        # With dq_fixed_point the dQ slot holds the int64 accumulator and the dV slot (else unused:
        # dK's semaphore serves dV) the per-head scales.
        aux_data = self._aux_with_semaphores(aux_data, mdQ_semaphore, mdK_semaphore, mdV_semaphore)
        FlashAttentionBackwardSm120.__call__(
            self, mQ, mK, mV, mdO, mLSE, mdPsum, mdQaccum, mdK, mdV, softmax_scale, mCuSeqlensQ, mCuSeqlensK,
            mSeqUsedQ, mSeqUsedK, window_size_left, window_size_right, None, None, None, aux_data,
            blocksparse_tensors, mCuTotalMBlocks, stream,
        )

    def _aux_with_semaphores(self, aux_data: AuxData, dq_sem, dkv_sem, dq_scale=None) -> AuxData:
        """Plain Python (outside the jit body's rewriting): aux_data with the ordering's semaphores appended
        (dq_fixed_point: the int64 accumulator and the scales in dQ's place)."""
        if not self.deterministic:
            return aux_data
        dq = [dq_sem, dq_scale] if self.dq_fixed_point else [dq_sem]
        sems = dq + ([dkv_sem] if self.qhead_per_kvhead > 1 else [])
        return AuxData(list(aux_data.tensors or []) + sems, aux_data.scalars)

    def kernel(self, *args):
        # upstream's __call__ passes its tile scheduler class second to last; the shortest-first launch
        # swaps in the same scheduler with the n_blocks reversed (dense problems only), the
        # longest-first one the same scheduler re-ordered (dense causal problems)
        if self.reverse_n_blocks or self.lpt:
            if args[-2] is not SingleTileScheduler:
                raise ValueError("reverse_n_blocks / lpt need the dense SingleTileScheduler (no cu_seqlens_k)")
            scheduler = bwd_deterministic.ReversedNBlockScheduler if self.reverse_n_blocks else (
                LongestFirstNBlockScheduler.specialized(
                    self.n_block_size, lpt_row_bytes(self.head_dim_padded, self.head_dim_v_padded, self.dtype.width // 8)))
            args = (*args[:-2], scheduler, args[-1])
        return super().kernel(*args)

    @cute.jit
    def load_Q_LSE(self, gmem_tiled_copy_Q, gmem_tiled_copy_LSE, tQgQ, tQsQ, tQcQ, t0QcQ, tQpQ, tLSEgLSE, tLSEsLSE,
                   tLSEcLSE, block: Int32, smem_pipe_write_q: Int32, seqlen: Int32):
        if const_expr(self.dq_rotated):  # the walk's step -> its m_block (prologue and in-loop loads alike)
            block = bwd_deterministic.rotated(block, cute.ceil_div(seqlen, self.m_block_size), self.dq_groups)
        FlashAttentionBackwardSm120.load_Q_LSE(self, gmem_tiled_copy_Q, gmem_tiled_copy_LSE, tQgQ, tQsQ, tQcQ, t0QcQ,
                                               tQpQ, tLSEgLSE, tLSEsLSE, tLSEcLSE, block, smem_pipe_write_q, seqlen)

    @cute.jit
    def load_dO_dPsum(self, gmem_tiled_copy_dO, gmem_tiled_copy_dPsum, tdOgdO, tdOsdO, tdOcdO, t0dOcdO, tdOpdO,
                      tdPsumgdPsum, tdPsumsdPsum, tdPsumcdPsum, block: Int32, smem_pipe_write_q: Int32, seqlen: Int32):
        if const_expr(self.dq_rotated):
            block = bwd_deterministic.rotated(block, cute.ceil_div(seqlen, self.m_block_size), self.dq_groups)
        FlashAttentionBackwardSm120.load_dO_dPsum(self, gmem_tiled_copy_dO, gmem_tiled_copy_dPsum, tdOgdO, tdOsdO,
                                                  tdOcdO, t0dOcdO, tdOpdO, tdPsumgdPsum, tdPsumsdPsum, tdPsumcdPsum,
                                                  block, smem_pipe_write_q, seqlen)

    def compute_one_m_block(self, m_block, *args, mask_fn=None, **kwargs):
        ordered = mask_fn  # upstream's partial(AttentionMask.apply_mask, n_block=..., ...): the CTA's indices
        mask_fn = self._mask_for_layout(mask_fn)
        if not self.deterministic:
            return self._one_m_block(m_block, *args, mask_fn=mask_fn, **kwargs)
        sems = kwargs["aux_data"].tensors
        self._dkv_semaphore = sems[-1] if self.qhead_per_kvhead > 1 else None  # for the epilogue
        dq_sem = sems[-2] if self.qhead_per_kvhead > 1 else sems[-1]
        mask, kw = ordered.func.__self__, ordered.keywords
        if const_expr(self.dq_fixed_point):  # no turns: the modifier step adds in fixed point
            accumulator, scales = sems[-3:-1] if self.qhead_per_kvhead > 1 else sems[-2:]
            self._dq_fixed = (accumulator.iterator.toint(),
                              bwd_fixed_point.head_scale(scales.iterator.toint(), kw["head_idx"]))
            return self._one_m_block(m_block, *args, mask_fn=mask_fn, **kwargs)
        step, m_block_max = m_block, kwargs["m_block_max"]  # the walk's step and its end
        if const_expr(self.dq_rotated):
            # upstream's step sees the rotated m_block; its "next" loads (m_block + k < m_block_max) are
            # shifted back to steps, which load_Q_LSE / load_dO_dPsum rotate again
            m_block = bwd_deterministic.rotated(step, m_block_max, self.dq_groups)
            previous = bwd_deterministic.rotated(step - 1, m_block_max, self.dq_groups)
            shift = m_block - step
            kwargs["m_block_max"] = m_block_max + shift
            for name in ("load_Q_LSE", "load_dO_dPsum"):
                kwargs[name] = _shifted_load(kwargs[name], shift)
            turn = bwd_deterministic.rotated_turn(m_block, m_block_max, self.dq_groups)
            m_block_min = 0  # no mask: every CTA walks every m_block
        else:
            block_info = BlockInfo(self.m_block_size, self.n_block_size, self.is_causal, self.is_local, False,
                                   mask.window_size_left, mask.window_size_right)
            turn = bwd_deterministic.dq_turn(block_info, mask.seqlen_info, m_block, kw["n_block"],
                                             self.dq_descending, self.dq_groups)
            m_block_min, _ = block_info.get_m_block_min_max(mask.seqlen_info, kw["n_block"])
            previous = m_block - 1
        index = (kw["batch_idx"], kw["head_idx"])
        if const_expr(self.dq_groups > 1):
            # this CTA's group owns accumulator tiles [g * M, (g + 1) * M) and their turn counters, M the
            # allocated m_blocks (the host allocates both G times over)
            m_blocks_allocated = cute.size(kwargs["gmem_copy_params"].tdQgdQaccum, mode=[2]) // self.dq_groups
            self._dq_block_offset = (kw["n_block"] % self.dq_groups) * m_blocks_allocated
        flag = fa_utils.elem_pointer(dq_sem, (*index, m_block + self._dq_block_offset))
        if const_expr(self.fused_turns):
            return self._fused_turns_step(m_block, step, m_block_min, m_block_max, flag, turn,
                                          fa_utils.elem_pointer(dq_sem, (*index, previous + self._dq_block_offset)),
                                          args, mask_fn, kwargs)
        state = bwd_deterministic.fetch(flag, self.fetch_relaxed) if const_expr(self.fetch_early) else Int32(-1)
        # The wait rides on the load that upstream hooks into the dQ product (after its first k-slice);
        # a deferred release of the previous m_block on the load hooked in before it, where the loads
        # its fence would otherwise wait for have landed. Where those loads do not happen (the last
        # m_blocks), they come before the step (bwd_deterministic.hook_plan / step_points).
        (wait_on, ahead), (release_on, release_ahead) = bwd_deterministic.hook_plan(self.num_stages_Q,
                                                                                    self.num_stages_dO)
        points = bwd_deterministic.step_points(step, m_block_min, m_block_max, ahead, release_ahead,
                                               self.late_dq_adds)
        wait = (partial(bwd_deterministic.acquire_warp, flag, turn, self.config.num_warps) if self.warp_turns
                else partial(bwd_deterministic.wait_turn, flag, turn, state, self.fetch_early))
        if const_expr(self.diag_no_wait):
            wait = cute.arch.barrier
        elif const_expr(self.diag_no_sync):
            wait = _nothing
        if const_expr(self.late_dq_adds):
            self._before_dq_adds = wait  # the step calls it right before its dQ adds
        else:
            kwargs[wait_on] = _after(kwargs[wait_on], wait)
        if const_expr(self.release_deferred):
            release_previous = partial(self._release_dq,
                                       fa_utils.elem_pointer(dq_sem, (*index, previous + self._dq_block_offset)))
            in_hook = partial(bwd_deterministic.call_if, points["release_in_hook"], release_previous)
            kwargs[release_on] = _after(kwargs[release_on], in_hook)
            bwd_deterministic.call_if(points["release_first"], release_previous)
        if const_expr(not self.late_dq_adds):
            bwd_deterministic.call_if(points["wait_first"], wait)
        self._one_m_block(m_block, *args, mask_fn=mask_fn, **kwargs)
        if const_expr(self.release_deferred):
            bwd_deterministic.call_if(step == m_block_max - 1, partial(self._release_dq, flag))
        else:
            self._release_dq(flag)

    def _fused_turns_step(self, m_block, step, m_block_min, m_block_max, flag, turn, previous_flag, args, mask_fn,
                          kwargs) -> None:
        """One step with the turn's wait and the previous m_block's release on the step's own barriers
        (bwd_deterministic.spin / release_unfenced, placed by the modifier step): release the previous
        m_block, then wait for this one, then at the walk's end release this one."""
        self._after_dp_barrier = partial(bwd_deterministic.call_if, step > m_block_min,
                                         partial(bwd_deterministic.release_unfenced, previous_flag))
        if const_expr(self.fused_fetch):
            self._after_p_barrier = partial(bwd_deterministic.fetch, flag, True)
        self._before_dq_barrier = partial(bwd_deterministic.spin, flag, turn)
        self._one_m_block(m_block, *args, mask_fn=mask_fn, **kwargs)
        # (a barrier, then the increment: a per-thread fence would turn every dQ add into a returning atomic)
        bwd_deterministic.call_if(step == m_block_max - 1, partial(bwd_deterministic.release_after_barrier, flag))

    def _release_dq(self, flag) -> None:
        if const_expr(self.diag_no_sync):
            return
        if const_expr(self.warp_turns):
            bwd_deterministic.release_warp(flag)
        else:
            self._release(flag)

    def _release(self, flag) -> None:
        # (fused_turns: the GQA dK/dV epilogue's release too; a per-thread fence would make its adds ATOMGs)
        if const_expr(self.barrier_release or self.fused_turns):
            bwd_deterministic.release_after_barrier(flag)
        else:
            bwd_deterministic.release(flag)

    def _mask_for_layout(self, mask_fn):
        # upstream's causal/local mask is right only with one warp along N of the S tile (bwd_mask.py)
        if mask_fn is not None and self.sdp_warps_along_n > 1:
            mask_fn = bwd_mask.layout_free(mask_fn)
        if mask_fn is not None and self.mask_where_needed:
            mask_fn = bwd_mask.where_needed(mask_fn)
        return mask_fn

    def _one_m_block(self, m_block, *args, mask_fn=None, **kwargs):
        """One m_block's recompute and three products: upstream's step (kernels/bwd_mods.py has its own)."""
        return FlashAttentionBackwardSm120.compute_one_m_block(self, m_block, *args, mask_fn=mask_fn, **kwargs)

    def epilogue(self, acc_dK, acc_dV, mdK, mdV, sdK, sdV, gmem_tiled_copy_dK, gmem_tiled_copy_dV, tiled_mma,
                 tidx, n_block, num_head, batch_idx, seqlen, d_head, d_head_v):
        # Varlen GQA: upstream's epilogue adds dK/dV into the accumulators from offset_k + batch * n_block,
        # its postprocess reads them from that offset rounded down to n_block (SeqlenInfoQK.padded_offset_k);
        # they differ whenever a sequence starts off a tile boundary (wrong dK/dV, measured). Giving the
        # epilogue the offset that lands on the rounded one makes both agree.
        if const_expr(self.qhead_per_kvhead > 1 and seqlen.has_cu_seqlens_k):
            seqlen = dataclasses.replace(seqlen, offset_k=seqlen.padded_offset_k - batch_idx * self.n_block_size)
        if const_expr(self.dq_fixed_point):
            # ptxas keeps the prologue's thread-index products live across the mainloop for this epilogue
            # (its own tidx); a fresh read lets them die there: the d96 64x128 fixed-point tiles 24 B -> 0 B
            # on sm_120a. Not for every kernel: it costs the 4-warp d128 MHA entry 8 B.
            tidx = fresh_thread_idx()
        ordered = self.deterministic and self.qhead_per_kvhead > 1
        if ordered:  # GQA: the group's query heads add into the KV head's dK/dV tiles in head order
            flag = fa_utils.elem_pointer(self._dkv_semaphore, (batch_idx, num_head // self.qhead_per_kvhead, n_block))
            bwd_deterministic.acquire(flag, num_head % self.qhead_per_kvhead)
        super().epilogue(acc_dK, acc_dV, mdK, mdV, sdK, sdV, gmem_tiled_copy_dK, gmem_tiled_copy_dV,
                         tiled_mma, tidx, n_block, num_head, batch_idx, seqlen, d_head, d_head_v)
        if ordered:
            self._release(flag)


@dsl_user_op
def fresh_thread_idx(*, loc=None, ip=None) -> Int32:
    """threadIdx.x, read by a volatile asm that the compiler cannot merge with an earlier read."""
    return Int32(llvm.inline_asm(T.i32(), [], "mov.u32 $0, %tid.x;", "=r", has_side_effects=True,
                                 is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


def _without_sp(storage, dtype):
    """The SharedStorage struct with its sP field cut to one element (same fields, same order): the
    kernel still builds views of sP, which the step with P in registers never reads or writes."""
    fields = dict(storage._annotations)
    fields["sP"] = cute.struct.Align[cute.struct.MemRange[dtype, 1], _SMALL_ALIGN]
    return cute.struct(type("SharedStorageNoP", (), {"__annotations__": fields}))


def _without_sv(storage, dtype, into_sdo: bool, q_elems: int, v_elems: int, do_elems: int):
    """The SharedStorage struct with its sV field one element, moved last (upstream's kernel makes sV a view
    of sQ's memory when V is in registers and never reads the field; last, it costs no 1 KB alignment),
    and sQ sized by shared_qv_bytes: V's view may run from sQ on into sdO, which must follow it."""
    fields = dict(storage._annotations)
    del fields["sV"]
    names = list(fields)
    if into_sdo and names.index("sdO") != names.index("sQ") + 1:
        raise AssertionError(f"V's prologue copy runs from sQ into sdO, which must follow it: fields {names}")
    size = dtype.width // 8
    q_bytes = shared_qv_bytes(q_elems * size, v_elems * size, do_elems * size, into_sdo)
    fields["sQ"] = cute.struct.Align[cute.struct.MemRange[dtype, q_bytes // size], _SMEM_ALIGN]
    fields["sV"] = cute.struct.Align[cute.struct.MemRange[dtype, 1], _SMALL_ALIGN]
    return cute.struct(type("SharedStorageNoV", (), {"__annotations__": fields}))


def _shifted_load(load, shift):
    """load(m_block, ...) called by upstream's step with rotated m_blocks: back to walk steps."""

    def shifted(m_block, *args, **kwargs):
        return load(m_block - shift, *args, **kwargs)

    return shifted


def _nothing() -> None:
    """The diag_no_sync wait."""


def _after(load, first):
    """load(...) preceded by first() (a turn's wait or release riding on one of upstream's hooked loads)."""

    def hooked(*args, **kwargs):
        first()
        return load(*args, **kwargs)

    return hooked
