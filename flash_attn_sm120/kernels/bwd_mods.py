"""SM120 backward with FlexAttention-style modifiers: score_mod / score_mod_bwd / mask_mod, aux data.

Why this exists: upstream's SM80/SM120 backward step calls `score_mod` and `score_mod_bwd` with
batch, head, q_idx and kv_idx all 0 and never applies `mask_mod`, so any modifier that depends on
a position or on aux tensors indexed by one (ALiBi, relative bias, document masks, prefix-LM) gets
wrong gradients there. Upstream's SM90/SM100 backwards pass the real indices. This module gives the
SM120 backward the same meaning.

Algorithm, per m_block of one CTA's n_block (FlashAttention-2's backward, as bwd_sm120.py):

    S     = Q K^T                                            (fp32 accumulators, mma.sync)
    S'    = score_mod(scale * S, b, h, q_idx, kv_idx)        (or scale * S without one)
    S'    = -inf where mask_mod(b, h, q_idx, kv_idx) is False, or outside the sequences
            (without a mask_mod: upstream's causal / local / seqlen rule, bwd_mask.py)
    P     = exp2(S' * log2(e) - LSE_log2)                    (S' * scale * log2(e) without score_mod)
    dP    = dO V^T
    dS'   = P * (dP - dPsum)
    dS    = score_mod_bwd(dS', scale * S, b, h, q_idx, kv_idx)   (dL/d(scale * S); the postprocess
                                                                  multiplies dQ and dK by scale)
    dV += P^T dO,  dK += dS^T Q,  dQ += dS K  (atomics into the fp32 accumulator, 16 bytes at a time with
                                                dq_wide_adds; deterministic with dq_fixed_point: 64-bit
                                                fixed point, bwd_fixed_point.py)

Every element's (q_idx, kv_idx) comes from `thr_mma.partition_C` of an identity tensor offset by the
tile's origin, so it is right for any warp layout of the S/dP product. Indices are sequence-local
(varlen included), the head is the query head (the backward never packs GQA), and with aux tensors
the indices a modifier sees are wrapped into the sequence (as upstream's SM90 backward does) so
that padded rows and columns never read outside an aux tensor; those positions are masked anyway.
The modifier application is upstream's (`apply_score_mod_inner`, `apply_score_mod_bwd_inner`,
`call_mask_mod`, by import). The rest of the step (loads, products, shared-memory hand-offs) is
this package's restatement of upstream's SM80 step for the configurations bwd_sm120.py admits.

P and dS in registers (`BwdConfig.pds_in_regs`: the Mma_dKV_is_RS condition of FlashAttentionBackwardSm80,
whose own step cannot run it: its LSE/dPsum broadcast, mask and dS store assume the unswapped tile). The
S/dP product runs swapped, S^T = K Q^T, with every warp along the keys, so a warp's S^T accumulator
rows are exactly its rows of dK and dV. Then:

    P^T, dS^T   stay in registers (the accumulator layout re-read as the A-operand layout) and feed
                dV += P^T dO and dK += dS^T Q directly: no sP store, no barrier after it, no
                ldmatrix of P^T / dS^T;
    LSE, dPsum  are per query, so per column of S^T;
    dS^T        still goes to shared memory once, for dQ = dS K (a reduction over keys that other
                warps hold), with stmatrix.trans through the dK product's A-operand partition of
                sdS^T: the exact inverse of the ldmatrix.trans that partition was made for;
    indices     (mask, score_mod, mask_mod) come from the transposed identity tile.
The price: each warp reads all of Q and dO (m_block rows) from shared memory for S^T and dP^T.

V in registers (`BwdConfig.v_in_regs`): dP = dO V^T takes V from the registers the SM80 kernel's
prologue filled (its V_in_regs copy), never from sV, whose memory then holds Q. The SM80 step omits
that and reads Q there as V.
"""

from __future__ import annotations

from typing import Callable, Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute import FastDivmodDivisorV2
from cutlass.cute.nvgpu import warp
from flash_attn.cute import ampere_helpers as sm80_utils
from flash_attn.cute import copy_utils
from flash_attn.cute import utils as fa_utils
from flash_attn.cute.mask import call_mask_mod
from flash_attn.cute.softmax import apply_score_mod_bwd_inner, apply_score_mod_inner
from flash_attn.cute.utils import AuxData
from quack import layout_utils

from flash_attn_sm120.kernels import bwd_fixed_point, bwd_mask
from flash_attn_sm120.kernels.bwd_sm120 import DQ_WIDE_ELEMS, FlashAttentionBackwardSm120Tuned


