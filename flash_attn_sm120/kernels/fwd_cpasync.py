"""SM120 forward, cp.async family: upstream's SM120 kernel opened up to 4 or 8 warps, any tile, 1-3 stages.

Algorithm (inherited, not copied): FlashAttention-2 on warp-level tensor cores. A CTA owns a
tile_m x head_dim block of Q, walks the K/V sequence in tile_n blocks, and for each block
computes S = Q K^T with `mma.sync.m16n8k16` (operands fed by `ldmatrix`), applies masks, an
online softmax in registers, and accumulates O += P V with P kept in registers. K and V arrive in
shared memory through `cp.async` (LDGSTS) in a ring of `num_stages` buffers; with two or more
stages the next tiles' loads stay in flight while the current tile's MMAs run.

Warps are stacked along M (each warp owns 16 rows of the tile per MMA row step), so 8 warps on a
128-row tile halve the per-thread accumulators compared with 4 warps. That is what removes
upstream's register spills on sm_120a (255 registers + 104 B of stack at 4 warps, 128x64, d=128).

This module adds, by subclassing upstream's `FlashAttentionForwardSm120`:
  * SM120 feasibility rules with a reason for each refusal (`sm120_config_error`);
  * the exact shared-memory footprint (`smem_bytes`), checked against the 99 KB per-block limit;
  * optional shared-memory padding for SM120 emulation on bigger GPUs (emulation.py);
  * learnable sinks, folded into the output tile before upstream's epilogue (sink_fold.py):
    upstream's SM80/SM120 kernel refuses them.
Everything else (mainloop, masking, softmax, epilogue, GQA packing, varlen) is upstream's.
"""

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from flash_attn.cute.block_sparsity import BlockSparseTensors
from flash_attn.cute.flash_fwd_sm120 import FlashAttentionForwardSm120
from flash_attn.cute.seqlen_info import SeqlenInfoQK
from flash_attn.cute.utils import AuxData

from flash_attn_sm120 import hardware
from flash_attn_sm120.kernels import sink_fold
from flash_attn_sm120.kernels.emulation import emulation_storage

_SMEM_ALIGN = 1024  # upstream aligns each of sQ, sK, sV to 1 KB


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def smem_bytes(
    head_dim: int,
    head_dim_v: int,
    tile_m: int,
    tile_n: int,
    num_stages: int,
    q_in_regs: bool,
    elem_bytes: int = 2,
) -> int:
    """Dynamic shared memory of one CTA, as upstream's SharedStorage lays it out.

    sV, sQ, sK in that order, each 1 KB aligned; with Q in registers sQ and sV share one buffer.
    head_dim is padded to a multiple of 16 as the kernel's tiles are.
    """
    hd, hdv = _round_up(head_dim, 16), _round_up(head_dim_v, 16)
    q = tile_m * hd * elem_bytes
    k = tile_n * hd * num_stages * elem_bytes
    v = tile_n * hdv * num_stages * elem_bytes
    if q_in_regs:
        return _round_up(_round_up(max(q, v), _SMEM_ALIGN) + k, _SMEM_ALIGN)
    return _round_up(_round_up(_round_up(v, _SMEM_ALIGN) + q, _SMEM_ALIGN) + k, _SMEM_ALIGN)


def _smem_k_block(head_dim: int) -> int:
    """Columns of upstream's swizzled smem atom (ampere_helpers.get_smem_layout_atom), bf16/fp16."""
    hd = _round_up(head_dim, 16)
    return 64 if hd % 64 == 0 else 32 if hd % 32 == 0 else 16


