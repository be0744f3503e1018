"""dQ postprocess for the fixed-point accumulator: int64 in, dQ out, in one pass.

The deterministic backward with `dq_fixed_point` (kernels/bwd_fixed_point.py) sums dQ as int64
multiples of 2^-k_h in upstream's accumulator order: thread t of T owns the tile elements t, t + T,
t + 2T, ..., its dQ MMA accumulator in register order. Converting that to fp32 with torch and then
running upstream's postprocess reads the accumulator twice and writes an fp32 copy in between (93 us
of a 1346 us fixed-point backward at b4 s2048 h32 d64 causal, H100, emulated).

This subclass of upstream's SM120 postprocess keeps its tiling (tiled MMA, sdQ layout, store copy,
tile schedulers) and replaces the kernel body:
  1. each thread loads its int64 elements straight from global memory (a warp reads 32 consecutive
     elements per load: coalesced, no shared-memory stage, which at 8 bytes an element would not fit);
  2. converts each to fp32, times 2^-k_h of its head, times the softmax scale: the same two roundings
     as torch's int64 * fp32 followed by upstream's `acc * scale`, so dQ has the same bits;
  3. writes the tile through shared memory as upstream does (MMA-layout stores, then 16-byte rows).
"""

from __future__ import annotations

from typing import Optional

import torch

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int64, const_expr
from flash_attn.cute import copy_utils, utils
from flash_attn.cute.flash_bwd_postprocess import FlashAttentionBackwardPostprocess
from flash_attn.cute.seqlen_info import SeqlenInfoQK
from flash_attn.cute.tile_scheduler import SingleTileScheduler, SingleTileVarlenScheduler, TileSchedulerArguments
from quack import layout_utils
from quack.compile_utils import make_fake_tensor

from flash_attn_sm120.kernels.bwd_postprocess import batch_lookup, fake_dq_tensors

POSTPROCESS_ARCH = 120