def mod_vec_size(score_mod: Optional[Callable], has_aux_tensors: bool) -> int:
    """Elements per score_mod call: the callable's `__vec_size__`, else upstream's SM80 forward rule
    (1 with aux tensors, whose reads are per element, else 2)."""
    if score_mod is None:
        return 1
    return getattr(score_mod, "__vec_size__", 1 if has_aux_tensors else 2)


class FlashAttentionBackwardSm120Mods(FlashAttentionBackwardSm120Tuned):
    """FlashAttentionBackwardSm120Tuned whose m_block step applies score_mod, score_mod_bwd and mask_mod
    at each element's real (batch, head, q_idx, kv_idx). Same configs, padding, deterministic order."""

    def __init__(self, *args, mask_mod=None, has_aux_tensors: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        if self.config.dkv_swapab or (self.config.sdp_swapab and not self.config.pds_in_regs):
            raise ValueError("the modifier step swaps S/dP only with P/dS in registers, and never dK/dV")
        self.pds_in_regs = self.config.pds_in_regs
        if self.pds_in_regs and self.fused_fetch:
            raise ValueError("fused_fetch reads its flag after the P barrier, which P/dS in registers does not have")
        self.mask_mod = mask_mod
        # the causal / local rule the step applies in each tile (the block-sparse walk applies them inside
        # its listed tiles while the mainloop's m range stays the full one)
        self.mask_causal, self.mask_local = self.is_causal, self.is_local
        self.has_aux_tensors = has_aux_tensors
        self.score_vec_size = mod_vec_size(self.score_mod, has_aux_tensors)
        self.score_bwd_vec_size = mod_vec_size(self.score_mod_bwd, has_aux_tensors)
        for name, vec in (("score_mod", self.score_vec_size), ("score_mod_bwd", self.score_bwd_vec_size)):
            if vec not in (1, 2):
                raise ValueError(f"{name} __vec_size__={vec}: the SM120 backward takes 1 or 2")
        if getattr(mask_mod, "__vec_size__", 1) != 1:
            raise ValueError("mask_mod __vec_size__ must be 1 on the SM120 backward")

    def _mask_for_layout(self, mask_fn):
        return mask_fn  # this step masks per element itself, from the partial's indices

    @cute.jit
    def _one_m_block(
        self,
        m_block: Int32,
        smem_pipe_read_q: Int32,
        smem_pipe_read_do: Int32,
        smem_pipe_write_q: Int32,
        smem_pipe_write_do: Int32,
        mma_params,
        smem_copy_params,
        gmem_copy_params,
        load_Q_LSE: Callable,
        load_dO_dPsum: Callable,
        m_block_max: Int32,
        softmax_scale: Float32,
        softmax_scale_log2: Float32,
        aux_data: AuxData = AuxData(),
        mask_fn: Optional[Callable] = None,
        use_mask_mod: cutlass.Constexpr[bool] = True,
    ):
        # use_mask_mod=False: a block-sparse full tile (bwd_block_sparse.py), only the sequence bounds apply
        # upstream's mask partial carries the CTA's indices and the sequence's lengths
        mask = mask_fn.func.__self__
        n_block = mask_fn.keywords["n_block"]
        batch_idx = mask_fn.keywords["batch_idx"]
        head_idx = mask_fn.keywords["head_idx"]
        seqlen = mask.seqlen_info
        thr_mma = mma_params.thr_mma_sdp
        q_stage = smem_pipe_read_q if const_expr(self.num_stages_Q > 1) else 0
        do_stage = smem_pipe_read_do if const_expr(self.num_stages_dO > 1) else 0

        def load_Q_next():
            m_block_next = m_block + (self.num_stages_Q - 1 if const_expr(self.num_stages_Q > 1) else 1)
            if m_block_next < m_block_max:
                load_Q_LSE(m_block_next, smem_pipe_write_q)
            cute.arch.cp_async_commit_group()

        def load_dO_next():
            if m_block + self.num_stages_dO < m_block_max:
                load_dO_dPsum(m_block + self.num_stages_dO, smem_pipe_write_do)
            cute.arch.cp_async_commit_group()

        # rs: S^T = K Q^T (keys x queries, every warp along the keys), P^T and dS^T stay in registers
        rs = self.pds_in_regs
        tile = (self.m_block_size, self.n_block_size)
        origin = (m_block * tile[0], n_block * tile[1])
        if const_expr(rs):
            tile, origin = (tile[1], tile[0]), (origin[1], origin[0])
        tScS = thr_mma.partition_C(cute.domain_offset(origin, cute.make_identity_tensor(tile)))
        fastdiv = None
        if const_expr(aux_data.tensors is not None):
            fastdiv = (FastDivmodDivisorV2(seqlen.seqlen_q), FastDivmodDivisorV2(seqlen.seqlen_k))

        # S = Q K^T
        acc_S = cute.make_rmem_tensor(thr_mma.partition_shape_C(tile), Float32)
        acc_S.fill(0.0)
        cute.arch.cp_async_wait_group(1 if const_expr(self.num_stages_Q > 1) else 0)
        cute.arch.barrier()
        sm80_utils.gemm(
            thr_mma, acc_S, mma_params.tSrQ, mma_params.tSrK, smem_copy_params.tSsQ[None, None, None, q_stage],
            smem_copy_params.tSsK, smem_copy_params.smem_thr_copy_QdO, smem_copy_params.smem_thr_copy_KV,
            swap_AB=rs,
        )
        acc_S_pre = None
        if const_expr(self.score_mod_bwd is not None):
            acc_S_pre = cute.make_fragment_like(acc_S)
            acc_S_pre.store(acc_S.load())
        if const_expr(self.score_mod is not None):
            apply_score_mod_inner(
                acc_S, tScS, self.score_mod, batch_idx, head_idx, softmax_scale, self.score_vec_size, Float32,
                aux_data, fastdiv, seqlen, constant_q_idx=None, qhead_per_kvhead=1, transpose_indices=rs,
            )
        if const_expr(self.mask_mod is not None and use_mask_mod):
            self._apply_mask_mod(acc_S, tScS, batch_idx, head_idx, seqlen, aux_data, fastdiv, rs)
        # with mask_where_needed only the tiles that hold a masked element, else every tile
        elif bwd_mask.tile_needs_mask(mask, m_block, n_block, True, self.mask_causal,
                                      self.mask_local or not self.mask_where_needed):
            bwd_mask.apply_mask_any_layout(mask, acc_S, m_block, n_block, thr_mma, mask_seqlen=True,
                                           mask_causal=self.mask_causal, mask_local=self.mask_local, transposed=rs)

        # P = exp2(S' * scale_log2 - LSE_log2), LSE per query: the accumulator viewed (query, key), so per
        # row of S and per column of S^T alike
        def query_rows(acc):
            mn = layout_utils.reshape_acc_to_mn(acc)
            return layout_utils.select(mn, [1, 0]) if const_expr(rs) else mn

        tLSErLSE = cute.make_fragment_like(smem_copy_params.tSsLSEMma[None, 0])
        cute.autovec_copy(smem_copy_params.tSsLSEMma[None, q_stage], tLSErLSE)
        acc_S_mn = query_rows(acc_S)
        for r in cutlass.range(cute.size(acc_S_mn, mode=[0]), unroll_full=True):
            acc_S_mn[r, None].store(cute.math.exp2(acc_S_mn[r, None].load() * softmax_scale_log2 - tLSErLSE[r],
                                                   fastmath=True))

        # dP = dO V^T;  dS' = P (dP - dPsum);  dS = score_mod_bwd(dS', scale S)
        acc_dP = cute.make_rmem_tensor(thr_mma.partition_shape_C(tile), Float32)
        acc_dP.fill(0.0)
        cute.arch.cp_async_wait_group(1 if const_expr(self.num_stages_dO > 1) else 0)
        cute.arch.barrier()
        if const_expr(self._after_dp_barrier is not None):
            self._after_dp_barrier()  # fused_turns: the previous m_block's release
        sm80_utils.gemm(
            thr_mma, acc_dP, mma_params.tdPrdO, mma_params.tdPrV, smem_copy_params.tdPsdO[None, None, None, do_stage],
            smem_copy_params.tdPsV, smem_copy_params.smem_thr_copy_QdO, smem_copy_params.smem_thr_copy_KV,
            hook_fn=load_Q_next if const_expr(self.num_stages_Q > 1) else None, B_in_regs=self.V_in_regs, swap_AB=rs,
        )
        tLSErdPsum = cute.make_fragment_like(smem_copy_params.tSsdPsumMma[None, 0])
        cute.autovec_copy(smem_copy_params.tSsdPsumMma[None, do_stage], tLSErdPsum)
        acc_dP_mn = query_rows(acc_dP)
        for r in cutlass.range(cute.size(acc_dP_mn, mode=[0]), unroll_full=True):
            acc_dP_mn[r, None].store(acc_S_mn[r, None].load() * (acc_dP_mn[r, None].load() - tLSErdPsum[r]))
        if const_expr(self.score_mod_bwd is not None):
            apply_score_mod_bwd_inner(
                acc_dP, acc_S_pre, tScS, self.score_mod_bwd, batch_idx, head_idx, softmax_scale,
                self.score_bwd_vec_size, Float32, aux_data, fastdiv, seqlen, constant_q_idx=None, qhead_per_kvhead=1,
                transpose_indices=rs,
            )

        rP = cute.make_fragment_like(acc_S, self.dtype)
        rP.store(acc_S.load().to(self.dtype))
        rdS = cute.make_fragment_like(acc_dP, self.dtype)
        rdS.store(acc_dP.load().to(self.dtype))
        fetched = None  # fused_fetch: thread 0's early (relaxed) read of the turn's flag
        if const_expr(rs):
            # P^T and dS^T as the dK/dV products' A operand, in registers; dS^T to shared memory for the
            # dQ product only (which reduces over keys that other warps hold)
            tdVrP = layout_utils.reshape_acc_to_frgA(rP)
            tdKrdS = layout_utils.reshape_acc_to_frgA(rdS)
            self._store_dst(tdKrdS, mma_params.thr_mma_dkv, smem_copy_params.tdKsdSt)
        else:
            # P and dS to shared memory (the dK/dV and dQ products read them in another operand layout)
            tdVrP, tdKrdS = mma_params.tdVrP, mma_params.tdKrdS
            r2s = smem_copy_params.r2s_thr_copy_PdS
            cute.copy(r2s, r2s.retile(rP), smem_copy_params.tPsP)
            cute.arch.barrier()  # P is written
            if const_expr(self._after_p_barrier is not None):
                fetched = self._after_p_barrier()
            cute.copy(r2s, r2s.retile(rdS), smem_copy_params.tdSsdS)

        # dV += P^T dO
        sm80_utils.gemm(
            mma_params.thr_mma_dkv, mma_params.acc_dV, tdVrP, mma_params.tdVrdO, smem_copy_params.tdVsPt,
            smem_copy_params.tdVsdOt[None, None, None, do_stage], smem_copy_params.smem_thr_copy_PdSt,
            smem_copy_params.smem_thr_copy_QdOt, A_in_regs=rs,
        )
        if const_expr(self._before_dq_barrier is not None and self.num_stages_Q > 1):
            self._before_dq_barrier(fetched)  # fused_turns: thread 0 waits for the turn; the barrier tells the rest
        cute.arch.barrier()  # dS is written
        # with one Q stage, dK goes first so that the next Q load can start under the dQ product
        late = self.late_dq_adds  # deterministic: the adds and their turn's wait at the m_block's end
        if const_expr(self.num_stages_Q > 1):
            acc_dQ = self._dq_gemm(mma_params, smem_copy_params, load_dO_next)
            if const_expr(not late):
                self._dq_adds(acc_dQ, m_block + self._dq_block_offset, gmem_copy_params)
        sm80_utils.gemm(
            mma_params.thr_mma_dkv, mma_params.acc_dK, tdKrdS, mma_params.tdKrQ, smem_copy_params.tdKsdSt,
            smem_copy_params.tdKsQt[None, None, None, q_stage], smem_copy_params.smem_thr_copy_PdSt,
            smem_copy_params.smem_thr_copy_QdOt, hook_fn=load_dO_next if const_expr(self.num_stages_Q == 1) else None,
            A_in_regs=rs,
        )
        if const_expr(self.num_stages_Q == 1):
            if const_expr(self._before_dq_barrier is not None):
                self._before_dq_barrier(fetched)
            cute.arch.barrier()
            acc_dQ = self._dq_gemm(mma_params, smem_copy_params, load_Q_next)
        if const_expr(late):
            self._before_dq_adds()
        if const_expr(late or self.num_stages_Q == 1):
            self._dq_adds(acc_dQ, m_block + self._dq_block_offset, gmem_copy_params)

    @cute.jit
    def _store_dst(self, tdKrdS: cute.Tensor, thr_mma_dkv, tdKsdSt: cute.Tensor) -> None:
        """dS^T (registers, the dK product's A layout) into sdS through its transposed view, with
        stmatrix.trans: the inverse of the ldmatrix.trans that partitioned `tdKsdSt`, so each thread
        stores exactly the elements that load would have given it."""
        store = cute.make_tiled_copy_A(
            cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype), thr_mma_dkv,
        ).get_slice(cute.arch.thread_idx()[0])
        cute.copy(store, store.retile(tdKrdS), tdKsdSt)

    @cute.jit
    def _dq_gemm(self, mma_params, smem_copy_params, hook_fn: Callable):
        """dS K into a fresh fp32 accumulator (registers)."""
        shape = (self.head_dim_padded, self.m_block_size) if const_expr(self.dQ_swapAB) else (
            self.m_block_size, self.head_dim_padded)
        acc_dQ = cute.make_rmem_tensor(mma_params.thr_mma_dq.partition_shape_C(shape), Float32)
        acc_dQ.fill(0.0)
        sm80_utils.gemm(
            mma_params.thr_mma_dq, acc_dQ, mma_params.tdQrdS, mma_params.tdQrK, smem_copy_params.tdQsdS,
            smem_copy_params.tdQsKt, smem_copy_params.smem_thr_copy_dS, smem_copy_params.smem_thr_copy_Kt,
            swap_AB=self.dQ_swapAB, hook_fn=hook_fn,
        )
        return acc_dQ

    @cute.jit
    def _dq_adds(self, acc_dQ: cute.Tensor, m_block: Int32, gmem_copy_params) -> None:
        """dQ_accum[m_block] += acc_dQ with fp32 atomics (m_block: the accumulator tile; with dq_split
        offset to this CTA's accumulator), 16 bytes per reduction with dq_wide_adds."""
        acc_dQ_atomic = gmem_copy_params.gmem_thr_copy_dQaccum.retile(acc_dQ)
        tdQgdQaccum = gmem_copy_params.tdQgdQaccum[None, None, m_block]
        if const_expr(self.dq_fixed_point):  # deterministic: 64-bit fixed-point adds (bwd_fixed_point.py)
            base, scale = self._dq_fixed
            for i in cutlass.range(cute.size(acc_dQ_atomic), unroll_full=True):
                address = bwd_fixed_point.int64_address(fa_utils.elem_pointer(tdQgdQaccum, i).toint(), base)
                bwd_fixed_point.red_add_fixed(address, acc_dQ_atomic[i], scale)
        elif const_expr(self.dq_wide_adds):  # runs of four consecutive floats (bwd_sm120._setup_attributes)
            for j in cutlass.range(cute.size(acc_dQ_atomic) // DQ_WIDE_ELEMS, unroll_full=True):
                i = j * DQ_WIDE_ELEMS
                copy_utils.atomic_add_fp32x4(acc_dQ_atomic[i], acc_dQ_atomic[i + 1], acc_dQ_atomic[i + 2],
                                             acc_dQ_atomic[i + 3], fa_utils.elem_pointer(tdQgdQaccum, i))
        else:
            for i in cutlass.range(cute.size(acc_dQ_atomic), unroll_full=True):
                fa_utils.atomic_add_fp32(acc_dQ_atomic[i], fa_utils.elem_pointer(tdQgdQaccum, i))

    @cute.jit
    def _apply_mask_mod(self, acc_S: cute.Tensor, tScS: cute.Tensor, batch_idx: Int32, head_idx: Int32, seqlen,
                        aux_data: AuxData, fastdiv, transposed: cutlass.Constexpr[bool] = False):
        """-inf where mask_mod says False or the element lies outside the sequences (upstream's
        mask_mod semantics: it replaces causal/local, and the sequence bounds still apply)."""
        batch_ssa = fa_utils.scalar_to_ssa(batch_idx, Int32)
        head_ssa = fa_utils.scalar_to_ssa(head_idx, Int32)
        for i in cutlass.range(cute.size(acc_S), unroll_full=True):
            row = tScS[i][1] if const_expr(transposed) else tScS[i][0]  # transposed: tScS is (key, query)
            col = tScS[i][0] if const_expr(transposed) else tScS[i][1]
            q_for_mod = row
            kv_for_mod = col
            if const_expr(fastdiv is not None):
                _, q_for_mod = divmod(row, fastdiv[0])
                _, kv_for_mod = divmod(col, fastdiv[1])
            keep = call_mask_mod(self.mask_mod, batch_ssa, head_ssa, fa_utils.scalar_to_ssa(q_for_mod, Int32),
                                 fa_utils.scalar_to_ssa(kv_for_mod, Int32), seqlen, aux_data)
            kept = acc_S[i] if cutlass.Boolean(fa_utils.ssa_to_scalar(keep)) else -Float32.inf
            outside = row >= seqlen.seqlen_q or col >= seqlen.seqlen_k
            acc_S[i] = -Float32.inf if outside else kept