def sm120_config_error(
    head_dim: int,
    head_dim_v: int,
    tile_m: int,
    tile_n: int,
    num_stages: int,
    num_threads: int,
    q_in_regs: bool = False,
) -> Optional[str]:
    """Why a cp.async config cannot run on SM120, or None if it can."""
    if num_threads not in (128, 256):
        return f"num_threads={num_threads}: only 128 (4 warps) or 256 (8 warps) are supported"
    if head_dim % 8 or head_dim_v % 8:
        return f"head dims ({head_dim}, {head_dim_v}) must be multiples of 8"
    if not (8 <= head_dim <= 256 and 8 <= head_dim_v <= 256):
        return f"head dims ({head_dim}, {head_dim_v}) must be in [8, 256]"
    rows_per_step = (num_threads // 32) * 16  # warps stacked along M, 16 rows each
    if tile_m % rows_per_step:
        return f"tile_m={tile_m} must be a multiple of {rows_per_step} for {num_threads // 32} warps"
    if tile_n % 16 or tile_n <= 0:
        return f"tile_n={tile_n} must be a positive multiple of 16"
    if not 1 <= num_stages <= 3:
        return f"num_stages={num_stages} must be 1, 2 or 3"
    if q_in_regs and num_stages > 1:
        # upstream's prologue waits for "all but 2*stages-1" cp.async groups before copying Q to
        # registers, a count that assumes Q is not in registers: with Q in registers and 2+ stages
        # Q is read before it lands (wrong results, caught by the correctness gate on 2026-11-29)
        return "q_in_regs with num_stages > 1 reads Q before it arrives in upstream's prologue"
    # Q and O copies: each thread moves 8 elements, a row is split over (smem k-block / 8) threads
    for d in (head_dim, head_dim_v):
        rows_per_copy = num_threads // (_smem_k_block(d) // 8)
        if tile_m % rows_per_copy:
            return f"tile_m={tile_m} must be a multiple of {rows_per_copy} (rows one Q/O copy covers at d={d})"
    smem = smem_bytes(head_dim, head_dim_v, tile_m, tile_n, num_stages, q_in_regs) + hardware.DSL_STATIC_SMEM
    if smem > hardware.SMEM_PER_BLOCK_MAX:
        return f"needs {smem} B of shared memory, SM120 allows {hardware.SMEM_PER_BLOCK_MAX} B per block"
    return None


class FlashAttentionForwardSm120CpAsync(FlashAttentionForwardSm120):
    """Upstream's SM120 forward with free warps/tiles/stages, SM120 limits, and emulation padding.

    `emulate_host_smem`: a hardware.EmulationHost (the host driver's shared-memory numbers) when the
    kernel runs in SM120 emulation on another GPU; the CTA's shared memory is then padded so that
    the host fits no more CTAs per SM than SM120 would. None on a real SM120.
    """

    family = "cpasync"

    def __init__(
        self,
        dtype,
        head_dim: int,
        head_dim_v: int,
        qhead_per_kvhead: int = 1,
        *,
        is_causal: bool = False,
        is_local: bool = False,
        pack_gqa: bool = False,
        tile_m: int = 128,
        tile_n: int = 64,
        num_stages: int = 1,
        num_threads: int = 128,
        Q_in_regs: bool = False,
        score_mod=None,
        mask_mod=None,
        has_aux_tensors: bool = False,
        emulate_host_smem: Optional[hardware.EmulationHost] = None,
    ):
        error = sm120_config_error(head_dim, head_dim_v, tile_m, tile_n, num_stages, num_threads, Q_in_regs)
        if error is not None:
            raise ValueError(f"SM120 forward config not implementable: {error}")
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
        self.emulate_host_smem = emulate_host_smem
        # filled in at trace time, read by the codegen report and the tests
        self.smem_bytes_unpadded: Optional[int] = None
        self.smem_bytes_launched: Optional[int] = None
        self.launch_threads: Optional[int] = None
        self.fold_sink_in_epilogue = False  # set at trace time by __call__ (a learnable_sink given)
        self._sink = None

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
        # upstream's kernel takes no sink: it travels as the last aux tensor (a kernel argument) to
        # compute_one_n_block, which takes it off the list, and the epilogue folds it in
        self.fold_sink_in_epilogue = learnable_sink is not None
        FlashAttentionForwardSm120.__call__(
            self, mQ, mK, mV, mO, mLSE, softmax_scale, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, mPageTable,
            window_size_left, window_size_right, None, blocksparse_tensors,
            sink_fold.with_sink(aux_data, learnable_sink), mCuTotalMBlocks, mCuTotalSplitsMBlocks, stream,
        )

    def compute_one_n_block(self, *args, aux_data: AuxData = AuxData(), **kwargs):
        aux_data, sink = sink_fold.split_sink(aux_data, self.fold_sink_in_epilogue)
        if sink is not None:
            self._sink = sink  # the kernel argument, read by the epilogue (same kernel body)
        return FlashAttentionForwardSm120.compute_one_n_block(self, *args, aux_data=aux_data, **kwargs)

    @cute.jit
    def epilogue(
        self,
        acc_O: cute.Tensor,
        lse: cute.Tensor,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        sO: cute.Tensor,
        seqlen: SeqlenInfoQK,
        gmem_tiled_copy_O: cute.TiledCopy,
        tma_atom_O: Optional[cute.CopyAtom],
        tiled_mma: cute.TiledMma,
        tidx: Int32,
        m_block: Int32,
        head_idx: Int32,
        batch_idx: Int32,
    ):
        if const_expr(self.fold_sink_in_epilogue):
            row_sinks = sink_fold.load_row_sinks(self._sink, tiled_mma.get_slice(tidx), self.tile_m, self.tile_hdimv,
                                                 m_block, head_idx, self.qhead_per_kvhead, self.pack_gqa)
            sink_fold.fold_sink(acc_O, lse, row_sinks)
        FlashAttentionForwardSm120.epilogue(self, acc_O, lse, mO, mLSE, sO, seqlen, gmem_tiled_copy_O, tma_atom_O,
                                            tiled_mma, tidx, m_block, head_idx, batch_idx)

    @staticmethod
    def can_implement(
        dtype,
        head_dim,
        head_dim_v,
        tile_m,
        tile_n,
        num_stages,
        num_threads,
        is_causal,
        Q_in_regs=False,
    ) -> bool:
        if dtype not in (cutlass.Float16, cutlass.BFloat16):
            return False
        return sm120_config_error(head_dim, head_dim_v, tile_m, tile_n, num_stages, num_threads, Q_in_regs) is None

    def _get_shared_storage_cls(self):
        return emulation_storage(self, super()._get_shared_storage_cls(), self.num_threads)