class FixedPointPostprocess(FlashAttentionBackwardPostprocess):
    """dQ = bf16/fp16(fp32(acc) * 2^-k_h * softmax_scale) from the int64 fixed-point accumulator."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.arch // 10 != POSTPROCESS_ARCH // 10:
            raise ValueError(f"the fixed-point dQ postprocess is SM120's (arch {POSTPROCESS_ARCH}), got {self.arch}")

    @cute.jit
    def __call__(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, scale: Float32, mInverse: cute.Tensor,
                 mCuSeqlensQ: Optional[cute.Tensor], mSeqUsedQ: Optional[cute.Tensor],
                 mCuTotalMBlocks: Optional[cute.Tensor], stream):
        if const_expr(mdQaccum.element_type != Int64):
            raise TypeError("the fixed-point dQ accumulator is int64")
        self.tiled_mma = self._get_tiled_mma()
        self._setup_attributes()
        varlen = const_expr(mCuSeqlensQ is not None)
        scheduler = SingleTileVarlenScheduler if varlen else SingleTileScheduler
        args = TileSchedulerArguments(
            num_block=cute.ceil_div(mdQ.shape[0] if varlen else mdQ.shape[1], self.tile_m),
            num_head=mdQ.shape[1] if varlen else mdQ.shape[2],
            num_batch=mCuSeqlensQ.shape[0] - 1 if varlen else mdQ.shape[0],
            num_splits=1, seqlen_k=0, headdim=mdQ.shape[2], headdim_v=0, total_q=mdQ.shape[0],
            tile_shape_mn=(self.tile_m, 1), mCuSeqlensQ=mCuSeqlensQ, mSeqUsedQ=mSeqUsedQ,
            cu_total_m_blocks_ptr=mCuTotalMBlocks,
        )
        params = scheduler.to_underlying_arguments(args)
        self.kernel(mdQaccum, mdQ, scale, mInverse, mCuSeqlensQ, mSeqUsedQ, self.tiled_mma, self.sdQ_layout,
                    self.gmem_tiled_copy_dQ, params, scheduler).launch(
            grid=scheduler.get_grid_shape(params), block=[self.num_threads, 1, 1],
            smem=cute.size_in_bytes(self.dtype, self.sdQ_layout), stream=stream)

    @cute.kernel
    def kernel(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, scale: Float32, mInverse: cute.Tensor,
               mCuSeqlensQ: Optional[cute.Tensor], mSeqUsedQ: Optional[cute.Tensor], tiled_mma: cute.TiledMma,
               sdQ_layout, gmem_tiled_copy_dQ: cute.TiledCopy, params, TileScheduler: cutlass.Constexpr):
        smem = cutlass.utils.SmemAllocator()
        sdQ = smem.allocate_tensor(self.dtype, sdQ_layout, byte_alignment=1024)
        tidx, _, _ = cute.arch.thread_idx()
        work_tile = TileScheduler.create(params).initial_work_tile_info()
        m_block, head_idx, batch_idx, _ = work_tile.tile_idx
        if work_tile.is_valid_tile:
            seqlen = SeqlenInfoQK.create(batch_idx, mdQ.shape[1], 0, mCuSeqlensQ=mCuSeqlensQ, mCuSeqlensK=None,
                                         mSeqUsedQ=mSeqUsedQ, mSeqUsedK=None, tile_m=self.tile_m)
            if const_expr(not seqlen.has_cu_seqlens_q):
                mdQ_cur = mdQ[batch_idx, None, head_idx, None]
                mdQaccum_cur = mdQaccum[batch_idx, head_idx, None]
                head_dim = mdQ.shape[3]
            else:
                mdQ_cur = cute.domain_offset((seqlen.offset_q, 0), mdQ[None, head_idx, None])
                mdQaccum_cur = cute.domain_offset((seqlen.padded_offset_q * self.tile_hdim,), mdQaccum[head_idx, None])
                head_dim = mdQ.shape[2]
            gdQaccum = cute.local_tile(mdQaccum_cur, (self.tile_m * self.tile_hdim,), (m_block,))
            gdQ = cute.local_tile(mdQ_cur, (self.tile_m, self.tile_hdim), (m_block, 0))

            # 1-2. global -> registers in the accumulator's element order, int64 -> fp32, both scales
            g2r = copy_utils.tiled_copy_1d(Int64, self.num_threads, 1)
            tdQgdQaccum = g2r.get_slice(tidx).partition_S(gdQaccum)
            fixed = cute.make_fragment_like(tdQgdQaccum)
            cute.copy(g2r, tdQgdQaccum, fixed)
            tile_shape = (self.tile_m, self.tile_hdim)
            mma_shape = tile_shape if const_expr(not self.dQ_swapAB) else tile_shape[::-1]
            acc = cute.make_rmem_tensor(tiled_mma.partition_shape_C(mma_shape), Float32)
            acc_in_order = cute.make_tensor(acc.iterator, cute.make_layout(cute.size(acc)))
            inverse = mInverse[head_idx]
            for i in cutlass.range_constexpr(cute.size(acc)):
                acc_in_order[i] = Float32(fixed[i]) * inverse  # = torch's int64 * fp32 (dequantize)
            rdQ = cute.make_fragment_like(acc, self.dtype)
            rdQ.store((acc.load() * scale).to(self.dtype))  # = upstream's postprocess

            # 3. registers -> shared memory in the MMA layout, then 16-byte rows -> global memory
            r2s = cute.make_tiled_copy_C(utils.get_smem_store_atom(self.arch, self.dtype, transpose=self.dQ_swapAB),
                                         tiled_mma)
            thr_r2s = r2s.get_slice(tidx)
            target = sdQ if const_expr(not self.dQ_swapAB) else layout_utils.transpose_view(sdQ)
            cute.copy(thr_r2s, thr_r2s.retile(rdQ), thr_r2s.partition_D(target))
            cute.arch.barrier()
            thr_store = gmem_tiled_copy_dQ.get_slice(tidx)
            tdQgdQ, tdQsdQ = thr_store.partition_S(gdQ), thr_store.partition_D(sdQ)
            tdQrdQ = cute.make_fragment_like(tdQsdQ, self.dtype)
            cute.autovec_copy(tdQsdQ, tdQrdQ)
            tdQcdQ = thr_store.partition_S(cute.make_identity_tensor(tile_shape))
            tdQpdQ = utils.predicate_k(tdQcdQ, limit=head_dim)
            for rest_m in cutlass.range_constexpr(cute.size(tdQrdQ.shape[1])):
                if tdQcdQ[0, rest_m, 0][0] < seqlen.seqlen_q - m_block * self.tile_m:
                    cute.copy(gmem_tiled_copy_dQ, tdQrdQ[None, rest_m, None], tdQgdQ[None, rest_m, None],
                              pred=tdQpdQ[None, rest_m, None])


_compiled: dict = {}


def _compile(dtype, head_dim: int, tile_m: int, num_threads: int, atom_m_dq: int, dq_swapab: bool,
             has_cu_seqlens: bool, has_seqused: bool, has_cu_total_m_blocks: bool, hdim_multiple_of: int,
             options: str = ""):
    """The postprocess for any shape of these static facts (fake tensors with symbolic sizes)."""
    mdQ, accum_fp32, cu_seqlens, seqused, cu_total = fake_dq_tensors(dtype, has_cu_seqlens, has_seqused,
                                                                     has_cu_total_m_blocks)
    accum = cute.runtime.make_fake_tensor(Int64, accum_fp32.shape, stride=accum_fp32.stride, assumed_align=16)
    inverse = make_fake_tensor(Float32, (cute.sym_int(),), divisibility=1)
    kernel = FixedPointPostprocess(dtype, head_dim, POSTPROCESS_ARCH, tile_m, num_threads, atom_m_dq, dq_swapab,
                                   hdim_multiple_of=hdim_multiple_of)
    return cute.compile(kernel, accum, mdQ, Float32(0.0), inverse, cu_seqlens, seqused, cu_total,
                        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
                        options=f"--enable-tvm-ffi {options}".strip())


def postprocess_dq_fixed(dq_accum: torch.Tensor, inverse: torch.Tensor, dq: torch.Tensor, scale: float,
                         cu_seqlens: Optional[torch.Tensor], seqused: Optional[torch.Tensor], dtype, head_dim: int,
                         tile_m: int, num_threads: int, atom_m_dq: int, dq_swapab: bool,
                         hdim_multiple_of: int = 32) -> None:
    """dq = scale * 2^-k_h * dq_accum (int64, the fixed-point accumulator in upstream's layout) in dq's dtype;
    `inverse`: bwd_fixed_point.dq_scales' 2^-k_h per head. Compiled once per static key."""
    cu_total = batch_lookup(cu_seqlens, seqused, tile_m)
    key = (dtype, head_dim, tile_m, num_threads, atom_m_dq, dq_swapab, cu_seqlens is not None, seqused is not None,
           cu_total is not None, hdim_multiple_of)
    if key not in _compiled:
        _compiled[key] = _compile(*key)
    _compiled[key](dq_accum, dq, scale, inverse, cu_seqlens, seqused, cu_total)
